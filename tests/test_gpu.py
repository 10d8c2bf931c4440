"""The GPU tier, ``python -m pytest -m gpu``: every GPU path the course has, run on the GPU(s) present.

Not part of CI (no GPU there): the maintainers run it when a GPU is lent, from a checkout, with the packages of
``tests/gpu-requirements.txt`` (``python scripts/gpu_check.py OUT`` installs them, runs the quick selection and a
quick GPU report, and writes one folder). Without a GPU every test here is skipped with one reason. It uses two
GPUs when it finds two: ``distlab.train`` with every strategy on one NCCL rank, on two gloo ranks sharing one GPU,
and on one NCCL rank per GPU, in fp16 as a T4 runs it whatever the GPU supports; ``python -m distlab.gpu_report``;
every lab played top to bottom; the exercises' grader on CUDA ranks.

Two sizes. ``-m "gpu and quick"`` runs every GPU code path once (every strategy, the fp16 paths, the report's
parts, every lab's own launch, the grader on CUDA ranks): 5.9 minutes on one H200, by ``QUICK_ESTIMATE_S`` (each
test's time measured there, tests/gpu-runs/2026-11-28-h200). ``-m gpu`` runs everything: every strategy in every
layout, every lab top to bottom. Both are meant to be run with ``--durations=0``.

Each GPU test has a CPU twin in CI that runs the same code up to the call that needs a GPU:

- training: ``test_every_gpu_training_command_parses_and_places_its_ranks`` below builds the same command lines
  for simulated machines of 1, 2 and 8 GPUs, parses them, and places every rank;
- the report: ``tests/test_command_lines.py`` parses every part of ``gpu_report.plan`` for simulated machines;
- the labs: ``tests/test_kaggle.py`` plays every lab on the CPU, ``tests/test_lab_placement.py`` checks their
  set-up for 0, 1 and 2 GPUs and that every script they launch is told its device;
- the grader: ``tests/test_placement.py`` places every exercise for 0 to 8 GPUs, and ``tests/test_exercises.py``
  grades every solution on gloo ranks;
- what the GPU audit predicted: ``tests/test_gpu_audit.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from distlab.bench.sweep import VARIANTS as SWEEP_VARIANTS
from distlab.cli import parse
from distlab.config import TrainConfig
from distlab.errors import DistlabError
from distlab.exercises import grade
from distlab.exercises.catalog import all_exercises
from distlab.exercises.grader import _placement
from distlab.labs.offline import write_offline_mnist
from distlab.parallel import STRATEGIES
from distlab.results import read_result
from distlab.runtime import Placement, gpu_count, place, rank_device, rank_placement
from distlab.testing import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
GPUS = gpu_count()
NO_GPU = "no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is"
needs_gpu = pytest.mark.skipif(GPUS == 0, reason=NO_GPU)

LAYOUTS = ("one NCCL rank", "two gloo ranks share one GPU", "one NCCL rank per GPU")


def layout(name: str, gpus: int) -> tuple[Placement, dict[str, str]] | None:
    """The placement a layout gets on a machine of ``gpus`` GPUs, and the environment its job needs; None where
    the machine cannot show it (one rank per GPU needs two GPUs or more)."""
    if name == "one NCCL rank":
        return place(1, gpus=gpus), {}
    if name == "two gloo ranks share one GPU":  # what Colab and Kaggle's single-GPU kernels give: the ranks see one
        return place(2, "cuda", "gloo", gpus=1), {"CUDA_VISIBLE_DEVICES": "0"}
    return (place(None, gpus=gpus), {}) if gpus >= 2 else None


@dataclass(frozen=True)
class TrainCase:
    id: str
    strategy: str
    args: tuple[str, ...]


FP16 = ("--model", "gpt-tiny", "--precision", "fp16")
TRAIN_CASES = [
    *(TrainCase(f"{name}-cnn", name, ("--model", "cnn")) for name in STRATEGIES),
    *(TrainCase(f"{name}-gpt-tiny-16bit", name, ("--model", "gpt-tiny", "--precision", "16-bit"))
      for name in ("zero3", "fsdp")),
    *(TrainCase(f"{name}-gpt-tiny-fp16", name, FP16) for name in ("zero2", "zero3", "fsdp")),
    TrainCase("fsdp-offload-clip-gpt-tiny-fp16", "fsdp", (*FP16, "--fsdp-cpu-offload", "--max-grad-norm", "1")),
]  # fmt: skip
"""Every strategy on the course's CNN; the two that shard parameters on a GPT in mixed precision (``16-bit``:
bf16 where the GPU has it, fp16 elsewhere); and fp16 whatever the GPU supports, the only half precision a T4 has:
GradScaler, ShardedGradScaler's found-inf reduction, FSDP2's fp16 gathers, and with CPU offload and clipping the
found-inf and the norm as CPU DTensors on the group's gloo leg (two ranks: one rank skips both reductions)."""
CASES = {case.id: case for case in TRAIN_CASES}


