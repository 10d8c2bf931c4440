"""The DDP lab's script: the notebook writes exactly the file in scripts/, that file trains exactly what
``distlab.train --strategy ddp`` trains, and its checkpoint resumes the run exactly where it stopped."""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from distlab.data import write_tiny_mnist
from distlab.models import ATOL, build_model
from distlab.results import read_result
from distlab.testing import assert_same_state, run_torchrun, written_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ddp_train.py"
PROFILER = ROOT / "scripts" / "profile_ddp.py"
LAB = ROOT / "notebooks" / "lab_ddp_mnist.ipynb"


def test_the_lab_writes_the_script_byte_for_byte():
    assert written_file(LAB, "ddp_train.py") == SCRIPT.read_text()
    assert written_file(LAB, "profile_ddp.py") == PROFILER.read_text()


# The two lab scripts are standalone on purpose (a learner copies one file), so what they share is written twice:
# these functions must stay the same in both, but for the script's own name in its messages.
SHARED_WITH_THE_FSDP_SCRIPT = ("default_device", "device_and_backend", "compute_dtype", "environment")
SHARED_WITH_THE_PROFILER = ("default_device", "device_and_backend")


def _functions(path: Path) -> dict[str, str]:
    source = path.read_text()
    tree = ast.parse(source)
    named = {node.name: ast.get_source_segment(source, node) for node in tree.body if isinstance(node, ast.FunctionDef)}
    return {name: text.replace(path.name, "<script>") for name, text in named.items()}


def test_what_the_two_lab_scripts_share_is_the_same_in_both():
    ddp, fsdp = _functions(SCRIPT), _functions(SCRIPT.with_name("fsdp_train.py"))
    for name in SHARED_WITH_THE_FSDP_SCRIPT:
        assert ddp[name] == fsdp[name], f"{name} differs between ddp_train.py and fsdp_train.py"
    loader = [line.strip() for line in ddp["train"].splitlines() if "DataLoader(" in line or "drop_last=True" in line]
    assert loader and all(line in fsdp["train"] for line in loader), loader
    profiler = _functions(PROFILER)
    for name in SHARED_WITH_THE_PROFILER:
        assert ddp[name] == profiler[name], f"{name} differs between ddp_train.py and profile_ddp.py"


@pytest.mark.slow
def test_the_profiled_step_and_the_hooks_run_on_two_gloo_ranks(tmp_path):
    """The lab's part 6 as a CPU runs it: a trace a rank with three kept steps, rank 0's sums read from its own
    trace (exposed <= communication <= step), and each hook's run training as fp32 does (16-bit gradients round)."""
    from distlab.measure.profile import read_steps

    job = run_torchrun(2, str(PROFILER), "--device", "cpu", "--steps", "3", "--out", str(tmp_path))
    _ok(job)
    for rank in (0, 1):
        steps = read_steps(tmp_path / f"trace-rank{rank}.json")
        assert len(steps) == 3 and all(e["name"].startswith("gloo:") for s in steps for e in s["events"]
                                       if e["lane"] == "communication")  # fmt: skip
    (profiled,) = [line for line in job.stdout.splitlines() if line.startswith("profiled, rank 0")]
    numbers = dict(re.findall(r"(step|compute|communication|under compute|exposed) ([\d.]+)", profiled))
    assert float(numbers["exposed"]) <= float(numbers["communication"]) <= float(numbers["step"]), profiled
    losses = dict(re.findall(r"^(fp32 \(no hook\)|\w+_compress_hook): .*; loss [\d.]+ -> ([\d.]+)$", job.stdout, re.M))
    assert set(losses) == {"fp32 (no hook)", "fp16_compress_hook", "bf16_compress_hook"}, job.stdout
    assert all(abs(float(v) - float(losses["fp32 (no hook)"])) < 0.02 for v in losses.values()), losses


