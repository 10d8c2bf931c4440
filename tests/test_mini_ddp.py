"""The course's own DDP: NaiveDDP and BucketedDDP end with the same weights
as torch DDP and as one process on the concatenated batch, even when every
rank builds different initial weights (the broadcast must fix that), with
and without no_sync accumulation. Real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_ranks
from distlab.collectives import ring_all_reduce
from distlab.mini_ddp import BucketedDDP, NaiveDDP
from distlab.models import build_model
from distlab.runtime import DistlabError

ATOL, RTOL = 1e-5, 1e-4  # float32 SGD, 4 steps; only the reduction order differs
STEPS, PER_RANK, LR = 4, 8, 0.05


def _data(world_size: int):
    gen = torch.Generator().manual_seed(123)
    n = STEPS * world_size * PER_RANK
    return torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _sgd_steps(model: nn.Module, batches, accum: int, no_sync=None) -> dict[str, torch.Tensor]:
    """SGD over ``batches``, each split into ``accum`` micro-batches; all but
    the last run under ``no_sync`` when one is given."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for inputs, targets in batches:
        for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            last = micro == accum - 1
            if no_sync is None or last:
                (F.cross_entropy(model(x), y) / accum).backward()
            else:
                with no_sync():
                    (F.cross_entropy(model(x), y) / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def single_process_reference(world_size: int) -> dict[str, torch.Tensor]:
    x, y = _data(world_size)
    torch.manual_seed(100)  # rank 0's seed: every wrapper starts from rank 0's weights
    model = build_model("cnn")
    step = world_size * PER_RANK
    return _sgd_steps(model, [(x[s * step:(s + 1) * step], y[s * step:(s + 1) * step]) for s in range(STEPS)], accum=1)


def train_with_every_wrapper(runtime, accum: int):
    x, y = _data(runtime.world_size)
    step, lo = runtime.world_size * PER_RANK, runtime.rank * PER_RANK
    mine = [(x[s * step + lo:s * step + lo + PER_RANK], y[s * step + lo:s * step + lo + PER_RANK]) for s in range(STEPS)]
    wrappers = {
        "torch_ddp": lambda m: torch.nn.parallel.DistributedDataParallel(m),
        "naive": NaiveDDP,
        "naive_with_our_ring": lambda m: NaiveDDP(m, all_reduce=ring_all_reduce),
        "bucketed_25mb": lambda m: BucketedDDP(m, bucket_cap_mb=25),
        "bucketed_small": lambda m: BucketedDDP(m, bucket_cap_mb=0.05),
    }
    states, buckets = {}, {}
    for name, wrap in wrappers.items():
        torch.manual_seed(100 + runtime.rank)  # deliberately different weights on every rank
        model = wrap(build_model("cnn"))
        if isinstance(model, BucketedDDP):
            buckets[name] = model.bucket_sizes()
        states[name] = _sgd_steps(model, mine, accum, no_sync=model.no_sync)
    return {"states": states, "buckets": buckets}


@pytest.mark.parametrize("accum", [1, 2], ids=["one_micro_step", "no_sync_accumulation"])
def test_mini_ddp_equals_torch_ddp_and_the_large_batch(tmp_path, accum):
    reference = single_process_reference(2)
    ranks = run_ranks(train_with_every_wrapper, 2, tmp_path, accum)
    for rank in ranks:
        for name, state in rank["states"].items():
            for key, value in reference.items():
                torch.testing.assert_close(state[key], value, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} {key}: {m}")
    # the small cap really made several buckets, the big one a single bucket
    assert len(ranks[0]["buckets"]["bucketed_small"]) > 3
    assert len(ranks[0]["buckets"]["bucketed_25mb"]) == 1
    assert sum(ranks[0]["buckets"]["bucketed_small"]) == 405_898 * 4


def test_reference_moves_the_weights():
    torch.manual_seed(100)
    initial = build_model("cnn").state_dict()
    trained = single_process_reference(2)
    assert any(not torch.allclose(initial[k], trained[k]) for k in trained)


class _HasUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def unused_parameter_error(runtime, wrapper: str):
    model = {"naive": NaiveDDP, "bucketed": BucketedDDP}[wrapper](_HasUnusedLayer())
    try:
        model(torch.randn(3, 4)).sum().backward()
    except DistlabError as error:
        return str(error)
    return None


@pytest.mark.parametrize("wrapper", ["naive", "bucketed"])
def test_unused_parameter_is_named_not_hung(tmp_path, wrapper):
    messages = run_ranks(unused_parameter_error, 2, tmp_path, wrapper)
    assert all(m is not None and "unused." in m for m in messages), messages
