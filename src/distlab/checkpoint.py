"""Model state out of a wrapped model, whatever wrapped it.

``torch.distributed.checkpoint.state_dict`` knows torch DDP and FSDP2; the
course's own DDP wrappers are unwrapped first, and its ZeRO-3 gathers its own
shards. A full state dict gathers every sharded parameter, so it is a
collective: every rank must call it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from .parallel.mini_ddp import DataParallelWrapper
from .parallel.mini_fsdp import ShardedParameters


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP-style wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return model.module if isinstance(model, (DistributedDataParallel, DataParallelWrapper)) else model


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole and on the CPU: on every rank, or,
    with ``rank0_only``, on rank 0 alone (the others get ``{}``), so no other
    rank ever holds the whole model."""
    if isinstance(model, ShardedParameters):  # the course's ZeRO-3 knows where its shards go
        return model.full_state_dict(rank0_only)
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(unwrap(model), options=options)
    return {key: value.detach().cpu().clone() for key, value in state.items()}