def train_argv(case: TrainCase, placement: Placement, bf16: bool = True) -> list[str]:
    args = [arg.replace("16-bit", "bf16" if bf16 else "fp16") for arg in case.args]
    return ["--strategy", case.strategy, *args, "--dataset", "synthetic", "--synthetic-size", "512", "--epochs",
            "1", "--batch-size", "32", "--log-every", "0", *placement.args]  # fmt: skip


SHARED_GPU_STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
"""On two gloo ranks sharing a GPU, the CNN with one strategy of each kind (replicated, sharded gradients, sharded
parameters by hand and torch's FSDP2); the GPT cases run there too."""


def _fits(case: TrainCase, ranks: int, where: str = "") -> bool:
    cls = STRATEGIES[case.strategy]
    if where == "two gloo ranks share one GPU" and case.args == ("--model", "cnn"):
        if case.strategy not in SHARED_GPU_STRATEGIES:
            return False
    return ranks >= cls.min_world_size and (cls.max_world_size is None or ranks <= cls.max_world_size)


TRAIN_SELECTION = [
    (case.id, where)
    for where in LAYOUTS
    for case in TRAIN_CASES
    if _fits(case, 1 if where == "one NCCL rank" else 2, where)
]
"""Every training case in every layout it fits (judged at 2 ranks where a layout has several)."""

REPORT_SWEEP_STRATEGIES = tuple(sorted({variant["strategy"] for variant in SWEEP_VARIANTS.values()}))
"""The strategies the quick report's sweep trains on the GPU (from the library's own step), on GPT presets in
bf16 (fp16 on a GPU without bf16)."""
LAB_QUICK_STRATEGIES = ("single", "naive_ddp", "bucketed_ddp", "ddp")
"""What the labs' quick launches train on the GPU: lab 0's first run (single), and the DDP lab's step benchmark
(``distlab.bench.ddp_step``: the course's NaiveDDP and BucketedDDP strategies beside torch DDP)."""
QUICK_TRAIN = {
    ("zero3-gpt-tiny-fp16", "one NCCL rank"),
    ("fsdp-offload-clip-gpt-tiny-fp16", "one NCCL rank"),
    ("zero2-gpt-tiny-fp16", "two gloo ranks share one GPU"),
    ("fsdp-offload-clip-gpt-tiny-fp16", "two gloo ranks share one GPU"),
    ("ddp-cnn", "one NCCL rank per GPU"),
    ("zero2-gpt-tiny-fp16", "one NCCL rank per GPU"),
    ("fsdp-offload-clip-gpt-tiny-fp16", "one NCCL rank per GPU"),
}
"""The quick selection's training: fp16 with ShardedGradScaler by hand and FSDP2 with offload and clipping, on one
rank and on two; every other strategy trains in the report's sweep (``REPORT_SWEEP_STRATEGIES``) and the labs'
launches (``LAB_QUICK_STRATEGIES``). On two GPUs or more, one NCCL rank each as well."""


def train_params() -> list[tuple[str, str, tuple[str, ...]]]:
    return [
        (case_id, where, ("quick",) if (case_id, where) in QUICK_TRAIN else ()) for case_id, where in TRAIN_SELECTION
    ]


