"""FSDP2's one silent trap, and the library's guard against it
(:mod:`distlab.demos.fsdp_mistakes`): gathered parameters kept across an optimizer
step train on stale weights without an error; distlab's optimizer refuses."""

from __future__ import annotations

import torch

from distlab.demos.fsdp_mistakes import run_all
from distlab.results import read_result
from distlab.testing import run_entry, run_ranks, run_torchrun


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


def test_the_essentials_an_optimizer_made_first_steps_nothing_meta_init_is_exact_and_clipping_sees_the_whole(
    ranks2, tmp_path
):
    """distlab.demos.fsdp_essentials on 2 ranks: what the chapter prints, checked."""
    run_entry(ranks2, "distlab.demos.fsdp_essentials", "--out", tmp_path)
    report = read_result(tmp_path / "fsdp-essentials.json")["metrics"]
    first, after = report["optimizer_first"], report["optimizer_after"]
    assert first["moved"] == 0 and len(set(first["losses"])) == 1  # the loss never moves
    assert after["moved"] == after["parameters"] and after["losses"][-1] < after["losses"][0]
    meta = report["meta"]
    assert meta["largest_difference"] == 0.0 and 2 * meta["held_bytes"] == meta["whole_bytes"]
    clip = report["clipping"]
    assert abs(clip["torch_norm"] - clip["whole_norm"]) < 1e-5 * clip["whole_norm"]  # float32, summed apart
    assert all(norm < clip["whole_norm"] for norm in clip["local_norm_by_rank"])
    assert abs(clip["norm_after_clipping"] - 0.1) < 1e-5


def _gradient_bytes_held_across_micro_steps(runtime):
    """FSDP2 over the root unit: the gradient bytes its state names after a no_sync backward, and the whole
    gradients left after the synchronised one."""
    from torch import nn

    from distlab.parallel.fsdp2 import FSDP2, whole_gradients

    torch.manual_seed(0)
    strategy = FSDP2(units="root")
    model = strategy.wrap(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with strategy.no_sync(model):
        model(torch.randn(4, 16)).sum().backward()
    gradients = strategy.state_tensors(model, optimizer)["gradients"]
    held = sum(t.untyped_storage().nbytes() for t in gradients)
    model(torch.randn(4, 16)).sum().backward()
    return held, len(whole_gradients(model)), all(p.grad is not None for p in model.parameters())


def test_fsdp2s_whole_gradients_under_no_sync_are_counted_as_gradients(ranks2):
    """Under set_requires_gradient_sync(False) FSDP2 keeps each whole gradient on its gathered parameter until the
    synchronised backward; the memory report counted them as activations (helper accum's finding). Its state names
    them: the whole model's gradient bytes after the no_sync backward, none left once the synchronised backward has
    reduce-scattered them into the shards."""
    whole = (16 * 32 + 32 + 32 * 8 + 8) * 4
    assert ranks2.run(_gradient_bytes_held_across_micro_steps) == [(whole, 0, True)] * 2
