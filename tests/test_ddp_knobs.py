"""torch DDP's options on two gloo ranks (``distlab.demos.ddp_knobs``): the physical claim of each demonstration."""

from __future__ import annotations

import time

import pytest

from distlab.models import ATOL
from distlab.results import read_result
from distlab.testing import run_entry, run_torchrun


@pytest.fixture(scope="module")
def knobs(ranks2, tmp_path_factory) -> dict:
    """One run of every demonstration, in-process on the session's two ranks; the timings are not under test,
    so few repeats."""
    out = tmp_path_factory.mktemp("ddp-knobs")
    run_entry(ranks2, "distlab.demos.ddp_knobs", "--device", "cpu", "--repeats", "5", "--out", out)
    return read_result(out / "ddp-knobs-2xcpu.json")["metrics"]


def test_batch_norm_breaks_large_batch_equivalence_and_global_statistics_restore_it(knobs):
    rows = knobs["batch_norm"]
    assert rows["no BatchNorm"]["equal_within_tolerance"]
    assert not rows["BatchNorm"]["equal_within_tolerance"]
    assert rows["BatchNorm"]["weights_max_abs_diff"] > 10 * ATOL
    assert rows["BatchNorm, statistics all-reduced"]["equal_within_tolerance"]


def test_sync_batch_norm_either_refuses_the_cpu_or_equals_one_process(knobs):
    row = knobs["batch_norm"]["SyncBatchNorm"]
    if "ddp_error" in row:  # torch 2.14: GPU (or XPU, HPU, PrivateUse1) tensors only
        assert "GPU" in row["ddp_error"] and "GPU" in row["forward_error"]
    else:
        assert row["equal_within_tolerance"]


def test_an_unused_layer_fails_by_default_and_trains_with_either_option(knobs):
    runs = knobs["unused_parameters"]["runs"]
    default = runs["default"]
    assert default["error"].startswith("Expected to have finished reduction") and default["steps_done"] == 1
    assert default["rank_spread_after_each_step"][0] > 0, "the step before the error used unaveraged gradients"
    for name in ("find_unused_parameters", "static_graph"):
        assert runs[name]["equal_within_tolerance"] and runs[name]["unused_grad_is_none"], name
        assert max(runs[name]["rank_spread_after_each_step"]) == 0, name


def test_gradients_as_bucket_views_hold_the_gradient_bytes_once(knobs):
    off, on = (knobs["gradient_as_bucket_view"][f"gradient_as_bucket_view={v}"] for v in (False, True))
    assert not off["gradients_are_bucket_views"] and on["gradients_are_bucket_views"]
    assert off["distinct_bytes"] == off["gradient_bytes"] + off["bucket_bytes"] == 2 * on["distinct_bytes"]


def test_without_buffer_sync_the_ranks_evaluate_different_models(knobs):
    rows = knobs["buffer_sync"]
    assert rows["sync on"]["eval_output_spread"] == 0
    assert rows["sync off"]["eval_output_spread"] > 0


def test_compression_hooks_halve_the_bytes_and_stay_close_to_fp32(knobs):
    rows = knobs["comm_hooks"]
    fp32 = rows["fp32 (default)"]
    for name in ("fp16_compress_hook", "bf16_compress_hook"):
        assert rows[name]["all_reduce_bytes_per_step"] == fp32["all_reduce_bytes_per_step"] / 2, name
        assert 0 < rows[name]["weights_max_abs_diff"] < fp32["weights_moved"] / 100, name


def test_join_finishes_uneven_inputs_and_divides_by_the_initial_world_size(knobs):
    join = knobs["join"]
    assert join["batches_in_all"] == sum(join["batches_per_rank"])
    assert join["gradient_scale_after_others_joined"][0] == []
    assert join["gradient_scale_after_others_joined"][1] == pytest.approx([0.5], rel=1e-5)


@pytest.mark.slow
def test_uneven_inputs_without_join_end_at_the_timeout(tmp_path):
    started = time.monotonic()
    run = run_torchrun(
        2,
        "distlab.demos.ddp_knobs",
        "--device",
        "cpu",
        "--uneven-without-join",
        "--timeout-s",
        "3",
        "--out",
        str(tmp_path),
    )
    elapsed = time.monotonic() - started
    assert run.returncode != 0 and 3 < elapsed < 60
    lines = [line for line in run.stderr.splitlines() if line.startswith("distlab:")]
    assert any("rank 0 (3 batches) stopped in the barrier after its loop" in line for line in lines), lines
    assert any("rank 1 (4 batches) stopped in the gradient all-reduce of its batch 4" in line for line in lines), lines
    assert any("Timed out waiting 3000ms" in line for line in lines), lines  # at least one rank ran out its timeout
    assert any(line.startswith("distlab: error:") and "Join([model])" in line for line in lines), lines
