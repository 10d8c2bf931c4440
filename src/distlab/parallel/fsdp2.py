"""torch's FSDP2 (``fully_shard``): every shard unit the model declares, then
the root, sharded across the ranks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.nn as nn

from ..models import require_shard_units
from ..runtime import LOW_PRECISION
from .base import Strategy

try:  # public since torch 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard


class FSDP2(Strategy):
    """FSDP2: each shard unit, then the root, sharded across ranks.

    ``reshard_after_forward=True`` frees gathered parameters after forward
    (FSDP1's FULL_SHARD); ``False`` keeps them until backward (SHARD_GRAD_OP).
    """

    name: ClassVar[str] = "fsdp"
    shards_parameters: ClassVar[bool] = True

    def __init__(
        self,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    @classmethod
    def from_config(cls, parallel):
        param_dtype = LOW_PRECISION.get(parallel.fsdp_param_dtype)
        # Low-precision parameters, gradients reduced in fp32: the sum of many ranks keeps its bits.
        return cls(
            parallel.fsdp_reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=torch.float32 if param_dtype else None,
        )

    def wrap(self, model: nn.Module, runtime) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        units = require_shard_units(model, self.name)
        mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
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

    def state_tensors(self, model, optimizer):
        found = super().state_tensors(model, optimizer)
        found["gathered"] = [param for param in _unsharded_parameters(model) if param.untyped_storage().size() > 0]
        return found

    def grad_scaler(self, enabled, device):
        # Each rank sees only its gradient shard, so the inf/nan check must agree across ranks.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=enabled)


def _unsharded_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The whole parameters FSDP2 assembles from shards (allocated only while gathered).
    They live in FSDP2's private state; if that moves, they are counted as other memory."""
    found = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", lambda: None)()
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                found.append(unsharded)
    return found
