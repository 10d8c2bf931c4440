"""The alpha-beta model of a ring all-reduce: ``t = alpha*2(n-1) + 2(n-1)/n * S/B``, and its time for any size
once :func:`distlab.bench.allreduce.fit_latency_bandwidth` has fitted alpha and B to a benchmark's medians.
"""

from __future__ import annotations


def bus_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


def predict_time(fit: dict, size: float, world_size: int) -> float:
    """The fitted model's time for one all-reduce of ``size`` bytes on ``world_size`` ranks."""
    return 2 * (world_size - 1) * fit["alpha_s"] + bus_factor(world_size) * size / fit["bandwidth_Bps"]
