"""Strategies: every way to wrap a model for data-parallel training, behind one Strategy contract.

Each is a :class:`.base.Strategy`, the naive version beside the real one:

* :mod:`.replicated`: one process, torch DDP, and the course's DDP from scratch (:mod:`.mini_ddp`);
* :mod:`.zero`: ZeRO-1 and ZeRO-2 from scratch (optimizer state, then gradients, sharded);
* :mod:`.mini_fsdp`: ZeRO-3 from scratch (the parameters themselves sharded), the course's own FSDP;
* :mod:`.fsdp2`: torch's FSDP2.

``STRATEGIES`` maps each command-line name to its class. :mod:`.flat_param` lays parameters end to end in
equal shards for the from-scratch ZeRO; :mod:`.fsdp1` runs FSDP1 as the notes configure it, outside the registry.

A new strategy goes here: a :class:`.base.Strategy` subclass in its own module, added to ``STRATEGIES``.

May import: spine, comm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import DistlabError
from .base import Strategy
from .fsdp2 import FSDP2
from .mini_fsdp import Zero3
from .replicated import BucketedDDPStrategy, NaiveDDPStrategy, Single, TorchDDP
from .zero import Zero1, Zero2

if TYPE_CHECKING:
    from ..config import ParallelConfig

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Single, TorchDDP, FSDP2, NaiveDDPStrategy, BucketedDDPStrategy, Zero1, Zero2, Zero3)
}


def make_strategy(parallel: ParallelConfig) -> Strategy:
    """The strategy a configuration's ``parallel`` section names, with its options."""
    if parallel.strategy not in STRATEGIES:
        raise DistlabError(f"unknown strategy {parallel.strategy!r}: use {', '.join(STRATEGIES)}")
    return STRATEGIES[parallel.strategy].from_config(parallel)
