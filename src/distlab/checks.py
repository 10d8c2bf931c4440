"""Catch the two classic DDP data mistakes while the job runs.

1. No ``DistributedSampler``: every rank iterates the whole dataset, so with
   the same seed every rank trains on the same batches (N GPUs, one GPU's
   worth of distinct data).
2. No ``sampler.set_epoch(epoch)``: the sampler reshuffles with the same seed
   each epoch, so every epoch visits the samples in the same order.

:class:`DataOrderCheck` looks at the loader when it can (the type of its
sampler, whether the sampler's epoch moved) and otherwise at the data
itself: it fingerprints each rank's first batch of every epoch and compares
the fingerprints across ranks and across epochs. Every rank gets the same
list of problems, so every rank can act on it the same way.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from .runtime import DistlabError

SAME_BATCH_ON_RANKS = (
    "ranks {ranks} got the same first batch in epoch {epoch}: give each rank its own shard "
    "with DataLoader(dataset, sampler=DistributedSampler(dataset))"
)
NOT_DISTRIBUTED_SAMPLER = (
    "the DataLoader's sampler is a {kind}, not a DistributedSampler: every rank draws "
    "from the whole dataset instead of its 1/{world} shard"
)
SAME_ORDER_AS_LAST_EPOCH = (
    "epoch {epoch} starts with the same batch as epoch {previous} on every rank: call "
    "sampler.set_epoch(epoch) at the start of each epoch so the shuffle changes"
)


def fingerprint(batch: torch.Tensor) -> int:
    """A checksum of a batch's bytes (CRC32): equal batches, equal prints."""
    data = batch.detach().contiguous().cpu()
    return zlib.crc32(data.view(torch.uint8).numpy().tobytes()) if data.numel() else 0


class DataOrderCheck:
    """Call :meth:`check_first_batch` with the first batch of every epoch.

    ``loader`` (optional) lets the check inspect a ``DataLoader``'s sampler.
    With ``strict=True`` a problem raises :class:`DistlabError`; otherwise
    :meth:`check_first_batch` returns the problems for the caller to report.
    """

    def __init__(self, loader: Any = None, group=None, strict: bool = False):
        self.loader = loader
        self.group = group
        self.strict = strict
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self._previous: tuple[int, list[int], int | None] | None = None

    def check_first_batch(self, epoch: int, inputs: torch.Tensor) -> list[str]:
        prints = self._gather(fingerprint(inputs))
        sampler = getattr(self.loader, "sampler", None)
        sampler_epoch = getattr(sampler, "epoch", None)
        problems = []
        if self.world_size > 1:
            if sampler is not None and not isinstance(sampler, DistributedSampler) and self._previous is None:
                problems.append(NOT_DISTRIBUTED_SAMPLER.format(kind=type(sampler).__name__, world=self.world_size))
            duplicates = _ranks_sharing_a_value(prints)
            if duplicates:
                problems.append(SAME_BATCH_ON_RANKS.format(ranks=" and ".join(map(str, duplicates)), epoch=epoch))
        if self._previous is not None:
            previous_epoch, previous_prints, previous_sampler_epoch = self._previous
            same_data = previous_prints == prints
            sampler_stuck = (
                isinstance(sampler, DistributedSampler) and sampler.shuffle and sampler_epoch == previous_sampler_epoch
            )
            if same_data or sampler_stuck:
                problems.append(SAME_ORDER_AS_LAST_EPOCH.format(epoch=epoch, previous=previous_epoch))
        self._previous = (epoch, prints, sampler_epoch)
        if problems and self.strict:
            raise DistlabError(problems[0])
        return problems

    def _gather(self, value: int) -> list[int]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered


def _ranks_sharing_a_value(values: list[int]) -> list[int]:
    first_seen: dict[int, int] = {}
    for rank, value in enumerate(values):
        if value in first_seen:
            return [first_seen[value], rank]
        first_seen[value] = rank
    return []