QUICK_ESTIMATE_S = {
    "the quick report (host, copies to 64 MB, the sweep's two points, FSDP2's options on gpt-mini)": 113,
    "5 labs to their own launch: pinned 37, ring 24, FSDP 21, lab 0 20, DDP 20": 122,
    "the FSDP2 point, one torchrun": 22,
    "training: zero3 fp16 21, fsdp offload+clip fp16 18 (one NCCL rank); the same 19 and zero2 fp16 17 (two gloo "
    "ranks share the GPU)": 75,
    "the grader on CUDA ranks, one exercise (the forkserver's start included)": 8,
    "the no-wait check of a training step, in-process": 1,
    "pytest's start and collection (the tier's 391 s less its tests' 379 s)": 12,
}
"""The quick selection on one GPU, in seconds: each input is a test's measured time on one H200 (torch 2.11, 16
cores), from ``tests/gpu-runs/2026-11-28-h200/durations.txt``, where the selection took 391 s with two more
training jobs (the course's NaiveDDP and BucketedDDP, 19 and 18 s, since left to the DDP lab's launch, which trains
both): 353 s, 5.9 minutes. Two GPUs add three training jobs and two exercises (~70 s)."""


@pytest.mark.parametrize("where", LAYOUTS)
@pytest.mark.parametrize("case_id", list(CASES))
def test_every_gpu_training_command_parses_and_places_its_ranks(case_id, where):
    """The CPU twin of :func:`test_train_on_the_gpu`: its command lines for 1, 2 and 8 GPUs, up to the device."""
    case = CASES[case_id]
    for gpus in (1, 2, 8):
        laid_out = layout(where, gpus)
        if laid_out is None or not _fits(case, laid_out[0].ranks, where):
            continue
        placement, env = laid_out
        cfg = parse(TrainConfig, train_argv(case, placement, bf16=gpus != 2), "distlab.train")
        visible = 1 if "CUDA_VISIBLE_DEVICES" in env else gpus
        ranks = rank_placement(cfg.parallel.device, cfg.parallel.backend, placement.ranks, gpus=visible)
        devices = [rank_device(ranks, r) for r in range(placement.ranks)]
        assert all(d.type == "cuda" and d.index < visible for d in devices), (gpus, devices)
        if ranks.backend == "nccl":
            assert len(set(devices)) == len(devices)  # NCCL: a GPU each


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "case_id, where",
    [pytest.param(c, w, marks=[getattr(pytest.mark, m) for m in marks], id=f"{c}-{w.replace(' ', '_')}")
     for c, w, marks in train_params()],
)  # fmt: skip
def test_train_on_the_gpu(case_id, where, tmp_path, monkeypatch):
    import torch

    from distlab.labs.launch import train

    case = CASES[case_id]
    laid_out = layout(where, GPUS)
    if laid_out is None:
        pytest.skip(f"{where} needs two GPUs or more; this machine has {GPUS}")
    placement, env = laid_out
    if not _fits(case, placement.ranks, where):
        pytest.skip(f"{case.strategy}: not on {where} ({placement.ranks} rank(s))")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    result = train(*train_argv(case, placement, bf16), nproc=placement.ranks, out=tmp_path, echo=False)
    assert result["environment"]["backend"] == placement.backend
    assert result["environment"]["device"].startswith("cuda")
    if "fp16" in case.args:  # forced: the T4's path on whatever GPU this is
        assert result["config"]["precision"]["dtype"] == "fp16"
    assert math.isfinite(result["metrics"]["epochs"][0]["train_loss"])
    assert result["metrics"]["step_time_median_s"] is not None  # the end-of-run reduction the H200 run failed in
    assert read_result(next(tmp_path.glob("*.json")))


@pytest.mark.gpu
@pytest.mark.quick
@needs_gpu
def test_a_training_step_never_waits_for_the_gpu():
    """P7: a step's metrics are summed on the GPU without a copy from the host, so the host runs ahead of the GPU
    (what lets a non_blocking copy overlap compute). CUDA's sync debug mode raises on any call that waits for it."""
    import torch

    from distlab.train import MetricSums, loss_and_correct

    device = torch.device("cuda", 0)
    logits, targets = torch.randn(64, 10, device=device), torch.randint(0, 10, (64,), device=device)
    sums = MetricSums(device)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            sums.add(*loss_and_correct(logits, targets))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sums.count == 3 * 64


def report_parts_expected(gpus: int) -> set[str]:
    """The parts a report runs on ``gpus`` GPUs: the collectives and DDP's batch norm need two NCCL ranks."""
    return {"host", "copies", "sweep", "fsdp-options"} | ({"collectives", "batch-norm"} if gpus >= 2 else set())


