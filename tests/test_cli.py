"""The command line, end to end under torchrun: result files with
provenance, and one clear line for each mistake a user makes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distlab.config import TrainConfig
from distlab.errors import DistlabError
from distlab.labs.launch import run_job
from distlab.results import SCHEMA, read_result
from distlab.testing import CNN_PARAMETERS, run_entry, run_torchrun

QUICK = [
    "--model",
    "cnn",
    "--device",
    "cpu",
    "--epochs",
    "1",
    "--max-steps",
    "3",
    "--batch-size",
    "16",
    "--synthetic-size",
    "256",
    "--num-workers",
    "0",
]


def _check_result(path: Path, strategy: str, world_size: int) -> dict:
    record = json.loads(path.read_text())
    assert record["schema"] == SCHEMA and record["kind"] == "train"
    assert record["config"]["parallel"]["strategy"] == strategy
    assert "world_size" not in record and "backend" not in record, "the environment alone says where the job ran"
    env = record["environment"]
    for key in (
        "torch",
        "cuda",
        "nccl",
        "backend",
        "world_size",
        "device",
        "device_name",
        "cpu",
        "git_commit",
        "date",
        "command",
    ):
        assert key in env, key
    assert env["torch"] == torch.__version__ and env["backend"] == "gloo" and env["world_size"] == world_size
    (epoch,) = record["metrics"]["epochs"]
    assert epoch["steps"] == 3 and epoch["samples_per_s"] > 0 and 0 <= epoch["test_accuracy"] <= 1
    assert record["metrics"]["parameters"] == CNN_PARAMETERS
    assert (
        record["metrics"]["optimizer_steps"] == 3 and record["metrics"]["step_time_median_s"] is None
    )  # 3 steps: none after the first three
    return record


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_train_entry_point_on_two_gloo_ranks_writes_a_result(tmp_path, strategy):
    run = run_torchrun(
        2, "distlab.train", "--strategy", strategy, "--dataset", "synthetic", "--out", str(tmp_path), *QUICK
    )
    assert run.returncode == 0, run.stderr[-3000:]
    _check_result(tmp_path / f"{strategy}-cnn-synthetic-2xcpu.json", strategy, 2)
    assert run.stdout.count("distlab: ") == 1, "only rank 0 logs"


def test_single_on_real_mnist_files(tmp_path, tiny_mnist):
    """In this process: with no launcher, the entry point's ``distributed()`` makes a one-rank group in memory."""
    from distlab.train import main

    main(["--strategy", "single", "--dataset", "mnist", "--data-dir", str(tiny_mnist), "--no-download",
          "--out", str(tmp_path), *QUICK])  # fmt: skip
    record = _check_result(tmp_path / "single-cnn-mnist-1xcpu.json", "single", 1)
    assert record["metrics"]["epochs"][0]["steps"] == 3


def test_an_entry_point_parses_its_command_line_with_the_config_a_launcher_checks():
    from dataclasses import dataclass

    from distlab.cli import entry_point, option, parse_or_refuse

    @dataclass
    class Greeting:
        """Say hello."""

        times: int = option(1, "how many times")

    runs = []

    @entry_point(Greeting, "distlab.greeting")
    def main(cfg: Greeting) -> None:
        """Greets."""
        runs.append(cfg)

    main(["--times", "3"])
    assert runs == [Greeting(times=3)] and main.config is Greeting
    assert main.__name__ == "main" and main.__doc__ == "Greets."
    with pytest.raises(SystemExit) as refused:  # what a rank would do with a bad flag ...
        main(["--times", "three"])
    assert refused.value.code == 2 and len(runs) == 1
    with pytest.raises(DistlabError, match="distlab.greeting: .*--times"):  # ... which a launcher says first
        parse_or_refuse(main.config, ["--times", "three"], "distlab.greeting")


