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


def test_a_memory_snapshot_asked_of_a_cpu_run_is_refused_by_the_parser(capsys):
    """The snapshot records CUDA's allocator: on the CPU the script says so in one line (exit 2) before any rank
    starts, rather than running without it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lab_script_fsdp_train", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as refused:
        script.parse_args(["--device", "cpu", "--memory-snapshot", "snapshots"])
    assert refused.value.code == 2
    assert "--memory-snapshot records CUDA's allocator: use --device cuda" in capsys.readouterr().err
    assert script.parse_args(["--device", "cuda", "--memory-snapshot", "snapshots"]).memory_snapshot == "snapshots"


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


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lab_script_fsdp_train", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


ADAPTER_RUN = ["--model", "gpt-tiny", "--n-layer", "1", "--adapter-rank", "4", "--max-steps", "2", "--samples", "64"]
ADAPTER_RUN += ["--batch-size", "16", "--num-workers", "0", "--device", "cpu"]


def adapter_runs(runtime, out: str) -> dict[str, dict]:
    """The lab's part 4 on these gloo ranks: ``fsdp_train.py --adapter-rank 4`` under both wraps, the script's own
    ``parse_args`` and ``train`` (its ``main`` would make the group these ranks already have)."""
    script = _load_script()
    for wrap in ("ddp", "fsdp"):
        script.train(script.parse_args([*ADAPTER_RUN, "--wrap", wrap, "--out", f"{out}/{wrap}.json"]), runtime.device)
    return {wrap: read_result(Path(out) / f"{wrap}.json") for wrap in ("ddp", "fsdp")} if runtime.rank == 0 else {}


def _padded(shapes, n: int) -> int:
    """Values of these parameters as FSDP2 moves them on n ranks: each first dimension padded to a multiple of n."""
    return sum(-(-shape[0] // n) * n * math.prod(shape[1:]) for shape in shapes)


def expected_adapter_run(model: str, n_layer: int, rank: int, n: int) -> dict:
    """Derived from the GPT's shapes, not taken from the script: its parameters, the adapters' (``down`` and ``up``
    beside qkv, proj and the MLP's two linear layers of every block), the parameters that get gradients, and the
    bytes each wrap sends in a step (``expected_bytes_per_step``): DDP all-reduces the adapters' gradients alone;
    FSDP2 gathers every parameter, the frozen base too, before forward and before backward (the root, which stays
    gathered, once) and reduce-scatters the adapters' gradients."""
    from dataclasses import replace

    from distlab.models import GPT_PRESETS, gpt_param_count
    from distlab.predict.traffic import expected_bytes_per_step

    cfg = replace(GPT_PRESETS[model], n_layer=n_layer)
    d = cfg.d_model
    root = [(cfg.vocab_size, d), (cfg.seq_len, d), (d,), (d,)]  # embeddings (the head is tied) and the final norm
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    linears = {"qkv": (d, 3 * d), "proj": (d, d), "mlp.0": (d, 4 * d), "mlp.2": (4 * d, d)}  # in, out
    adapters = [shape for i, o in linears.values() for shape in ((rank, i), (o, rank))] * n_layer
    assert _padded(root + block * n_layer, 1) == gpt_param_count(cfg)
    every, trainable = _padded(root + block * n_layer + adapters, 1), _padded(adapters, 1)
    sharded = _padded(root + block * n_layer + adapters, n)
    fsdp = expected_bytes_per_step("fsdp", sharded, n, gathered_once=_padded(root, n), trainable=_padded(adapters, n))
    return {
        "parameters": every,
        "trainable": trainable,
        "with_gradients": {
            f"blocks.{b}.{layer}.{half}.weight" for b in range(n_layer) for layer in linears for half in ("down", "up")
        },  # fmt: skip
        "bytes": {"ddp": expected_bytes_per_step("ddp", every, n, trainable=trainable), "fsdp": fsdp},
    }


def check_adapter_runs(runs: dict[str, dict], n: int, device: str) -> None:
    """What part 4 shows, checked on each wrap's result file: only the adapters had gradients and moved, the base
    did not move, and every rank's counted bytes equal the prediction to the byte, every byte on ``device``."""
    config = runs["ddp"]["config"]
    expected = expected_adapter_run(config["model"], config["n_layer"], config["adapter_rank"], n)
    for wrap, record in runs.items():
        metrics = record["metrics"]
        assert (metrics["parameters"], metrics["trainable_parameters"]) == (expected["parameters"],
                                                                           expected["trainable"]), wrap  # fmt: skip
        assert set(metrics["with_gradients"]) == expected["with_gradients"], wrap
        traffic = metrics["traffic"]
        assert traffic["bytes_sent"] == [expected["bytes"][wrap]] * n, (wrap, traffic)
        assert traffic["predicted_bytes"] == expected["bytes"][wrap], wrap
        assert set(traffic["bytes_by_device"]) == {device}, (wrap, traffic)
        assert metrics["largest_change"]["frozen"] == 0.0 and metrics["largest_change"]["adapters"] > 0, wrap
    assert set(runs["ddp"]["metrics"]["traffic"]["collectives"]) == {"all_reduce"}
    assert set(runs["fsdp"]["metrics"]["traffic"]["collectives"]) == {"all_gather", "reduce_scatter"}
    assert expected["bytes"]["fsdp"] > 10 * expected["bytes"]["ddp"]  # 2 + f against 2f over a frozen base


def test_adapters_over_a_frozen_gpt_send_the_predicted_bytes_under_both_wraps(ranks2, tmp_path):
    """The lab's part 4 on two gloo ranks, a one-block gpt-tiny frozen, rank-4 adapters beside its four linear
    layers: the checks of :func:`check_adapter_runs`, and FSDP2's calls: the root gathered once, the block
    twice, one reduce-scatter (the root has nothing to reduce). GPU twin:
    ``tests/test_gpu_labs.py::test_the_fsdp_labs_adapter_part_sends_the_predicted_bytes_on_nccl_ranks``."""
    runs = ranks2.run(adapter_runs, str(tmp_path))[0]
    check_adapter_runs(runs, 2, "cpu")
    sharded = runs["fsdp"]["metrics"]["traffic"]["collectives"]
    assert {name: entry["calls"] for name, entry in sharded.items()} == {"all_gather": 3, "reduce_scatter": 1}
