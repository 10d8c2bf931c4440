"""How a model is wrapped: the only thing that differs between strategies.

A strategy turns a plain module into the one the training loop calls, and
knows how to skip gradient synchronisation for accumulation micro-steps. The
loop in :mod:`distlab.train` never asks which strategy it has.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .runtime import DistlabError, Runtime

try:  # public since torch 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


class Strategy:
    """Wrap a model; say how to run a backward without synchronising."""

    name = "base"
    min_world_size, max_world_size = 1, None

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        raise NotImplementedError

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Gradients of backwards inside this context stay local to the rank."""
        return nullcontext()

    def check_world_size(self, world_size: int) -> None:
        if world_size < self.min_world_size or (self.max_world_size and world_size > self.max_world_size):
            allowed = f"exactly {self.max_world_size}" if self.max_world_size == self.min_world_size else f"at least {self.min_world_size}"
            raise DistlabError(
                f"strategy {self.name} runs on {allowed} rank(s) but torchrun started {world_size}: "
                f"use --nproc_per_node=1 for single, or --strategy ddp/fsdp for several ranks"
            )


class Single(Strategy):
    """One process, no wrapper: the baseline every other strategy must match."""

    name, max_world_size = "single", 1

    def wrap(self, model, runtime):
        return model


class Replicated(Strategy):
    """A full replica per rank inside a DDP-style wrapper, whose own
    ``no_sync()`` skips the gradient all-reduce."""

    def no_sync(self, model):
        return model.no_sync()


class TorchDDP(Replicated):
    """``torch.nn.parallel.DistributedDataParallel``: a full replica per rank,
    gradients all-reduced in buckets during backward."""

    name = "ddp"

    def __init__(self, bucket_cap_mb: float = 25.0):
        self.bucket_cap_mb = bucket_cap_mb

    def wrap(self, model, runtime):
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb)


class NaiveDDPStrategy(Replicated):
    """:class:`distlab.mini_ddp.NaiveDDP`: one all-reduce per gradient after backward."""

    name = "naive_ddp"

    def wrap(self, model, runtime):
        from .mini_ddp import NaiveDDP

        return NaiveDDP(model)


class BucketedDDPStrategy(Replicated):
    """:class:`distlab.mini_ddp.BucketedDDP`: bucketed all-reduces overlapping backward."""

    name = "bucketed_ddp"

    def __init__(self, bucket_cap_mb: float = 25.0):
        self.bucket_cap_mb = bucket_cap_mb

    def wrap(self, model, runtime):
        from .mini_ddp import BucketedDDP

        return BucketedDDP(model, bucket_cap_mb=self.bucket_cap_mb)


class FSDP2(Strategy):
    """FSDP2 (``fully_shard``): each shard unit, then the root, sharded across ranks.

    ``reshard_after_forward=True`` frees gathered parameters after forward
    (FSDP1's FULL_SHARD); ``False`` keeps them until backward (SHARD_GRAD_OP).
    """

    name = "fsdp"

    def __init__(self, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def wrap(self, model, runtime):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
        units = model.shard_units() if hasattr(model, "shard_units") else []
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self.mp_policy)
        return fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self.mp_policy)

    @contextmanager
    def no_sync(self, model) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


STRATEGY_NAMES = ("single", "ddp", "fsdp", "naive_ddp", "bucketed_ddp")


def make_strategy(name: str, *, bucket_cap_mb: float = 25.0, reshard_after_forward: bool = True, fsdp_param_dtype: torch.dtype | None = None) -> Strategy:
    """A strategy by its command-line name."""
    if name == "single":
        return Single()
    if name == "ddp":
        return TorchDDP(bucket_cap_mb)
    if name == "naive_ddp":
        return NaiveDDPStrategy()
    if name == "bucketed_ddp":
        return BucketedDDPStrategy(bucket_cap_mb)
    if name == "fsdp":
        return FSDP2(reshard_after_forward, param_dtype=fsdp_param_dtype, reduce_dtype=torch.float32 if fsdp_param_dtype else None)
    raise DistlabError(f"unknown strategy {name!r}: use {', '.join(STRATEGY_NAMES)}")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP-style wrapper (FSDP2 wraps in place)."""
    from .mini_ddp import DataParallelWrapper

    return model.module if isinstance(model, (DistributedDataParallel, DataParallelWrapper)) else model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole and on the CPU, on every rank
    (FSDP2's sharded DTensors are gathered)."""
    state = {}
    for key, value in unwrap(model).state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        state[key] = value.detach().cpu().clone()
    return state


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)