def test_help_explains_every_flag(capsys):
    from distlab.train import main

    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    assert ended.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--strategy",
        "--model",
        "--dataset",
        "--device",
        "--epochs",
        "--out",
        "--accum-steps",
        "--loader",
        "--precision",
        "--activation-checkpointing",
        "--meta-init",
        "--fsdp-reshard-to",
        "--fsdp-prefetch",
        "--fsdp-param-dtype",
        "--fsdp-reduce-dtype",
        "--fsdp-cpu-offload",
        "--no-fsdp-reshard-between-micro-steps",
    ):
        assert flag in out


def _error_line(run: subprocess.CompletedProcess) -> str:
    lines = [line for line in run.stderr.splitlines() if line.startswith("distlab:")]
    assert lines, run.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--strategy", "ddp", "--fsdp-cpu-offload"], "use --strategy fsdp"),
        # the one-line refusal as a process shows once in the default tier; the other refusals also in slow
        pytest.param(
            ["--strategy", "fsdp", "--fsdp-reduce-dtype", "param"],
            "needs a low-precision --fsdp-param-dtype",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--strategy", "ddp", "--model", "resnet18", "--activation-checkpointing"],
            "BatchNorm statistics twice",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["fsdp_option_without_fsdp", "reduce_dtype_without_param_dtype", "checkpointing_batchnorm"],
)
def test_an_option_that_cannot_apply_is_one_line(tmp_path, flags, says):
    run = run_job([sys.executable, "-m", "distlab.train", *QUICK, "--out", str(tmp_path), *flags], timeout=120)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]


# A wrong world size, a group that cannot tile it, --device cuda without a GPU and a dataset missing offline
# are rows of distlab.demos.bad_inputs.BAD_INPUTS, which tests/test_failures.py runs.


@pytest.mark.parametrize(
    "flags, says",
    [(["--strategy", "single"], "runs on exactly 1 rank"), (["--strategy", "fsdp", "--fsdp-replicate", "3"], "divide")],
    ids=["single_on_two", "replicas_that_do_not_divide"],
)
def test_a_job_of_the_wrong_size_is_refused_before_any_rank_connects(monkeypatch, flags, says):
    """Rank 1 of 2, with no rendezvous to reach: it refuses before it makes the group, as every rank does. CI saw
    the refusal made after the group: rank 0 left while rank 1 was still connecting, and rank 1 said so as well."""
    from distlab import train

    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # the group, were it made, would fail on this instead
    monkeypatch.delenv("MASTER_PORT", raising=False)

    def no_group(*args, **kwargs):
        raise AssertionError("the group was made before the world size was checked")

    monkeypatch.setattr(train, "distributed", no_group)
    with pytest.raises(DistlabError, match=says):
        train.main([*flags, "--device", "cpu", "--model", "cnn", "--dataset", "synthetic"])


DEAD_RANK_SCRIPT = """
import os, torch, torch.distributed as dist
from distlab.runtime import distributed
from distlab.errors import run_main

def main(argv):
    with distributed("cpu", timeout_s=20) as rt:
        dist.barrier()
        if rt.rank == 1:
            os._exit(17)  # dies without a word, as an OOM-killed rank would
        dist.all_reduce(torch.ones(4))

run_main(main)
"""


@pytest.mark.slow
def test_a_dead_rank_ends_the_job_instead_of_hanging(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DEAD_RANK_SCRIPT)
    started = time.monotonic()
    run = run_torchrun(2, str(script), timeout=120)
    assert run.returncode != 0
    assert time.monotonic() - started < 90
    assert re.search(r"exitcode\s*:\s*17\b", run.stderr), run.stderr[
        -2000:
    ]  # torchrun names the rank that died, and how


