"""The contract every way of wrapping a model keeps.

A strategy turns a plain module into the one the training loop calls, says
how to run a backward without synchronising gradients (accumulation
micro-steps), and answers the loop's only questions about it: does a rank
hold just a shard of the parameters (then a large model is built on the
meta device and only the shards are materialised), which gradient scaler
fits, and which optimizer steps the parameters (ZeRO's sharded optimizer
replaces the plain one). The loop in :mod:`distlab.train` never asks which strategy it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Protocol

import torch
import torch.nn as nn

from ..errors import DistlabError
from ..runtime import LOW_PRECISION, Runtime
from .checkpoint_state import PER_PARAMETER, CheckpointState
from .materialize import materialize


class StrategySettings(Protocol):
    """What a strategy reads of a configuration: the strategy's name and its own options
    (:attr:`Strategy.options`), as attributes. The training configuration's parallel section is one; this
    package never imports it (the configuration imports the strategies, not the other way round)."""

    strategy: str

    def __getattr__(self, name: str) -> Any: ...


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's ``MixedPrecisionPolicy``, for the course's ZeRO-3 too: ``param_dtype`` is the dtype the
    parameters are gathered and computed in (the shards the optimizer steps keep theirs), ``reduce_dtype``
    the one gradients are reduced in (None: ``param_dtype``'s)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, parallel: StrategySettings) -> MixedPrecision:
        """``--fsdp-param-dtype`` and ``--fsdp-reduce-dtype``: by default gradients computed in a low
        precision are reduced in fp32, so the sum over many ranks keeps its bits."""
        param_dtype = LOW_PRECISION.get(parallel.fsdp_param_dtype)
        reduce_dtype = torch.float32 if param_dtype and parallel.fsdp_reduce_dtype == "fp32" else None
        return cls(param_dtype, reduce_dtype)


@dataclass(frozen=True)
class ShardingOptions:
    """What both strategies that shard the parameters read, FSDP2 and the course's ZeRO-3: whether a unit is
    freed after its forward (and gathered again in backward), and the dtypes it is gathered and reduced in."""

    reshard_after_forward: bool = True
    precision: MixedPrecision = MixedPrecision()

    OPTIONS: ClassVar[tuple[str, ...]] = ("fsdp_reshard_after_forward", "fsdp_param_dtype", "fsdp_reduce_dtype")
    """The configuration's options it reads; each sharding strategy's ``options`` start with these."""

    @classmethod
    def from_config(cls, parallel: StrategySettings) -> ShardingOptions:
        return cls(parallel.fsdp_reshard_after_forward, MixedPrecision.from_config(parallel))


OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


class Strategy:
    """Wrap a model; say how to run a backward without synchronising."""

    name: ClassVar[str] = "base"
    predicted_by: str = "ddp"
    """The course's model of this strategy (a key of :data:`distlab.predict.memory.STAGE`): what each rank
    keeps, the bytes it sends, the collectives it calls. ``ddp`` is every replicated strategy; a strategy
    whose options change what it keeps (``-no-reshard``) sets it per instance."""
    options: ClassVar[tuple[str, ...]] = ()
    """The options of a configuration's parallel section this strategy reads (in ``from_config``); a
    configuration that sets another strategy's option is refused."""
    shards_parameters: ClassVar[bool] = False
    """True when each rank holds only a shard of the parameters themselves."""
    steps_a_shard: ClassVar[bool] = False
    """True when each rank's optimizer steps only its slice of the gradients (ZeRO-1 and up), so a check
    for inf or NaN must agree across ranks."""
    min_world_size: ClassVar[int] = 1
    max_world_size: ClassVar[int | None] = None
    checkpoint_layout: ClassVar[str] = PER_PARAMETER
    """How this strategy's checkpoint is laid out; strategies with the same layout load each other's."""

    @classmethod
    def from_config(cls, parallel: StrategySettings) -> Strategy:
        """The strategy with the options the ``parallel`` section of a configuration asks for."""
        return cls()

    def wrap(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        raise NotImplementedError

    def build(self, meta: nn.Module, runtime: Runtime, seed: int, sharded_init: bool = False) -> nn.Module:
        """The model the loop trains, from one built on ``meta``: every rank starts from the weights one
        process would have (drawn from ``seed``, the global RNG untouched). With ``sharded_init`` a strategy
        that shards its parameters wraps first and materialises only its shards, so no rank ever holds the
        whole model; otherwise the model is materialised whole, then wrapped (the wrapper may broadcast
        rank 0's weights)."""
        if sharded_init and self.shards_parameters:
            model = materialize(self.wrap(meta, runtime), self.parameter_device(runtime), seed)
            for module in model.modules():  # buffers are computed with, wherever the parameters are kept
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(runtime.device)
            return model
        return self.wrap(materialize(meta, runtime.device, seed), runtime)

    def parameter_device(self, runtime: Runtime) -> torch.device:
        """Where this strategy keeps the parameters it holds between steps: the rank's device, unless it keeps
        them in host memory (FSDP2 with CPU offload, which refuses shards materialised on the GPU)."""
        return runtime.device

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Gradients of backwards inside this context stay local to the rank."""
        return nullcontext()

    def make_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer that steps ``model``; by default the plain one over all its parameters."""
        return factory(model.parameters())

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, device_type: str) -> CheckpointState:
        """The tensors this rank checkpoints, laid out as :attr:`checkpoint_layout` says."""
        return CheckpointState(model, optimizer)

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps for training, by what they are: ``parameters``
        (what it stores of the model), ``gradients`` and ``optimizer_state``; a
        sharding strategy adds ``gathered`` (whole parameters assembled from shards).
        Memory accounting reads this; it never copies a tensor."""
        params = [p for p in model.parameters()]
        return {
            "parameters": _unique(params),
            "gradients": _unique(p.grad for p in params if p.grad is not None),
            "optimizer_state": _unique(_state_values(optimizer.state)),
        }

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """Scale the gradients so their norm over the whole model is at most
        ``max_norm``; return the norm before clipping. Every rank holds the same
        whole gradients here, or torch's DTensors know their shards (FSDP2)."""
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def grad_scaler(self, enabled: bool, device: torch.device) -> torch.amp.GradScaler:
        """fp16's loss scaler. Where each rank holds only a slice of the gradients, an inf in one rank's
        slice must skip the step on every rank: torch's ShardedGradScaler all-reduces what each found."""
        if self.shards_parameters or self.steps_a_shard:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device.type, enabled=enabled)
        return torch.amp.GradScaler(device.type, enabled=enabled)

    def check_world_size(self, world_size: int) -> None:
        too_few, too_many = world_size < self.min_world_size, self.max_world_size and world_size > self.max_world_size
        if too_few or too_many:
            if self.max_world_size == self.min_world_size:
                allowed = f"exactly {self.min_world_size}"
            else:
                allowed = f"at least {self.min_world_size}"
            fit = self.max_world_size if too_many else self.min_world_size
            raise DistlabError(
                f"strategy {self.name} runs on {allowed} rank(s) but torchrun started {world_size}: "
                f"use --nproc_per_node={fit}, or another --strategy"
            )


def _state_values(state) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter state (Adam's step, exp_avg, exp_avg_sq)."""
    return [value for per_param in state.values() for value in per_param.values() if isinstance(value, torch.Tensor)]


def _unique(tensors) -> list[torch.Tensor]:
    """Each tensor once (a tied weight is one parameter), as local tensors (a DTensor's own shard)."""
    seen, out = set(), []
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if id(local) not in seen:
            seen.add(id(local))
            out.append(local)
    return out
