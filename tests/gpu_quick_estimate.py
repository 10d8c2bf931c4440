"""How long the GPU tier's quick selection takes, on one GPU and on two (not a test file: tests/test_gpu_audit.py
and tests/test_gpu_paths_on_cpu.py hold the estimates under scripts/gpu_check.py's stop)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from test_gpu import fused_adam_quick_layout, layout, quick_exercises, quick_train
from test_gpu_labs import LABS

ROOT = Path(__file__).resolve().parents[1]


# How long the quick selection takes, on one GPU and on two: every quick test that runs there, each from what the
# committed H200 run measured (tests/gpu-runs/2026-11-28-h200: one H200, 16 host cores, torch 2.11) and, for what
# only two GPUs run, the named estimates below. Not a measurement of two GPUs: none has run the tier yet.
H200_RUN = ROOT / "tests" / "gpu-runs" / "2026-11-28-h200"
NCCL_START_S = 5.0
"""What a job's NCCL communicator adds for two ranks on one node (its unique id, rings and channels; the gloo leg
is made either way). An estimate: no two-GPU run yet."""
SHORT_WORK_S = 5.0
"""A two-rank report part's own measurement at quick sizes (three collectives to 64 MB, five times; a few DDP steps
with SyncBatchNorm), beside its job's start. An estimate."""
NO_WAIT_STEP_S = 3.0
"""The no-wait check: ``distlab.train``'s run built in-process and four CNN steps on a warm GPU. An estimate (the
metric sums alone, its earlier form, took 0.3 s on the H200)."""


def h200_seconds() -> dict[str, float]:
    """Each passed test's seconds in the H200 run (durations.txt), by its id in this file."""
    rows = {}
    for line in (H200_RUN / "durations.txt").read_text().splitlines():
        seconds, _, outcome, name = line.split(maxsplit=3)
        if outcome == "passed":
            rows[name.split("::", 1)[1]] = float(seconds)
    return rows


def h200_part_seconds(part: str) -> float:
    """A part of the H200 run's quick report, as the report timed it (its torchrun job, start to end)."""
    report = json.loads((H200_RUN / "report" / "report.json").read_text())
    return next(row["seconds"] for row in report["parts"] if row["name"] == part)


def h200_pytest_start_s() -> float:
    """pytest's start and collection in the H200 run: the tier's time (summary.txt) less its tests' (durations)."""
    tier = re.search(r"^tier: \w+ in (\d+) s", (H200_RUN / "summary.txt").read_text(), re.M)
    return float(tier.group(1)) - sum(h200_seconds().values())


def h200_extra_seconds(test_id: str) -> float:
    """A test the H200 lease ran beside the quick selection (extras.log, pytest's durations)."""
    found = re.search(rf"([\d.]+)s call\s+tests/test_gpu.py::{re.escape(test_id)}$", (H200_RUN / "extras.log")
                      .read_text(), re.M)  # fmt: skip
    return float(found.group(1))


def quick_estimate_s(gpus: int) -> dict[str, float]:
    """Seconds of each quick test that runs on ``gpus`` GPUs (one or two), on a host like the H200's; the tests that
    would skip are left out. On two GPUs a test measured on one gets what two GPUs add to it: an NCCL communicator
    where its ranks become NCCL ranks, the report's two parts of two NCCL ranks (each a job's start, measured as the
    H200 report's ``host`` part, plus its communicator and its own work), and the pinned lab's second GPU (the
    report's ``copies`` part, less a job's start); a test only two GPUs run is estimated from the same job on two
    gloo ranks sharing one GPU, or from two gradings of the measured one-rank one."""
    seen, two = h200_seconds(), gpus >= 2
    nccl = NCCL_START_S if two else 0.0
    job_start = h200_part_seconds("host")
    report = seen["test_the_gpu_report_runs_every_part_that_should_and_says_so"]
    if two:  # collectives and batch-norm on 2 NCCL ranks; the sweep's and fsdp-options' ranks now NCCL ranks
        report += 2 * (job_start + NCCL_START_S + SHORT_WORK_S) + 2 * NCCL_START_S
    out = {
        "test_the_gpu_report_runs_every_part_that_should_and_says_so": report,
        "test_the_sweeps_fsdp2_point_measures_each_variants_cuda_peak_alone_on_the_gpu": seen[
            "test_the_sweeps_fsdp2_point_measures_each_variants_cuda_peak_alone_on_the_gpu"],
        "test_a_training_step_never_waits_for_the_gpu": NO_WAIT_STEP_S,
        "pytest's start and collection": h200_pytest_start_s(),
    }  # fmt: skip
    for lab in LABS:
        test_id = f"test_every_lab_launches_its_own_job_on_the_gpus_present[{lab.stem}]"
        extra = 0.0 if lab.stem == "lab0_first_run" else nccl  # lab 0's first run is one rank on either
        if lab.stem == "lab_pinned_memory" and two:  # each GPU measured in turn
            extra += h200_part_seconds("copies") - job_start
        out[test_id] = seen[test_id] + extra
    for case_id, where in quick_train(gpus):
        if layout(where, gpus) is None:
            continue
        shared = f"test_train_on_the_gpu[{case_id}-two_gloo_ranks_share_one_GPU]"
        test_id = f"test_train_on_the_gpu[{case_id}-{where.replace(' ', '_')}]"
        out[test_id] = seen[test_id] if test_id in seen else seen[shared] + NCCL_START_S
    one_rank_grading = seen["test_the_grader_passes_every_solution_on_cuda_ranks[h2d_copy_time]"]
    for name in quick_exercises(gpus):  # two GPUs: graded on CUDA ranks, then checked again on three CPU ranks
        out[f"test_the_grader_passes_every_solution_on_cuda_ranks[{name}]"] = (
            one_rank_grading if not two else 2 * one_rank_grading + NCCL_START_S
        )
    script = h200_extra_seconds(
        "test_the_fsdp_lab_script_trains_in_fp16_with_cpu_offload[two gloo ranks share one GPU]"
    )
    out[f"test_fsdp2_with_fused_adam_and_an_fp16_gradscaler_trains_on_the_gpu[{fused_adam_quick_layout(gpus)}]"] = (
        script + nccl
    )
    return out
