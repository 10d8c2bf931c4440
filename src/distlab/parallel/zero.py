"""ZeRO-1 and ZeRO-2 from scratch, as the ZeRO paper has them: every rank keeps
the whole model, and steps the optimizer on its 1/N slice only.

Both start from the course's bucketed DDP (:mod:`.mini_ddp`): the same
buckets, in the same order. Each bucket's parameters are laid end to end in
one flat buffer padded to a multiple of ``N`` (:class:`.flat_param.FlatParams`),
and rank ``r`` owns slice ``r`` of every bucket. A gradient is copied into its
bucket's flat gradient as soon as it is ready, and the parameter's own
``.grad`` is dropped. A reduce-scatter then leaves each rank the average of
its slices; the optimizer steps those slices (views of the parameters'
buffers, so stepping them updates this rank's part of the model in place),
and an all-gather per bucket brings every rank the whole updated model.

* ZeRO-1 reduce-scatters every bucket once backward has finished, and keeps
  the whole flat gradient from step to step, as DDP keeps its buckets: the
  gradients are not sharded, the optimizer state is.
* ZeRO-2 reduce-scatters each bucket the moment its last gradient arrives,
  while backward goes on, and frees it once its slice is reduced: the whole
  gradient never exists at once.

Reduce-scatter plus all-gather is one all-reduce cut in two, so both send
what DDP sends: 2Ψ(n-1)/n per rank per step. Adam, AdamW and SGD act on each
value independently, so stepping slices is the same arithmetic as stepping
the parameters whole: the result equals DDP's (tests/test_implementations.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import DistlabError
from .base import _state_values, _unique
from .checkpoint_state import FLAT_OPTIMIZER, CheckpointState, initialize_optimizer_state, unwrap
from .flat_param import (
    COLLECTIVES,
    FlatParams,
    TorchCollectives,
    clip_sharded_grad_norm_,
    resolve_collectives,
)
from .mini_ddp import DataParallelWrapper, _unused_parameter_message, bucket_groups
from .replicated import Replicated

ZERO_BUCKET_CAP_MB = 5.0
"""ZeRO-2 holds about one bucket of whole gradients at a time, so smaller buckets lower its peak, at the
price of more, smaller collectives. DDP's 25 MB would be half of a 13M-parameter model."""


class ShardedBucket:
    """One bucket: its parameters in a padded flat buffer (whole on every rank), the slice of it this rank
    steps, and the flat gradient while it is being filled and reduced."""

    def __init__(self, params: list[nn.Parameter], collectives: TorchCollectives, keep_gradients: bool):
        self.keep_gradients = keep_gradients
        self.collectives, self.world_size = collectives, dist.get_world_size(collectives.group)
        owned = collectives.owned_segment(dist.get_rank(collectives.group), self.world_size)
        self.layout = FlatParams(params, self.world_size, owned)
        self.full = self.layout.flatten([p.detach() for p in params])
        for param, view in zip(params, self.layout.views(self.full)):
            param.data = view
        self.shard = nn.Parameter(self.full[self.layout.shard])  # a view: stepping it updates the model
        self.offsets, offset = {}, 0
        for param in params:
            self.offsets[id(param)], offset = offset, offset + param.numel()
        self.gradients: torch.Tensor | None = None
        self.ready: set[int] = set()
        self.reduced: torch.Tensor | None = None
        self.work = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.layout.params)

    def add_gradient(self, param: nn.Parameter) -> None:
        """Move ``param``'s gradient into the flat gradient (made when the bucket's first one arrives)."""
        if self.gradients is None:
            self.gradients = torch.zeros_like(self.full)
        offset = self.offsets[id(param)]
        self.gradients[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None
        self.ready.add(id(param))

    def reduce_scatter(self) -> None:
        """Start averaging the flat gradient into this rank's slice."""
        self.gradients.div_(self.world_size)  # average before summing: no overflow in low precision
        self.reduced, self.work = self.collectives.start_reduce_scatter(self.gradients, self.layout.shard)

    def finish(self) -> None:
        """Wait for the reduce-scatter; the shard's gradient is the reduced slice. ZeRO-1 keeps the flat
        gradient (its own slice now reduced, the rest spent) for the next backward; ZeRO-2 frees it."""
        if self.work is not None:
            self.work.wait()
        if self.reduced is not None and self.keep_gradients:
            mine = self.gradients[self.layout.shard]
            self.shard.grad = mine.copy_(self.reduced)
        elif self.reduced is not None:
            self.shard.grad = self.reduced if self.shard.grad is None else self.shard.grad.add_(self.reduced)
        if not self.keep_gradients:
            self.gradients = None
        self.reduced = self.work = None

    def all_gather_parameters(self) -> None:
        mine = self.shard.detach().clone()  # the all-gather writes into the buffer this slice lives in
        self.collectives.all_gather(self.full, mine, self.layout.shard)


class ShardedGradients(DataParallelWrapper):
    """ZeRO-1 and ZeRO-2's wrapper: rank 0's weights broadcast, then bucketed DDP's buckets
    (:func:`.mini_ddp.bucket_groups`), each reduce-scattered into this rank's slice after backward
    (``during_backward=False``: ZeRO-1) or as soon as it is complete (``True``: ZeRO-2). Under
    ``no_sync()`` the gradients accumulate whole, and the next synced backward reduces their sum."""

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = ZERO_BUCKET_CAP_MB,
        during_backward: bool = False,
        collectives: str = "torch",
        group=None,
    ):
        super().__init__(module, group)
        self.during_backward, self.collectives = during_backward, COLLECTIVES[collectives](group)
        groups = bucket_groups(self.params, int(bucket_cap_mb * 2**20))
        # ZeRO-1 keeps a whole gradient buffer, as DDP does; ZeRO-2 never holds more than a bucket or two
        self.buckets = [ShardedBucket(params, self.collectives, not during_backward) for params in groups]
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.layout.params}

    def shard_parameters(self) -> list[nn.Parameter]:
        """The slices this rank's optimizer steps, one per bucket."""
        return [bucket.shard for bucket in self.buckets]

    def _bucket_ready(self, bucket: ShardedBucket, param: torch.Tensor) -> None:
        bucket.add_gradient(param)
        if self.during_backward and bucket.complete:
            for earlier in self.buckets:  # one reduce-scatter in flight: the one before is done and freed
                if earlier.reduced is not None:
                    earlier.finish()
            bucket.reduce_scatter()

    def finish_gradient_sync(self) -> None:
        incomplete = next((b for b in self.buckets if not b.complete), None)
        if incomplete is not None:
            missing = next(p for p in incomplete.layout.params if id(p) not in incomplete.ready)
            for bucket in self.buckets:  # leave no collective half-posted
                bucket.reduced = None
                bucket.finish()
                bucket.ready.clear()
            raise DistlabError(_unused_parameter_message(self.module, missing))
        for bucket in self.buckets:
            if not self.during_backward:
                bucket.reduce_scatter()
            bucket.finish()
            bucket.ready.clear()

    def all_gather_parameters(self) -> None:
        """Every rank's updated slices into every rank's whole parameters."""
        for bucket in self.buckets:
            bucket.all_gather_parameters()

    def whole_gradients(self) -> list[torch.Tensor]:
        """The flat gradients alive now (ZeRO-1's, kept; ZeRO-2's, from a bucket's first gradient to its
        reduce-scatter)."""
        return [bucket.gradients for bucket in self.buckets if bucket.gradients is not None]


