"""One table of data-parallel implementations against one reference.

Every row wraps every model of :data:`distlab.testing.TOY_MODELS` (the CNN,
a model with a frozen bias, a model with tied weights), trains it on its
rank's slice of the same batches, with and without ``no_sync``
accumulation, and must end with the weights of one process trained on the
concatenated batch. Rows that broadcast rank 0's weights at wrap time start
from different weights on every rank, so a missing broadcast fails. All
rows run inside one spawn per world size; a new implementation is a new row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.comm.collectives import ring_all_reduce
from distlab.parallel import (
    FSDP2,
    BucketedDDPStrategy,
    NaiveDDPStrategy,
    TorchDDP,
    Zero1,
    Zero2,
    Zero3,
    full_state_dict,
)
from distlab.parallel.base import Strategy
from distlab.parallel.mini_ddp import BucketedDDP, NaiveDDP
from distlab.runtime import Runtime
from distlab.testing import CNN_PARAMETERS, TOY_MODELS, assert_same_state, run_ranks

STEPS, PER_RANK, LR = 4, 8, 0.05
RANK0_SEED = 100


def _plain_optimizer(model: nn.Module, factory) -> torch.optim.Optimizer:
    return factory(model.parameters())


@dataclass(frozen=True)
class Implementation:
    wrap: Callable[[nn.Module, Runtime], nn.Module]
    no_sync: Callable[[nn.Module], ContextManager]
    broadcasts_initial_weights: bool
    """True when wrapping copies rank 0's weights to every rank (DDP's contract)."""
    make_optimizer: Callable = _plain_optimizer
    clip_grad_norm_: Callable[[nn.Module, float], float] | None = None
    """How to clip by the norm over every rank's gradients (sharded ones included)."""


def _row(strategy: Strategy, broadcasts: bool) -> Implementation:
    return Implementation(
        strategy.wrap, strategy.no_sync, broadcasts, strategy.make_optimizer, strategy.clip_grad_norm_
    )


IMPLEMENTATIONS = {
    "torch_ddp": _row(TorchDDP(), True),
    "naive_ddp": _row(NaiveDDPStrategy(), True),
    "naive_ddp_our_ring": Implementation(
        lambda m, rt: NaiveDDP(m, all_reduce=ring_all_reduce), lambda m: m.no_sync(), True
    ),
    "bucketed_ddp_25mb": _row(BucketedDDPStrategy(25), True),
    "bucketed_ddp_small": _row(BucketedDDPStrategy(0.05), True),
    "zero1": _row(Zero1(), True),
    "zero1_small_buckets": _row(Zero1(0.05), True),
    "zero2": _row(Zero2(), True),
    "zero2_small_buckets": _row(Zero2(0.05), True),
    "zero3_full_shard": _row(Zero3(reshard_after_forward=True), True),
    "zero3_shard_grad_op": _row(Zero3(reshard_after_forward=False), True),
    "zero3_prefetch": _row(Zero3(prefetch=1), True),
    "zero3_prefetch_2": _row(Zero3(prefetch=2), True),
    "zero3_our_ring": _row(Zero3(collectives="ring"), True),
    "zero3_torch_collectives": _row(Zero3(collectives="torch"), True),
    "fsdp2_full_shard": _row(FSDP2(reshard_after_forward=True), False),
    "fsdp2_shard_grad_op": _row(FSDP2(reshard_after_forward=False), False),
    "fsdp2_prefetch_2": _row(FSDP2(prefetch="explicit", prefetch_depth=2), False),
}


