"""FSDP2's one silent trap, and the library's guard against it.

``set_reshard_after_backward(False)`` keeps the gathered parameters after
backward, which saves all-gathers between accumulation micro-steps. Left on
across an optimizer step, the step updates the shards while the next forward
reuses the old gathered copy: training goes on, on stale weights, without an
error. The library refuses that step instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab.checkpoint import full_state_dict
from distlab.models import build_model
from distlab.parallel import FSDP2
from distlab.parallel.fsdp2 import gathered_parameters
from distlab.runtime import DistlabError
from distlab.testing import run_ranks


def _batches(rank: int, steps: int = 3):
    gen = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(steps)]


def train_fsdp2(runtime, keep_gathered: bool, guarded: bool) -> dict:
    """Three SGD steps of FSDP2 on the CNN; ``keep_gathered`` leaves
    ``set_reshard_after_backward(False)`` on; ``guarded`` uses the library's optimizer."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FSDP2().wrap(build_model("cnn"), runtime)
    factory = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    optimizer = FSDP2().make_optimizer(model, factory) if guarded else factory(model.parameters())
    if keep_gathered:
        model.set_reshard_after_backward(False)
    try:
        for inputs, targets in _batches(runtime.rank):
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    except DistlabError as error:
        return {"error": str(error)}
    for module in model.modules():  # free what is still gathered before reading the shards
        if hasattr(module, "reshard"):
            module.reshard()
    return {"state": full_state_dict(model), "gathered_left": len(gathered_parameters(model))}


def trap_and_guard(runtime) -> dict:
    return {
        "correct": train_fsdp2(runtime, keep_gathered=False, guarded=False),
        "stale": train_fsdp2(runtime, keep_gathered=True, guarded=False),
        "guarded": train_fsdp2(runtime, keep_gathered=True, guarded=True),
    }


def test_gathered_parameters_left_across_a_step_train_on_stale_weights_and_the_guard_refuses(tmp_path):
    result = run_ranks(trap_and_guard, 2, tmp_path)[0]
    correct, stale = result["correct"]["state"], result["stale"]["state"]
    # torch alone: no error, different weights
    drift = max((stale[k] - correct[k]).abs().max().item() for k in correct)
    assert drift > 1e-4, f"expected the stale run to drift, got max |diff| {drift:.1e}"
    # the library's optimizer refuses the first step that would go stale, in one line
    error = result["guarded"]["error"]
    assert "stale weights" in error and "\n" not in error
