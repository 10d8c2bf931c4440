"""Strategies that keep a full replica of the model on every rank: one
process alone, torch DDP, and the course's own DDP (:mod:`.mini_ddp`)."""

from __future__ import annotations

import inspect
from typing import ClassVar

from torch.nn.parallel import DistributedDataParallel

from .base import Strategy
from .mini_ddp import BucketedDDP, NaiveDDP


class Single(Strategy):
    """One process, no wrapper: the baseline every other strategy must match."""

    name: ClassVar[str] = "single"
    max_world_size: ClassVar[int | None] = 1

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

    name: ClassVar[str] = "ddp"
    options: ClassVar[tuple[str, ...]] = ("ddp_bucket_cap_mb", "ddp_broadcast_buffers")

    def __init__(self, bucket_cap_mb: float | None = None, broadcast_buffers: bool = True):
        self.bucket_cap_mb = bucket_cap_mb or None  # None: torch's default, whose first bucket is 1 MiB
        self.broadcast_buffers = broadcast_buffers

    @classmethod
    def from_config(cls, parallel):
        return cls(parallel.ddp_bucket_cap_mb, parallel.ddp_broadcast_buffers)

    def wrap(self, model, runtime):
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb, **self._buffer_sync()
        )

    def _buffer_sync(self) -> dict[str, bool]:
        """torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the old name warns);
        Kaggle's torch 2.10-2.11 knows only the old one."""
        if self.broadcast_buffers:
            return {}  # the default either way
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        return {"forward_sync_buffers" if renamed else "broadcast_buffers": False}


class NaiveDDPStrategy(Replicated):
    """:class:`.mini_ddp.NaiveDDP`: one all-reduce per gradient after backward."""

    name: ClassVar[str] = "naive_ddp"

    def wrap(self, model, runtime):
        return NaiveDDP(model)


class BucketedDDPStrategy(Replicated):
    """:class:`.mini_ddp.BucketedDDP`: bucketed all-reduces overlapping backward."""

    name: ClassVar[str] = "bucketed_ddp"
    options: ClassVar[tuple[str, ...]] = ("ddp_bucket_cap_mb",)

    def __init__(self, bucket_cap_mb: float = 25.0):
        self.bucket_cap_mb = bucket_cap_mb or 25.0

    @classmethod
    def from_config(cls, parallel):
        return cls(parallel.ddp_bucket_cap_mb)

    def wrap(self, model, runtime):
        return BucketedDDP(model, bucket_cap_mb=self.bucket_cap_mb)
