"""The GPU tier, ``python -m pytest -m gpu``: every GPU path the course has, run on the GPU(s) present.

Not part of CI (no GPU there): the maintainers run it when a GPU is lent, from a checkout, with the packages of
``tests/gpu-requirements.txt``. Without a GPU every test here is skipped with one reason. It uses two GPUs when it
finds two: ``distlab.train`` with every strategy on one NCCL rank, on two gloo ranks sharing one GPU, and on one
NCCL rank per GPU; ``python -m distlab.gpu_report``; every lab played top to bottom; the exercises' grader on
CUDA ranks. Not yet timed: no GPU has run it since it was written.

Each GPU test has a CPU twin in CI that runs the same code up to the call that needs a GPU:

- training: ``test_every_gpu_training_command_parses_and_places_its_ranks`` below builds the same command lines
  for simulated machines of 1, 2 and 8 GPUs, parses them, and places every rank;
- the report: ``tests/test_command_lines.py`` parses every part of ``gpu_report.plan`` for simulated machines;
- the labs: ``tests/test_kaggle.py`` plays every lab on the CPU, ``tests/test_lab_placement.py`` checks their
  set-up for 0, 1 and 2 GPUs and that every script they launch is told its device;
- the grader: ``tests/test_placement.py`` places every exercise for 0 to 8 GPUs, and ``tests/test_exercises.py``
  grades every solution on gloo ranks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.cli import parse
from distlab.config import TrainConfig
from distlab.exercises import grade
from distlab.exercises.catalog import all_exercises
from distlab.exercises.grader import _placement
from distlab.parallel import STRATEGIES
from distlab.results import read_result
from distlab.runtime import Placement, gpu_count, place, rank_device, rank_placement
from distlab.testing import run_torchrun, write_tiny_mnist

ROOT = Path(__file__).resolve().parents[1]
GPUS = gpu_count()

LAYOUTS = ("one NCCL rank", "two gloo ranks share one GPU", "one NCCL rank per GPU")


def layout(name: str, gpus: int) -> tuple[Placement, dict[str, str]] | None:
    """The placement a layout gets on a machine of ``gpus`` GPUs, and the environment its job needs; None where
    the machine cannot show it (one rank per GPU needs two GPUs or more)."""
    if name == "one NCCL rank":
        return place(1, gpus=gpus), {}
    if name == "two gloo ranks share one GPU":  # what Colab and Kaggle's single-GPU kernels give: the ranks see one
        return place(2, "cuda", "gloo", gpus=1), {"CUDA_VISIBLE_DEVICES": "0"}
    return (place(None, gpus=gpus), {}) if gpus >= 2 else None


TRAIN_CASES = [(name, ("--model", "cnn")) for name in STRATEGIES] + [
    (name, ("--model", "gpt-tiny", "--precision", "16-bit")) for name in ("zero3", "fsdp")
]
"""Every strategy on the course's CNN, and the two that shard parameters on a GPT in mixed precision (the H200's
first path). ``16-bit`` becomes bf16 where the GPU has it, fp16 elsewhere (a T4)."""


def train_argv(strategy: str, model: tuple[str, ...], placement: Placement, bf16: bool) -> list[str]:
    args = [arg.replace("16-bit", "bf16" if bf16 else "fp16") for arg in model]
    return ["--strategy", strategy, *args, "--dataset", "synthetic", "--synthetic-size", "512", "--epochs", "1",
            "--batch-size", "32", "--log-every", "0", *placement.args]  # fmt: skip


SHARED_GPU_STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
"""On two gloo ranks sharing a GPU, one strategy of each kind (replicated, sharded gradients, sharded parameters
by hand and torch's FSDP2): the tier's eight minutes do not hold every strategy twice."""


def _fits(strategy: str, ranks: int, where: str = "") -> bool:
    cls = STRATEGIES[strategy]
    if where == "two gloo ranks share one GPU" and strategy not in SHARED_GPU_STRATEGIES:
        return False
    return ranks >= cls.min_world_size and (cls.max_world_size is None or ranks <= cls.max_world_size)


CASE_IDS = [f"{s}-{m[1]}" for s, m in TRAIN_CASES]


@pytest.mark.parametrize("where", LAYOUTS)
@pytest.mark.parametrize("strategy, model", TRAIN_CASES, ids=CASE_IDS)
def test_every_gpu_training_command_parses_and_places_its_ranks(strategy, model, where):
    """The CPU twin of :func:`test_train_on_the_gpu`: its command lines for 1, 2 and 8 GPUs, up to the device."""
    for gpus in (1, 2, 8):
        laid_out = layout(where, gpus)
        if laid_out is None or not _fits(strategy, laid_out[0].ranks, where):
            continue
        placement, env = laid_out
        cfg = parse(TrainConfig, train_argv(strategy, model, placement, bf16=gpus != 2), "distlab.train")
        visible = 1 if "CUDA_VISIBLE_DEVICES" in env else gpus
        ranks = rank_placement(cfg.parallel.device, cfg.parallel.backend, placement.ranks, gpus=visible)
        devices = [rank_device(ranks, r) for r in range(placement.ranks)]
        assert all(d.type == "cuda" and d.index < visible for d in devices), (gpus, devices)
        if ranks.backend == "nccl":
            assert len(set(devices)) == len(devices)  # NCCL: a GPU each


@pytest.mark.parametrize("where", LAYOUTS)
@pytest.mark.parametrize("strategy, model", TRAIN_CASES, ids=CASE_IDS)
@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is")
def test_train_on_the_gpu(strategy, model, where, tmp_path, monkeypatch):
    import torch

    from distlab.labs.launch import train
    from distlab.results import read_result

    laid_out = layout(where, GPUS)
    if laid_out is None:
        pytest.skip(f"{where} needs two GPUs or more; this machine has {GPUS}")
    placement, env = laid_out
    if not _fits(strategy, placement.ranks, where):
        pytest.skip(f"{strategy}: not on {where} ({placement.ranks} rank(s))")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    result = train(*train_argv(strategy, model, placement, bf16), nproc=placement.ranks, out=tmp_path, echo=False)
    assert result["environment"]["backend"] == placement.backend
    assert result["environment"]["device"].startswith("cuda")
    assert math.isfinite(result["metrics"]["epochs"][0]["train_loss"])
    assert result["metrics"]["step_time_median_s"] is not None  # the end-of-run reduction the H200 run failed in
    assert read_result(next(tmp_path.glob("*.json")))


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is")
def test_the_gpu_report_runs_every_part_that_should_and_says_so(tmp_path):
    command = [sys.executable, "-m", "distlab.gpu_report", "--out", str(tmp_path), "--budget-s", "240", "--quick"]
    job = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    (report,) = tmp_path.glob("*/report.json")
    parts = json.loads(report.read_text())["parts"]
    failed = [p for p in parts if p["status"] == "failed"]
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is")
def test_the_sweeps_fsdp2_point_measures_each_variants_cuda_peak_alone_on_the_gpu(tmp_path):
    """The sweep's FSDP2 point on one CUDA rank, at a small size: each FSDP2 variant timed alone, with CUDA's peak
    of its own step; CUDA's allocated peak holds at least what the course counts. CPU twin:
    ``tests/test_sweep.py::test_the_fsdp2_point_runs_its_variants_alone_uncalibrated_and_the_report_says_so``."""
    bf16 = __import__("torch").cuda.is_bf16_supported(including_emulation=False)
    done = run_torchrun(
        1, "distlab.bench.sweep", "--models", "gpt-mini", "--batch-size", "8", "--seq-len", "256", "--steps", "2",
        "--fsdp2-point", "gpt-mini:16", "--precision", "bf16" if bf16 else "fp16", "--collective-sizes", "1MB",
        "--device", "cuda", "--out", str(tmp_path), "--name", "sweep",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    alone = read_result(tmp_path / "sweep.json")["metrics"]["presets"][-1]
    assert alone["point"] == "fsdp2-sized" and "local" not in alone
    for row in alone["variants"]:
        (cuda,) = row["cuda_memory"]
        counted = max(rank["peak"] for rank in row["memory"]["ranks"])
        assert cuda["max_allocated"] >= counted * 0.95, (row["variant"], cuda, counted)


LABS = sorted((ROOT / "notebooks").glob("lab*.ipynb"))


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is")
def test_every_lab_plays_top_to_bottom_on_the_gpus_present(lab, tmp_path, monkeypatch):
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    working = tmp_path / "working"
    working.mkdir()
    shutil.copy(lab, working / lab.name)
    write_tiny_mnist(working / "data")  # no network on a GPU image: MNIST's format, written here
    notebook = nbformat.read(working / lab.name, as_version=4)
    # the kernel inherits the environment: it imports this checkout's distlab, as the maintainers run it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    nbclient.NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(working)}}).execute()
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    setup = "".join(output.get("text", "") for output in first.outputs)
    assert "No CUDA GPU here" not in setup, setup
    gpu_results = [json.loads(p.read_text()) for p in (working / "results").glob("*.json") if p.name != "hardware.json"]
    devices = {r.get("environment", {}).get("device", "") for r in gpu_results}
    assert not gpu_results or any(d.startswith("cuda") for d in devices), devices  # nothing on the CPU beside a GPU


EXERCISES = sorted(all_exercises())


@pytest.mark.parametrize("name", EXERCISES)
@pytest.mark.gpu
@pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is")
def test_the_grader_passes_every_solution_on_cuda_ranks(name):
    exercise = all_exercises()[name]
    placement = _placement(exercise, None, "auto")
    if placement.device != "cuda":
        pytest.skip(f"{name} needs {min(2, exercise.ranks)} GPUs for NCCL ranks; {placement.reason}")
    verdict = grade(name, exercise.solution_function())
    assert verdict.passed and verdict.device == "cuda", verdict.message
