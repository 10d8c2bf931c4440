"""ZeRO-1 and ZeRO-2 from scratch: the optimizer state, then the gradients,
sharded across ranks, while every rank keeps the whole model.

* ZeRO-1: gradients are all-reduced exactly as in DDP; then each rank steps
  the optimizer on its 1/N slice of the flat parameters only, so it holds
  1/N of the optimizer state (Adam: two fp32 values per parameter), and the
  updated slices are all-gathered back into every rank's model.
* ZeRO-2: the same, but the gradients are reduce-scattered instead of
  all-reduced: each rank receives only the summed slice it steps, and the
  full gradient is dropped as soon as the reduce-scatter is done.

Adam, AdamW and SGD act on each value independently, so stepping a flat
slice is the same arithmetic as stepping the parameters whole: the result
equals DDP's (tests/test_implementations.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import DistlabError
from .base import OptimizerFactory, _state_values
from .checkpoint_state import FLAT_OPTIMIZER, FlatOptimizerState
from .flat_param import (
    FlatParams,
    all_gather_into,
    clip_sharded_grad_norm_,
    reduce_scatter_flat,
    segment_owners_mesh,
)
from .mini_ddp import NaiveDDP
from .replicated import BucketedDDPStrategy, Replicated


class ShardedOptimizer(torch.optim.Optimizer):
    """Step ``factory``'s optimizer on this rank's slice of the flat parameters,
    then all-gather the slices into every rank's parameters.

    The model's parameters become views of one flat buffer, and the slice the
    inner optimizer steps is a view of that buffer too: stepping it updates
    this rank's part of the model in place, with no second copy. Its
    ``param_groups`` are the model's parameters (so ``zero_grad`` and a
    gradient scaler see the gradients the loop produced); the inner optimizer
    holds state for the slice alone. ``gradient_shard`` (ZeRO-2) returns the
    already reduced slice of the gradient; without it (ZeRO-1) the slice is
    cut from the full, all-reduced gradients.
    """

    def __init__(self, params, factory: OptimizerFactory, group=None, gradient_shard=None):
        params = [p for p in params if p.requires_grad]
        self.group, self.gradient_shard = group, gradient_shard
        self.flat = FlatParams(params, dist.get_world_size(group), dist.get_rank(group))
        self.buffer = self.flat.flatten([p.detach() for p in params])
        for param, view in zip(params, self.flat.views(self.buffer)):
            param.data = view
        self.shard = nn.Parameter(self.buffer[self.flat.shard])
        self.inner = factory([self.shard])
        super().__init__(params, defaults={})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise DistlabError("ShardedOptimizer.step takes no closure")
        if self.gradient_shard is not None:
            self.shard.grad = self.gradient_shard()
        else:
            self.shard.grad = self.flat.flatten([p.grad for p in self.flat.params])[self.flat.shard].clone()
        self.inner.step()
        mine = self.shard.detach().clone()  # the all-gather writes into the buffer this slice lives in
        all_gather_into(self.buffer, mine, self.group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.shard.grad = None

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)

    def sharded_state_dict(self, device_type: str) -> dict[str, torch.Tensor]:
        """The inner optimizer's state for a checkpoint: each per-value tensor (Adam's
        moments) as this rank's piece of the whole flat state (a DTensor sharing memory
        with it: loading one writes into the optimizer), a scalar (Adam's step) as is.
        The state must exist already (a checkpoint initialises it first)."""
        mesh = segment_owners_mesh(device_type, list(range(dist.get_world_size(self.group))))
        return {
            name: self.flat.shard_as_dtensor(value, mesh)
            if value.dim() == 1 and value.numel() == self.flat.shard_numel
            else value
            for name, value in self.inner.state[self.shard].items()
        }


class ShardedGradients(NaiveDDP):
    """ZeRO-2's gradient synchronisation: :class:`.mini_ddp.NaiveDDP`'s, but after
    backward the flat gradient is reduce-scattered instead of all-reduced: each
    rank keeps the averaged slice it will step, and the full gradients are freed."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__(module, group)
        self.flat = FlatParams(self.params, self.world_size, dist.get_rank(group))
        self.grad_shard: torch.Tensor | None = None

    def finish_gradient_sync(self) -> None:
        flat = self.flat.flatten(self.gradients())
        flat.div_(self.world_size)  # average before summing: no overflow in low precision
        self.grad_shard = reduce_scatter_flat(flat, self.flat.shard_numel, self.group)
        for p in self.params:
            p.grad = None  # only the slice this rank steps survives the backward

    def take_grad_shard(self) -> torch.Tensor:
        """The reduced gradient slice, handed over once (the optimizer owns it from then on)."""
        if self.grad_shard is None:
            raise DistlabError("zero2: the optimizer stepped before a backward produced gradients")
        shard, self.grad_shard = self.grad_shard, None
        return shard


class _FlatOptimizerCheckpoint:
    """ZeRO-1 and ZeRO-2 checkpoint the model by name and the optimizer as slices of one flat vector."""

    checkpoint_layout: ClassVar[str] = FLAT_OPTIMIZER

    def checkpoint_state(self, model, optimizer, device_type):
        return FlatOptimizerState(model, optimizer, device_type)


class Zero1(_FlatOptimizerCheckpoint, BucketedDDPStrategy):
    """ZeRO-1: the course's bucketed DDP all-reduces the gradients, then a sharded optimizer steps."""

    name: ClassVar[str] = "zero1"
    predicted_by: str = "zero1"

    def make_optimizer(self, model, factory):
        return ShardedOptimizer(model.parameters(), factory)

    def state_tensors(self, model, optimizer):
        return _sharded_optimizer_state(super().state_tensors(model, optimizer), optimizer)


class Zero2(_FlatOptimizerCheckpoint, Replicated):
    """ZeRO-2: gradients reduce-scattered, a sharded optimizer on the slice."""

    name: ClassVar[str] = "zero2"
    predicted_by: str = "zero2"
    fp16_scaler: ClassVar[str | None] = "a scaler checks the gradients on the model, and ZeRO-2 leaves none there"

    def wrap(self, model, runtime):
        return ShardedGradients(model)

    def make_optimizer(self, model, factory):
        return ShardedOptimizer(model.parameters(), factory, gradient_shard=model.take_grad_shard)

    def clip_grad_norm_(self, model, max_norm):
        return clip_sharded_grad_norm_([model.grad_shard], max_norm, model.group)

    def state_tensors(self, model, optimizer):
        found = _sharded_optimizer_state(super().state_tensors(model, optimizer), optimizer)
        if model.grad_shard is not None:  # between backward and step: the reduced slice
            found["gradients"].append(model.grad_shard)
        return found


def _sharded_optimizer_state(found: dict[str, list], optimizer: ShardedOptimizer) -> dict[str, list]:
    """The optimizer's state is its inner optimizer's, on this rank's slice; the slice's
    gradient is a gradient while the step runs."""
    found["optimizer_state"] = _state_values(optimizer.inner.state)
    if optimizer.shard.grad is not None:
        found["gradients"].append(optimizer.shard.grad)
    return found
