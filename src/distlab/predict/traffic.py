"""Bytes each rank sends in one optimizer step, derived per strategy (the ZeRO paper's 2Ψ / 3Ψ), for
:class:`distlab.comm.traffic.TrafficCounter`'s counts to be checked against.
"""

from __future__ import annotations

import math


def expected_bytes_per_step(
    strategy: str,
    parameters: int,
    world_size: int,
    bytes_per_value: int = 4,
    gathered_once: int = 0,
    trainable: int | None = None,
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

    A frozen base: only ``trainable`` of the Ψ values (all of them when None) have gradients. Only
    those are reduced, and only those change, so ZeRO-1/2 gather back only those; but ZeRO-3 and FSDP
    still gather every parameter, frozen or not, to compute with it: :func:`sharded_values_sent`.
    """
    volumes = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "zero3-no-reshard": 2, "fsdp": 3, "fsdp-no-reshard": 2}
    if strategy not in volumes:
        raise ValueError(f"no derivation for {strategy!r}: choose from {', '.join(volumes)}")
    trainable = parameters if trainable is None else trainable
    if not 0 <= trainable <= parameters:
        raise ValueError(f"trainable must be from 0 to parameters ({parameters}), not {trainable!r}")
    if volumes[strategy] == 2 and not strategy.endswith("no-reshard"):
        values = 2 * trainable  # DDP's all-reduce, or ZeRO-1/2's reduce-scatter and gather: the trainable values
    else:
        gathers = volumes[strategy] - 1
        values = sharded_values_sent(parameters, trainable, gathers)
        values -= gathered_once if strategy in ("zero3", "fsdp") else 0
    n = world_size
    return values * bytes_per_value * (n - 1) / n


def sharded_values_sent(parameters: int, trainable: int, gathers: int = 2) -> int:
    """Values ZeRO-3 / FSDP put on the wire per step before the ring's (n-1)/n: every parameter gathered
    ``gathers`` times (forward and backward; once without resharding), frozen ones too, and the
    ``trainable`` gradients reduce-scattered."""
    return gathers * parameters + trainable


def frozen_crossing(gathers: int = 2, gather_bytes: int = 4, reduce_bytes: int = 4, ddp_bytes: int = 4) -> float:
    """The trainable fraction f at which FSDP sends what DDP sends, per value of the model: DDP all-reduces
    ``2f`` values of ``ddp_bytes``, FSDP gathers every value ``gathers`` times in ``gather_bytes`` and
    reduce-scatters ``f`` in ``reduce_bytes``. Equal where f = gathers·gather_bytes / (2·ddp_bytes -
    reduce_bytes); below it FSDP sends more. In one dtype that is f = gathers (2 for FULL_SHARD): above every
    fraction a model can have, so over a frozen base FSDP always sends more. ``inf`` where DDP never sends
    more."""
    wider = 2 * ddp_bytes - reduce_bytes
    return gathers * gather_bytes / wider if wider > 0 else float("inf")


def powersgd_values(shape: tuple[int, ...], rank: int, min_compression_rate: float = 2.0) -> tuple[int, bool]:
    """The values one gradient of ``shape`` puts into PowerSGD's all-reduces in a compressed step, and whether it
    is compressed, as ``powerSGD_hook`` decides (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``,
    ``_should_compress``): the gradient is seen as a matrix of ``shape[0]`` rows and every other dimension's values
    as columns (a bias of k values is k x 1); its rank is capped at min(rows, columns, ``rank``); it is compressed
    into P (rows x rank) and Q (columns x rank) only if those are smaller than the matrix by more than
    ``min_compression_rate``, else it is all-reduced whole."""
    rows, columns = (shape[0] if shape else 1), math.prod(shape[1:])
    kept = min(rows, columns, rank)
    if (rows + columns) * kept * min_compression_rate < rows * columns:
        return (rows + columns) * kept, True
    return rows * columns, False


def powersgd_bytes_per_step(
    shapes: list[tuple[int, ...]],
    rank: int,
    world_size: int,
    bytes_per_value: int = 4,
    min_compression_rate: float = 2.0,
) -> float:
    """Bytes one rank sends in a step of DDP under ``powerSGD_hook`` once compression has started (after
    ``start_powerSGD_iter`` steps of plain all-reduce), for gradients of ``shapes``: per bucket three
    all-reduces, the uncompressed gradients flattened together, then every P, then every Q
    (:func:`powersgd_values` for each), each 2(n-1)/n of its bytes as a ring sends them. The buckets' split does
    not change the sum."""
    values = sum(powersgd_values(tuple(shape), rank, min_compression_rate)[0] for shape in shapes)
    return 2 * (world_size - 1) / world_size * values * bytes_per_value
