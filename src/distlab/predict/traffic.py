"""Bytes each rank sends in one optimizer step, derived per strategy (the ZeRO paper's 2Ψ / 3Ψ), for
:class:`distlab.comm.traffic.TrafficCounter`'s counts to be checked against.
"""

from __future__ import annotations


def expected_bytes_per_step(
    strategy: str, parameters: int, world_size: int, bytes_per_value: int = 4, gathered_once: int = 0
) -> float:
    """The derivation: bytes one rank sends in one optimizer step, for ``parameters`` (Ψ) values and
    ``strategy`` a model of :data:`distlab.predict.memory.STAGE`.

    DDP all-reduces the gradients: 2Ψ(n-1)/n. ZeRO-1 and ZeRO-2 reduce-scatter
    them (each rank needs only the slice it steps) and all-gather the updated
    parameters: an all-reduce cut in two, so DDP's 2Ψ(n-1)/n. Sharding
    gradients and optimizer state costs no traffic. ZeRO-3 all-gathers the
    parameters in forward and again in backward, and reduce-scatters the
    gradients: 3Ψ(n-1)/n, 1.5x DDP; keeping the gathered parameters from
    forward to backward (``-no-reshard``, FSDP1's SHARD_GRAD_OP) saves the
    second gather: 2Ψ(n-1)/n. FSDP2 sends what ZeRO-3 does. ``gathered_once``
    values are gathered once even under ZeRO-3: the root unit computes last in
    forward and first in backward, so it stays gathered in
    between (FSDP2 does the same). Ψ here includes the padding of the flat buffers.
    """
    volumes = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "zero3-no-reshard": 2, "fsdp": 3, "fsdp-no-reshard": 2}
    if strategy not in volumes:
        raise ValueError(f"no derivation for {strategy!r}: choose from {', '.join(volumes)}")
    values = volumes[strategy] * parameters - (gathered_once if strategy in ("zero3", "fsdp") else 0)
    n = world_size
    return values * bytes_per_value * (n - 1) / n
