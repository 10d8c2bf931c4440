"""Strategies: every way to wrap a model for data-parallel training, behind one Strategy contract.

Each is a :class:`.base.Strategy`, the naive version beside the real one: one process, torch DDP and the
course's DDP from scratch; ZeRO-1 and ZeRO-2 from scratch (optimizer state, then gradients, sharded); ZeRO-3
from scratch (the parameters themselves sharded), the course's own FSDP; and torch's FSDP2.

``STRATEGIES`` maps each command-line name to its class; :func:`full_state_dict` gathers any wrapped model
whole (the course's ZeRO-3 knows where its own shards go), and :func:`unwrap` finds the user's module in it.
:mod:`.flat_param` lays parameters end to end in equal shards for the from-scratch ZeRO; :mod:`.fsdp1` runs
FSDP1 as the notes configure it, outside the registry. :mod:`.sharded_optimizer` is ZeRO-1 as an optimizer, not a
strategy: :func:`~.sharded_optimizer.get_sharded_optimizer` (torch's ``ZeroRedundancyOptimizer``'s interface) deals
whole parameters out to the ranks, each stepping its own and broadcasting them; the caller averages the gradients.

A new strategy goes here: a :class:`.base.Strategy` subclass in its own module, added to ``STRATEGIES``.

May import: core, comm.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import DistlabError
from .base import Strategy, StrategySettings
from .checkpoint_state import unwrap
from .fsdp2 import FSDP2
from .replicated import BucketedDDPStrategy, NaiveDDPStrategy, Single, TorchDDP
from .zero import Zero1, Zero2
from .zero3 import ShardedParameters, Zero3

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Single, TorchDDP, FSDP2, NaiveDDPStrategy, BucketedDDPStrategy, Zero1, Zero2, Zero3)
}


def make_strategy(parallel: StrategySettings) -> Strategy:
    """The strategy a configuration's ``parallel`` section names, with its options."""
    if parallel.strategy not in STRATEGIES:
        raise DistlabError(f"unknown strategy {parallel.strategy!r}: use {', '.join(STRATEGIES)}")
    return STRATEGIES[parallel.strategy].from_config(parallel)


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a wrapped model, whole and on the CPU: on every rank, or, with
    ``rank0_only``, on rank 0 alone (the others get ``{}``), so no other rank ever holds the whole model.
    A collective: every rank must call it."""
    if isinstance(model, ShardedParameters):  # the course's ZeRO-3 knows where its shards go
        return model.full_state_dict(rank0_only)
    # Imported here: DCP imports DTensor and sympy, a second of every rank's start that a run need not pay.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(unwrap(model), options=options)
    return {key: value.detach().cpu().clone() for key, value in state.items()}