def _ok(job) -> None:
    assert job.returncode == 0, job.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """On the same MNIST files and seed: ``distlab.train --strategy ddp`` for three epochs, and the script for two,
    stopped, then resumed from its checkpoint for the third. The test set has an odd size (41), so two ranks
    cannot split it evenly: a DistributedSampler would pad it with a repeated sample."""
    out = tmp_path_factory.mktemp("ddp-lab")
    data = write_tiny_mnist(out / "data", train_size=100, test_size=41)  # 50 a rank: a partial batch, as MNIST has
    common = ["--dataset", "mnist", "--data-dir", str(data), "--batch-size", "16", "--num-workers", "0", "--seed", "3"]
    script = (str(SCRIPT), *common, "--checkpoint", str(out / "checkpoint.pt"))
    library = ["--strategy", "ddp", "--model", "cnn", "--device", "cpu", "--run-name", "library", "--log-every", "-1"]
    library += [*common, "--epochs", "3", "--save-model", "--out", str(out)]
    with ThreadPoolExecutor(2) as pool:  # two independent jobs: their start-ups overlap
        first = pool.submit(run_torchrun, 2, *script, "--epochs", "2", "--out", str(out / "first.json"), timeout=180)
        reference = pool.submit(run_torchrun, 2, "distlab.train", *library, timeout=180)
        _ok(first.result())
        _ok(reference.result())
    _ok(run_torchrun(2, *script, "--epochs", "3", "--resume", "--out", str(out / "resumed.json"), timeout=180))
    return {
        "first": read_result(out / "first.json"),
        "resumed": read_result(out / "resumed.json"),
        "library": read_result(out / "library.json"),
        "library_weights": torch.load(out / "library.pt", weights_only=True),
        "checkpoint": torch.load(out / "checkpoint.pt", weights_only=True),
    }


@pytest.mark.slow
def test_the_script_and_its_resumed_run_train_exactly_like_distlab_train(runs):
    """Every step's loss, and each epoch's training and test numbers, agree to float rounding over three
    epochs, the last one after a restart: so the weights did at every step. A missing set_epoch (epochs 2 and 3
    would repeat epoch 1's order), a resume that reshuffles from epoch 0 or drops Adam's state, or a test sample
    counted twice would each move them far more."""
    ours = runs["first"]["metrics"]["epochs"] + runs["resumed"]["metrics"]["epochs"]
    theirs = runs["library"]["metrics"]["epochs"]
    assert [e["epoch"] for e in ours] == [e["epoch"] for e in theirs] == [1, 2, 3]
    for a, b in zip(ours, theirs, strict=True):
        assert len(a["step_loss"]) == len(b["step_loss"]) == 3  # 50 images a rank: 3 batches of 16, 2 dropped
        assert a["step_loss"] == pytest.approx(b["step_loss"], rel=1e-6)
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
    assert ours[-1]["train_loss"] < 0.5 * ours[0]["train_loss"]
    environment = runs["first"]["environment"]
    assert environment["backend"] == "gloo" and environment["world_size"] == 2


@pytest.mark.slow
def test_the_checkpoint_rank_0_wrote_holds_the_trained_weights(runs):
    """The file loads into a bare model (no DDP "module." prefix) and holds, after the resumed epoch, the weights
    distlab.train ended with, far from where training started; and the optimizer state to resume from."""
    checkpoint = runs["checkpoint"]
    assert checkpoint["epoch"] == 3
    model = build_model("cnn")
    model.load_state_dict(checkpoint["model"])
    assert_same_state(model.state_dict(), runs["library_weights"], label="checkpoint")
    torch.manual_seed(3)
    initial = build_model("cnn").state_dict()
    assert max((initial[k] - checkpoint["model"][k]).abs().max().item() for k in initial) > 100 * ATOL
    steps = {state["step"].item() for state in checkpoint["optimizer"]["state"].values()}
    assert steps == {9}  # Adam's step count: three epochs of three steps