def test_ddp_bench_times_every_variant_and_its_timeline_shows_overlap(ranks2, tmp_path):
    run_entry(
        ranks2,
        "distlab.bench.ddp_step",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--bucket-caps",
        "0.25",
        "--profile-cap",
        "0.25",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    )
    record = read_result(tmp_path / "ddp-step-cnn-2xcpu.json")
    variants = [r["variant"] for r in record["metrics"]["variants"]]
    assert (
        variants[0] == "local (no sync)" and "NaiveDDP" in variants and any(v.startswith("torch DDP") for v in variants)
    )
    assert all(len(r["times_s"]) == 3 for r in record["metrics"]["variants"])
    timeline = record["metrics"]["timeline"]
    backward_end = max(i["start_ms"] + i["dur_ms"] for i in timeline if i["lane"] == "compute")
    first_all_reduce = min(i["start_ms"] for i in timeline if i["lane"] == "communication")
    assert first_all_reduce < backward_end, "the first bucket's all-reduce should start while backward still runs"


def test_data_mistakes_demo_counts_what_each_rank_saw(ranks2, tmp_path):
    run_entry(ranks2, "distlab.demos.data_mistakes", "--samples", "200", "--batch-size", "10", "--out", str(tmp_path))
    report = read_result(tmp_path / "data-mistakes-2xcpu.json")["metrics"]
    assert report["no sampler"]["seen_by_every_rank"] == 200 and report["no sampler"]["problems"]
    assert report["sampler, no set_epoch"]["seen_by_every_rank"] == 0
    assert (
        report["sampler, no set_epoch"]["epochs_repeating_previous_order"] == 2
        and report["sampler, no set_epoch"]["problems"]
    )
    assert (
        report["sampler + set_epoch"]["epochs_repeating_previous_order"] == 0
        and not report["sampler + set_epoch"]["problems"]
    )


