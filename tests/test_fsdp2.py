"""FSDP2's one silent trap, and the library's guard against it
(:mod:`distlab.demos.fsdp_mistakes`): gathered parameters kept across an optimizer
step train on stale weights without an error; distlab's optimizer refuses."""

from __future__ import annotations

from distlab.demos.fsdp_mistakes import run_all
from distlab.testing import run_ranks, run_torchrun


def test_gathered_parameters_left_across_a_step_train_on_stale_weights_and_the_guard_refuses(tmp_path):
    result = run_ranks(run_all, 2, tmp_path)[0]
    correct, stale = result["correct"]["state"], result["stale"]["state"]
    # torch alone: no error, the same first loss, different weights afterwards
    assert result["stale"]["losses"][0] == result["correct"]["losses"][0]
    drift = max((stale[k] - correct[k]).abs().max().item() for k in correct)
    assert drift > 1e-4, f"expected the stale run to drift, got max |diff| {drift:.1e}"
    assert result["correct"]["gathered_left"] == 0
    # the library's optimizer refuses the first step that would go stale, in one line
    error = result["guarded"]["error"]
    assert "stale weights" in error and "\n" not in error
    assert result["guarded"]["losses"] == []


def test_the_mistakes_entry_point_reports_the_drift_and_the_guard(tmp_path):
    run = run_torchrun(2, "distlab.demos.fsdp_mistakes", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(no error)" in run.stdout and "stale weights" in run.stdout
    assert (tmp_path / "fsdp-mistakes.json").exists()