@pytest.mark.gpu
@pytest.mark.quick
@needs_gpu
def test_the_gpu_report_runs_every_part_that_should_and_says_so(tmp_path):
    """The quick report: every part this machine can run ran (none skipped because the budget was spent), the
    report is complete, and each FSDP2 option's CUDA peak is its own: offloading the shards to the CPU leaves the
    GPU less than the default holds (P6: with every option resident the two were about equal)."""
    out = Path(os.environ.get("DISTLAB_GPU_CHECK_REPORT") or tmp_path)  # scripts/gpu_check.py keeps the report
    command = [sys.executable, "-m", "distlab.gpu_report", "--out", str(out), "--budget-s", "300", "--quick"]
    job = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    (report_file,) = out.glob("*/report.json")
    report = json.loads(report_file.read_text())
    ran = {p["name"] for p in report["parts"] if p["status"] == "ran"}
    assert ran == report_parts_expected(GPUS), report["parts"]
    assert report["status"] == "complete"
    options = read_result(report_file.parent / "fsdp-options.json")["metrics"]["variants"]
    own = {row["variant"]: row["cuda_memory"][0]["max_allocated"] - row["cuda_memory"][0]["resident_before"]
           for row in options}  # fmt: skip
    assert own["offload"] < own["fsdp"], own