def _batches(model_name: str, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, shape, classes = TOY_MODELS[model_name]
    gen = torch.Generator().manual_seed(123)
    n = STEPS * world_size * PER_RANK
    return torch.randn(n, *shape, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _build(model_name: str, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TOY_MODELS[model_name][0]()


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def _train_steps(
    model: nn.Module, batches, accum: int, impl: Implementation | None = None, optimizer="sgd", max_norm=0.0
):
    """``optimizer`` steps over ``batches``, each split into ``accum`` micro-batches; all
    but the last run under the implementation's ``no_sync``; clipped to ``max_norm`` if set."""
    optim = (impl.make_optimizer if impl else _plain_optimizer)(model, OPTIMIZERS[optimizer])
    for inputs, targets in batches:
        for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            sync = impl is None or micro == accum - 1
            with torch.enable_grad() if sync else impl.no_sync(model):
                (F.cross_entropy(model(x), y) / accum).backward()
        if max_norm:
            if impl is None:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
            else:
                impl.clip_grad_norm_(model, max_norm)
        optim.step()
        optim.zero_grad(set_to_none=True)


def single_process_reference(model_name: str, world_size: int, **training) -> dict[str, torch.Tensor]:
    x, y = _batches(model_name, world_size)
    model = _build(model_name, RANK0_SEED)
    step = world_size * PER_RANK
    _train_steps(
        model, [(x[s * step : (s + 1) * step], y[s * step : (s + 1) * step]) for s in range(STEPS)], 1, **training
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _my_batches(model_name: str, runtime: Runtime):
    step, lo = runtime.world_size * PER_RANK, runtime.rank * PER_RANK
    x, y = _batches(model_name, runtime.world_size)
    return [
        (x[s * step + lo : s * step + lo + PER_RANK], y[s * step + lo : s * step + lo + PER_RANK]) for s in range(STEPS)
    ]


def train_every_row(runtime: Runtime, rows=None, accums=(1, 2), optimizer="sgd", max_norm=0.0):
    """Every row (or those named) trains every toy model, each rank from its own initial weights
    where the row broadcasts rank 0's; returns the whole weights each row ended with."""
    states, buckets = {}, {}
    for model_name in TOY_MODELS:
        mine = _my_batches(model_name, runtime)
        for name, impl in IMPLEMENTATIONS.items():
            if rows is not None and name not in rows:
                continue
            for accum in accums:
                seed = RANK0_SEED + (runtime.rank if impl.broadcasts_initial_weights else 0)
                model = impl.wrap(_build(model_name, seed), runtime)
                if isinstance(model, BucketedDDP) and model_name == "cnn":
                    buckets[name] = model.bucket_sizes()
                _train_steps(model, mine, accum, impl, optimizer, max_norm)
                states[(name, model_name, accum)] = full_state_dict(model)
    return {"states": states, "buckets": buckets}


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_implementation_equals_one_process_on_the_concatenated_batch(tmp_path, world_size):
    references = {name: single_process_reference(name, world_size) for name in TOY_MODELS}
    ranks = run_ranks(train_every_row, world_size, tmp_path)
    for rank, result in enumerate(ranks):
        assert len(result["states"]) == len(IMPLEMENTATIONS) * len(TOY_MODELS) * 2
        for (name, model_name, accum), state in result["states"].items():
            assert_same_state(state, references[model_name], label=f"rank {rank} {name} {model_name} accum={accum}")
    # the small cap really made several buckets, the big one a single bucket
    buckets = ranks[0]["buckets"]
    assert len(buckets["bucketed_ddp_small"]) > 3 and len(buckets["bucketed_ddp_25mb"]) == 1
    assert sum(buckets["bucketed_ddp_small"]) == CNN_PARAMETERS * 4


@pytest.mark.parametrize("model_name", list(TOY_MODELS))
def test_the_reference_moves_the_weights(model_name):
    initial = _build(model_name, RANK0_SEED).state_dict()
    trained = single_process_reference(model_name, 2)
    assert any(not torch.allclose(initial[k], trained[k]) for k in trained if k != "fc1.bias")
    if model_name == "frozen":
        assert torch.equal(initial["fc1.bias"], trained["fc1.bias"]), "a frozen parameter must not move"
    if model_name == "tied":
        assert torch.equal(trained["inp.weight"], trained["out.weight"])


@pytest.mark.slow
def test_every_sharded_row_with_adam_accumulation_and_clipping_on_4_ranks(tmp_path):
    # Adam and a clipping norm that bites on every step, two micro-steps, 4 ranks starting from
    # different weights: every ZeRO variant against one process on the whole batch.
    training = dict(optimizer="adam", max_norm=0.05)
    rows = [name for name in IMPLEMENTATIONS if name.startswith("zero") or name == "torch_ddp"]
    references = {name: single_process_reference(name, 4, **training) for name in TOY_MODELS}
    for rank, result in enumerate(run_ranks(train_every_row, 4, tmp_path, rows, (2,), "adam", 0.05)):
        for (name, model_name, _), state in result["states"].items():
            assert_same_state(state, references[model_name], label=f"rank {rank} {name} {model_name} adam")
