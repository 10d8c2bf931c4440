"""The FSDP lab's script: the notebook writes exactly the file in scripts/, and that file trains exactly
what ``distlab.train --strategy fsdp`` trains, holding exactly the bytes the memory model predicts."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distlab.data import write_tiny_mnist
from distlab.models import build_model, count_parameters
from distlab.predict.memory import expected_state_bytes, shard_unit_shapes
from distlab.results import read_result
from distlab.testing import run_torchrun, written_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "fsdp_train.py"
LAB = ROOT / "notebooks" / "lab_fsdp.ipynb"


def test_the_lab_writes_the_script_byte_for_byte():
    assert written_file(LAB, "fsdp_train.py") == SCRIPT.read_text()


def _predicted_state(model: str, strategy: str, rank: int) -> int:
    meta = build_model(model, device="meta")
    units = shard_unit_shapes(meta)
    return sum(expected_state_bytes(count_parameters(meta), strategy, 2, units=units, rank=rank).values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Four independent 2-rank jobs, launched together so their start-ups overlap: the script and
    ``distlab.train --strategy fsdp`` on the same MNIST files and seed, and the script on a GPT, plain and
    with the lab's prefetch and offload options."""
    out = tmp_path_factory.mktemp("fsdp-lab")
    data = write_tiny_mnist(out / "data", train_size=100)  # 50 a rank: a partial batch of 2, as MNIST has one
    common = ["--dataset", "mnist", "--data-dir", str(data), "--epochs", "2", "--batch-size", "16"]
    common += ["--num-workers", "0", "--seed", "3"]
    library = ["--strategy", "fsdp", "--model", "cnn", "--device", "cpu", "--run-name", "library", "--log-every", "-1"]
    gpt = ["--model", "gpt-tiny", "--samples", "128", "--batch-size", "16", "--num-workers", "0"]
    jobs = {
        "script": (str(SCRIPT), *common, "--out", str(out / "script.json")),
        "library": ("distlab.train", *library, *common, "--out", str(out)),
        "gpt": (str(SCRIPT), *gpt, "--checkpoint-activations", "--out", str(out / "gpt.json")),
        "gpt-options": (
            str(SCRIPT),
            *gpt,
            "--checkpoint-activations",
            "--prefetch-depth",
            "2",
            "--cpu-offload",
            "--out",
            str(out / "gpt-options.json"),
        ),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = {name: pool.submit(run_torchrun, 2, *args, timeout=180) for name, args in jobs.items()}
    for name, job in done.items():
        assert job.result().returncode == 0, f"{name}: {job.result().stderr[-3000:]}"
    return {name: read_result(out / f"{name}.json") for name in jobs}


@pytest.mark.slow
def test_the_script_trains_exactly_like_distlab_train(runs):
    """Same seed, same MNIST files, two epochs (so a missing set_epoch would show): every step's loss and the
    final test loss agree to float rounding, so the weights did at every step. The CNN's odd-sized layers
    make FSDP pad its shards, and each rank's parameters, gradients and Adam state are the predicted bytes."""
    ours, theirs = runs["script"], runs["library"]
    assert ours["environment"]["backend"] == "gloo" and ours["environment"]["world_size"] == 2
    for a, b in zip(ours["metrics"]["epochs"], theirs["metrics"]["epochs"], strict=True):
        assert len(a["step_loss"]) == len(b["step_loss"]) == 3  # 50 images a rank: 3 batches of 16, 2 dropped
        assert a["step_loss"] == pytest.approx(b["step_loss"], rel=1e-6)
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
    epochs = ours["metrics"]["epochs"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    held = [rank["state_bytes"] for rank in ours["metrics"]["memory"]]
    assert held == [_predicted_state("cnn", "fsdp", rank) for rank in range(2)]


@pytest.mark.slow
def test_a_gpt_with_activation_checkpointing_holds_the_predicted_shards(runs):
    """The GPT path: synthetic tokens, a tied embedding and head in the root unit, checkpointed blocks."""
    (epoch,) = runs["gpt"]["metrics"]["epochs"]
    assert epoch["step_loss"][-1] < epoch["step_loss"][0]
    assert math.isfinite(epoch["test_loss"]) and 0 <= epoch["test_accuracy"] <= 1
    held = [rank["state_bytes"] for rank in runs["gpt"]["metrics"]["memory"]]
    assert held == [_predicted_state("gpt-tiny", "fsdp", rank) for rank in range(2)]
    # Sharding halves (up to padding) what a rank holds: the point of FSDP.
    assert held[0] < 0.6 * _predicted_state("gpt-tiny", "ddp", 0)


@pytest.mark.slow
def test_prefetch_depth_and_offload_change_no_arithmetic(runs):
    """Two units gathered ahead and the state in host memory: the same losses and the same bytes held (on a CPU
    nothing moves, and there is no second stream: the lab times them on GPUs)."""
    (plain,), (options,) = runs["gpt"]["metrics"]["epochs"], runs["gpt-options"]["metrics"]["epochs"]
    assert options["step_loss"] == pytest.approx(plain["step_loss"], rel=1e-6)
    assert runs["gpt-options"]["config"]["prefetch_depth"] == 2 and runs["gpt-options"]["config"]["cpu_offload"]
    held = [rank["state_bytes"] for rank in runs["gpt-options"]["metrics"]["memory"]]
    assert held == [rank["state_bytes"] for rank in runs["gpt"]["metrics"]["memory"]]
