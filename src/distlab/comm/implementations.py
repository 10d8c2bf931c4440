"""Which implementation of the sharding collectives a run uses when it is not told: the course's ring
(:mod:`distlab.comm.collectives`) or torch's. The one home of that rule: the strategies choose with it
(:func:`distlab.parallel.flat_param.resolve_collectives`) and the cost model predicts with it
(:func:`distlab.predict.costmodel.collective_calls`). Imports nothing, torch included, so a prediction may read it.
"""

from __future__ import annotations

IMPLEMENTATIONS = ("torch", "ring")
"""The sharding collectives a ZeRO stage can run: torch's ``reduce_scatter_tensor``/``all_gather_into_tensor``,
or the course's ring written with point-to-point messages."""


def default_implementation(backend: str) -> str:
    """The ring on gloo, whose reduce-scatter runs a whole all-reduce underneath (so it costs what DDP's
    all-reduce does, and the all-gather comes on top); torch's elsewhere (NCCL's reduce-scatter is a real one)."""
    return "ring" if backend == "gloo" else "torch"