def sweep_on_one_gpu(out: Path, precision: str, *extra: str):
    return run_torchrun(
        1, "distlab.bench.sweep", "--models", "gpt-mini", "--batch-size", "8", "--seq-len", "256", "--steps", "2",
        "--precision", precision, "--collective-sizes", "1MB", "--device", "cuda", "--out", str(out), "--name",
        "sweep", *extra,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.quick
@needs_gpu
def test_the_sweeps_fsdp2_point_measures_each_variants_cuda_peak_alone_on_the_gpu(tmp_path):
    """The sweep's FSDP2 point on one CUDA rank, at a small size: each FSDP2 variant timed alone, with CUDA's peak
    of its own step. CUDA's allocated peak, less what was resident before the variant was built, holds what the
    course counts and not much more (P10: another variant's state still allocated would add its whole size), and
    keeping the gathered parameters (no reshard) peaks higher than freeing them. CPU twin:
    ``tests/test_sweep.py::test_the_fsdp2_point_runs_its_variants_alone_uncalibrated_and_the_report_says_so``."""
    bf16 = __import__("torch").cuda.is_bf16_supported(including_emulation=False)
    done = sweep_on_one_gpu(tmp_path, "bf16" if bf16 else "fp16", "--fsdp2-point", "gpt-mini:16")
    assert done.returncode == 0, done.stderr[-3000:]
    alone = read_result(tmp_path / "sweep.json")["metrics"]["presets"][-1]
    assert alone["point"] == "fsdp2-sized" and "local" not in alone
    own = {}
    for row in alone["variants"]:
        (cuda,) = row["cuda_memory"]
        counted = max(rank["peak"] for rank in row["memory"]["ranks"])
        own[row["variant"]] = cuda["max_allocated"] - cuda["resident_before"]
        assert counted * 0.95 <= own[row["variant"]] <= counted * 1.3, (row["variant"], cuda, counted)
    assert own["fsdp-no-reshard"] > own["fsdp"], own


@pytest.mark.gpu
@needs_gpu
def test_the_sweep_steps_every_strategy_in_fp16_on_the_gpu(tmp_path):
    """P3: the sweep on a T4 runs fp16 (no bf16 there); here fp16 is forced on whatever GPU this is."""
    done = sweep_on_one_gpu(tmp_path, "fp16")
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = read_result(tmp_path / "sweep.json")["metrics"]["presets"]
    assert {row["variant"] for row in point["variants"]} == set(SWEEP_VARIANTS)
    assert all(math.isfinite(row["time_s"]) and row["time_s"] > 0 for row in point["variants"])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("where", ["two gloo ranks share one GPU", "one NCCL rank per GPU"])
def test_the_fsdp_lab_script_trains_in_fp16_with_cpu_offload(where, tmp_path, monkeypatch):
    """P4: the FSDP lab's offload row on Kaggle's T4s: ``fsdp_train.py --cpu-offload`` in fp16 on two ranks, where
    GradScaler all-reduces its overflow flag as a CPU tensor (the shards live on the CPU). On two GPUs that needs
    the NCCL group's gloo leg; on one GPU its two gloo ranks take the same path through gloo."""
    laid_out = layout(where, GPUS)
    if laid_out is None:
        pytest.skip(f"{where} needs two GPUs or more; this machine has {GPUS}")
    placement, env = laid_out
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "fsdp.json"
    done = run_torchrun(
        2, str(ROOT / "scripts" / "fsdp_train.py"), "--model", "cnn", "--dataset", "synthetic", "--samples", "1024",
        "--epochs", "1", "--batch-size", "64", "--cpu-offload", "--precision", "fp16", *placement.args,
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["metrics"]["compute_dtype"] == "torch.float16"
    assert math.isfinite(result["metrics"]["epochs"][-1]["train_loss"])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("flags", [("--fsdp-replicate", "2"), ("--fsdp-reshard-to", "2")], ids=["hsdp", "reshard-to"])
def test_fsdp2_on_a_two_dimensional_mesh_of_nccl_ranks(flags, tmp_path):
    """P13: HSDP (``--fsdp-replicate``) and resharding to pairs (``--fsdp-reshard-to``) build a 2-D mesh, whose
    groups DeviceMesh splits from the rank's default group, bound to its GPU and carrying both NCCL and gloo: the
    path whose mixed-backend handling torch changed across 2.9-2.14 (pytorch/pytorch#159200, #162424). Never run:
    it needs four GPUs, and no CPU run can reach it (a group is bound to a device only on a GPU). Until this test
    has passed on a GPU the course does not claim either on GPUs."""
    from distlab.labs.launch import train

    if GPUS < 4:
        pytest.skip(f"a 2-D mesh of NCCL ranks needs 4 GPUs; this machine has {GPUS}")
    placement = place(4, gpus=GPUS)
    argv = train_argv(CASES["fsdp-gpt-tiny-16bit"], placement, bf16=True)
    result = train(*argv, *flags, nproc=4, out=tmp_path, echo=False)
    assert result["environment"]["world_size"] == 4 and result["environment"]["backend"] == "nccl"
    assert math.isfinite(result["metrics"]["epochs"][0]["train_loss"])


LABS = sorted((ROOT / "notebooks").glob("lab*.ipynb"))
LAB_QUICK_STOP = {
    "lab0_first_run": "--run-name lab0-single",
    "lab_pinned_memory": "transfer_bench.py --sizes",
    "lab_ddp_mnist": "-m distlab.bench.ddp_step",
    "lab_ring_allreduce": "ring_bench.py --sizes",
    "lab_fsdp": "fsdp_train.py --device",
}
"""The quick selection plays each lab up to the cell that launches what only that lab runs on the GPU (its own
script or benchmark; lab 0 its first run), with the jobs of the cells before it left out."""
QUICK_EDITS = (
    ('"--epochs", "5"', '"--epochs", "1"'),  # one epoch of each run: the code path, not the lesson's curve
    ("--sizes 4KB:1GB --out", "--sizes 4KB:64MB --loader-epochs 0 --out"),  # copies, without the DataLoader study
)
LAUNCH = re.compile(r"^\s*!.*(torch\.distributed\.run|\{TORCHRUN)")


def quick_lab(notebook, stop: str):
    """``notebook`` cut after the cell that holds ``stop``, each earlier torchrun job replaced by a successful
    no-op (``_exit_code = 0``), the sizes made quick."""
    cells = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            source = cell.source
            for old, new in QUICK_EDITS:
                source = source.replace(old, new)
            if stop not in source:
                source = "\n".join("_exit_code = 0" if LAUNCH.match(line) else line for line in source.splitlines())
            cell.source = source
        cells.append(cell)
        if cell.cell_type == "code" and stop in cell.source:
            notebook.cells = cells
            return notebook
    raise AssertionError(f"no cell holds {stop!r}")


def play_lab(lab: Path, tmp_path: Path, monkeypatch, quick: bool):
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    working = tmp_path / "working"
    working.mkdir()
    shutil.copy(lab, working / lab.name)
    write_offline_mnist(working / "data")  # no network on a GPU image: MNIST's format, written here
    notebook = nbformat.read(working / lab.name, as_version=4)
    if quick:
        notebook = quick_lab(notebook, LAB_QUICK_STOP[lab.stem])
    # the kernel inherits the environment: it imports this checkout's distlab, as the maintainers run it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    nbclient.NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(working)}}).execute()
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    setup = "".join(output.get("text", "") for output in first.outputs)
    assert "No CUDA GPU here" not in setup, setup
    gpu_results = [json.loads(p.read_text()) for p in (working / "results").glob("*.json") if p.name != "hardware.json"]
    devices = {r.get("environment", {}).get("device", "") for r in gpu_results}
    assert gpu_results, "the lab wrote no result"
    assert any(d.startswith("cuda") for d in devices), devices  # nothing on the CPU beside a GPU
    step = working / "results" / "mnist-ddp-step.json"
    if step.is_file():  # P14: the profiled DDP step draws its all-reduces, NCCL's kernels or gloo's CPU threads
        lanes = {interval["lane"] for interval in json.loads(step.read_text())["metrics"]["timeline"]}
        assert lanes == {"compute", "communication"}, lanes


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
@pytest.mark.gpu
@needs_gpu
def test_every_lab_plays_top_to_bottom_on_the_gpus_present(lab, tmp_path, monkeypatch):
    play_lab(lab, tmp_path, monkeypatch, quick=False)


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
@pytest.mark.gpu
@pytest.mark.quick
@needs_gpu
def test_every_lab_launches_its_own_job_on_the_gpus_present(lab, tmp_path, monkeypatch, request):
    if any(item.originalname == "test_every_lab_plays_top_to_bottom_on_the_gpus_present" for item in
           request.session.items):  # fmt: skip
        pytest.skip("this run plays every lab top to bottom, which launches this job too")
    play_lab(lab, tmp_path, monkeypatch, quick=True)


@pytest.mark.parametrize("lab", LABS, ids=[lab.stem for lab in LABS])
def test_every_labs_quick_play_stops_at_its_own_job_with_the_earlier_jobs_left_out(lab):
    """The CPU twin of the quick lab test: each lab has the cell it stops at, no torchrun job before it, and the
    quick sizes apply where the lab has them."""
    nbformat = pytest.importorskip("nbformat")
    notebook = quick_lab(nbformat.read(lab, as_version=4), LAB_QUICK_STOP[lab.stem])
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    assert LAB_QUICK_STOP[lab.stem] in code[-1]
    assert not any(LAUNCH.match(line) for source in code[:-1] for line in source.splitlines())
    original = lab.read_text()
    for old, new in QUICK_EDITS:
        if json.dumps(old)[1:-1] in original:
            assert any(new in source for source in code), (old, new)


EXERCISES = sorted(all_exercises())
QUICK_EXERCISES = {"ring_all_reduce", "zero3_unit", "h2d_copy_time"}
"""On one GPU only the one-rank exercises place on CUDA (arithmetic: h2d_copy_time); the ring and ZeRO-3's unit
send CUDA tensors over NCCL on two GPUs (and are checked again on three CPU ranks, which two cannot stand for)."""


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.quick] if n in QUICK_EXERCISES else []) for n in EXERCISES]
)
@pytest.mark.gpu
@needs_gpu
def test_the_grader_passes_every_solution_on_cuda_ranks(name):
    """P11: on one GPU only the one-rank exercises place on CUDA, and they are arithmetic (a copy's time, bytes per
    step): what they prove there is that a one-rank NCCL group starts. The exercises that send CUDA tensors point to
    point over NCCL (the rings, ZeRO, overlap) need two GPUs: Kaggle's pair, or a two-GPU machine."""
    exercise = all_exercises()[name]
    try:  # one NCCL rank per GPU, as check(..., device="cuda") asks (on its own, check runs 3 ranks on 2 GPUs' CPU)
        _placement(exercise, None, "cuda")
    except DistlabError as err:
        pytest.skip(f"{name}: {err}")
    verdict = grade(name, exercise.solution_function(), device="cuda")
    assert verdict.passed and verdict.device == "cuda", verdict.message