class ShardedOptimizerState(CheckpointState):
    """ZeRO-1 and ZeRO-2: the model's state dict by name, and the optimizer's state for each bucket as
    this rank's DTensor piece of the bucket's flat vector (so a different number of ranks reads its own
    slices). Buckets depend on the bucket size, not on the number of ranks. Loaded in place."""

    def __init__(self, model: ShardedGradients, optimizer: torch.optim.Optimizer, device_type: str):
        self.model, self.optimizer = model, optimizer
        initialize_optimizer_state(optimizer)
        mesh = model.collectives.owners_mesh(device_type, model.world_size)
        state = {}
        for index, bucket in enumerate(model.buckets):
            state |= bucket.layout.shard_state_as_dtensors(f"bucket.{index}", optimizer.state[bucket.shard], mesh)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # DTensor, only once checkpointing

        self.tensors = {"model": get_model_state_dict(unwrap(model)), "optimizer": state}

    def apply(self) -> None:
        """Loaded in place: nothing left to do."""


class _ShardedOptimizerStrategy(Replicated):
    """What ZeRO-1 and ZeRO-2 share; they differ only in when a bucket is reduce-scattered."""

    options: ClassVar[tuple[str, ...]] = ("zero_bucket_cap_mb", "zero_collectives")
    steps_a_shard: ClassVar[bool] = True
    checkpoint_layout: ClassVar[str] = FLAT_OPTIMIZER
    reduce_during_backward: ClassVar[bool]

    def __init__(self, bucket_cap_mb: float = ZERO_BUCKET_CAP_MB, collectives: str = "auto"):
        resolve_collectives(collectives, "gloo")  # refuses an unknown name here, before any rank starts
        self.bucket_cap_mb, self.collectives = bucket_cap_mb, collectives

    @classmethod
    def from_config(cls, parallel):
        return cls(parallel.zero_bucket_cap_mb, parallel.zero_collectives)

    def wrap(self, model, runtime):
        collectives = resolve_collectives(self.collectives, runtime.backend)
        return ShardedGradients(model, self.bucket_cap_mb, self.reduce_during_backward, collectives)

    def make_optimizer(self, model, factory):
        """torch's optimizer on this rank's slices; after each step the slices are all-gathered."""
        optimizer = factory(model.shard_parameters())
        optimizer.register_step_post_hook(lambda *_: model.all_gather_parameters())
        return optimizer

    def clip_grad_norm_(self, model, max_norm):
        shards = [shard.grad for shard in model.shard_parameters() if shard.grad is not None]
        return clip_sharded_grad_norm_(shards, max_norm, model.group)

    def checkpoint_state(self, model, optimizer, device_type):
        return ShardedOptimizerState(model, optimizer, device_type)

    def state_tensors(self, model, optimizer):
        frozen = [p for p in model.module.parameters() if not p.requires_grad]
        slices = [shard.grad for shard in model.shard_parameters() if shard.grad is not None]
        whole = [p.grad for p in model.params if p.grad is not None]  # accumulating under no_sync
        return {
            "parameters": _unique([bucket.full for bucket in model.buckets] + frozen),
            "gradients": slices + whole + model.whole_gradients(),
            "optimizer_state": _state_values(optimizer.state),
        }


class Zero1(_ShardedOptimizerStrategy):
    """ZeRO-1: optimizer state sharded; every bucket reduce-scattered after backward."""

    name: ClassVar[str] = "zero1"
    predicted_by: str = "zero1"
    reduce_during_backward: ClassVar[bool] = False


class Zero2(_ShardedOptimizerStrategy):
    """ZeRO-2: gradients sharded too; each bucket reduce-scattered, and freed, during backward."""

    name: ClassVar[str] = "zero2"
    predicted_by: str = "zero2"
    reduce_during_backward: ClassVar[bool] = True