def test_shard_collectives_bench_checks_and_times_both_halves_of_all_reduce(ranks2, tmp_path):
    run_entry(
        ranks2,
        "distlab.bench.shard_collectives",
        "--sizes",
        "64KB",
        "--repeats",
        "2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    )
    rows = read_result(tmp_path / "shard-collectives-2xcpu.json")["metrics"]
    assert {(r["collective"], r["impl"]) for r in rows} == {
        ("all_reduce", "torch"),
        ("reduce_scatter", "torch"),
        ("reduce_scatter", "ring"),
        ("all_gather", "torch"),
        ("all_gather", "ring"),
    }
    assert all(r["time_s"] > 0 and r["busbw_GBps"] > 0 for r in rows)


def test_step_bench_times_each_strategy_and_counts_its_traffic(ranks2, tmp_path):
    args = ["--model", "gpt-tiny", "--seq-len", "32", "--strategies", "ddp,zero2", "--steps", "2", "--warmup", "1"]
    run_entry(ranks2, "distlab.bench.step", *args, "--device", "cpu", "--out", str(tmp_path))
    rows = {r["strategy"]: r for r in read_result(tmp_path / "step-gpt-tiny-2xcpu.json")["metrics"]["variants"]}
    assert set(rows) == {"ddp", "zero2"} and all(len(r["times_s"]) == 2 for r in rows.values())
    # on gloo the course's ZeRO reduce-scatters and all-gathers with its ring: point-to-point sends, DDP's bytes
    assert set(rows["zero2"]["traffic"]) == {"send"}
    assert rows["zero2"]["traffic"]["send"]["bytes_sent"] == rows["ddp"]["traffic"]["all_reduce"]["bytes_sent"]


def test_fsdp_options_bench_measures_what_each_option_trades(tmp_path):
    variants = "fsdp,keep_after_forward,checkpointing,bf16,zero3"
    args = ["--model", "gpt-tiny", "--seq-len", "64", "--variants", variants, "--steps", "1", "--warmup", "0"]
    # Ranks of its own, not the session's pool: its assertion is exact to the byte, and on the pool's ranks, after
    # whatever earlier tests ran there, FSDP2's peak once counted 199,936 bytes more (CI, 6ff8c92); a fresh job has
    # counted the same bytes on every run.
    job = run_torchrun(2, "distlab.bench.fsdp_options", *args, "--device", "cpu", "--out", str(tmp_path))
    assert job.returncode == 0, job.stderr[-2000:]
    rows = {r["variant"]: r for r in read_result(tmp_path / "fsdp-options-gpt-tiny-2xcpu.json")["metrics"]["variants"]}
    assert list(rows) == variants.split(",")
    peak = {name: row["memory"]["ranks"][0]["peak_by_category"] for name, row in rows.items()}
    assert peak["keep_after_forward"]["gathered"] > peak["fsdp"]["gathered"]  # every block kept until backward
    assert peak["checkpointing"]["activations"] < peak["fsdp"]["activations"]  # each block keeps only its input
    assert peak["bf16"]["activations"] < peak["fsdp"]["activations"]  # half the bytes a value
    # torch's FSDP2 and the course's ZeRO-3 hold the same bytes at their peak, but for Adam's step counters
    # (4 bytes each): FSDP2 steps each parameter's shard, ZeRO-3 one flat shard per unit (the blocks and the root)
    from distlab.models import build_model

    model = build_model("gpt-tiny", device="meta")
    extra_counters = len({id(p) for p in model.parameters()}) - (len(model.shard_units()) + 1)
    fsdp, zero3 = (rows[name]["memory"]["ranks"][0]["peak"] for name in ("fsdp", "zero3"))
    assert fsdp - zero3 == 4 * extra_counters


def test_a_sequence_longer_than_the_model_takes_is_one_line(tmp_path):
    done = run_job(
        [sys.executable, "-m", "distlab.bench.step", "--model", "gpt-tiny", "--seq-len", "128", "--out", str(tmp_path)],
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [_error_line(done)], done.stderr[-2000:]
    assert "--seq-len" in done.stderr


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_train_writes_per_rank_memory_that_matches_the_model(ranks2, tmp_path, strategy):
    from distlab.models import build_model
    from distlab.predict.memory import expected_state_bytes, shard_unit_shapes

    args = ["--model", "gpt-tiny", "--batch-size", "8", "--synthetic-size", "256", "--max-steps", "3"]
    args += ["--num-workers", "0"]
    run_entry(ranks2, "distlab.train", "--strategy", strategy, "--device", "cpu", *args, "--out", tmp_path)
    metrics = read_result(tmp_path / f"{strategy}-gpt-tiny-synthetic-2xcpu.json")["metrics"]
    units = shard_unit_shapes(build_model("gpt-tiny"))
    for rank, measured in enumerate(metrics["memory"]["ranks"]):
        expected = expected_state_bytes(metrics["parameters"], strategy, 2, units=units, rank=rank)
        assert {key: measured[key] for key in expected} == expected
        assert measured["peak"] >= sum(expected.values())


def test_a_failed_job_is_reported_by_its_reason_not_its_banner():
    from distlab.jobs import reason_from_lines

    banner = "distlab: fsdp | cnn (405,898 parameters) | synthetic | 2 rank(s)\n"
    assert reason_from_lines([banner, "distlab: error: --batch-size must be at least 1\n"]).startswith("distlab: error")
    crashed = reason_from_lines(
        [banner, "epoch 1/1 | train loss 2.2\n", "terminate called without an active exception\n"]
    )
    assert "terminate called" in crashed and "epoch 1/1" in crashed


def test_evaluation_holds_no_more_logits_than_a_training_step():
    """By default an evaluation batch is a training micro-step's (gpt-small's old default of 512 sequences held
    13 GB of logits per rank); a batch set by hand is kept."""
    assert TrainConfig.from_flags(model="gpt-small", batch_size=2).eval_batch_size() == 2
    assert TrainConfig.from_flags(batch_size=8, eval_batch_size=256).eval_batch_size() == 256
    with pytest.raises(DistlabError, match="--eval-batch-size must be 0"):
        TrainConfig.from_flags(eval_batch_size=-1)
