"""The communication hooks chapter's exercise: the bytes a rank sends in a step of DDP under PowerSGD. Arithmetic,
run on one rank and graded on a grid of models against the library's model
(:func:`distlab.predict.traffic.powersgd_bytes_per_step`, which the chapter's test holds to the values torch's
``powerSGD_hook`` itself counts, ``PowerSGDState.compression_stats()``); a wrong answer is compared with what each
typical mistake would give.
"""

from __future__ import annotations

import math

from ..predict.traffic import powersgd_bytes_per_step, powersgd_values
from .catalog import Exercise
from .trial import Trial, numbers_close

MODELS = (
    ([(1024, 256), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)], "the chapter's MLP: 256 -> 1024 -> 1024 -> 10"),
    (
        [(64, 3, 3, 3), (64,), (64,), (64,), (128, 64, 3, 3), (128,), (128,), (128,), (10, 128), (10,)],
        "a small CNN: two 3 x 3 convolutions with BatchNorm, then a linear layer",
    ),
    (
        [
            (50304, 768),
            (1024, 768),
            (2304, 768),
            (2304,),
            (768, 768),
            (768,),
            (3072, 768),
            (3072,),
            (768, 3072),
            (768,),
            (768,),
            (768,),
        ],
        "one GPT-2 small block with its embeddings",
    ),
)
"""(gradient shapes, what they are)."""
SETTINGS = ((1, 2), (4, 4), (32, 8))
"""(PowerSGD's rank, world size) each model is checked with."""


def _bytes(values: float, world_size: int) -> float:
    return 2 * (world_size - 1) / world_size * values * 4


def _mistakes(shapes, rank: int, world_size: int) -> list[tuple[str, float]]:
    def total(values_of) -> float:
        return _bytes(sum(values_of(tuple(shape)) for shape in shapes), world_size)

    def columns_from_last_dim(shape):
        rows, columns = math.prod(shape) // shape[-1], shape[-1]
        return powersgd_values((rows, columns), rank)[0]

    def every_tensor_compressed(shape):
        rows, columns = shape[0], math.prod(shape) // shape[0]
        return (rows + columns) * min(rows, columns, rank)

    def only_p(shape):
        values, compressed = powersgd_values(shape, rank)
        return shape[0] * min(shape[0], math.prod(shape) // shape[0], rank) if compressed else values

    return [
        ("every_tensor_compressed", total(every_tensor_compressed)),
        ("forgot_uncompressed", total(lambda s: powersgd_values(s, rank)[0] if powersgd_values(s, rank)[1] else 0)),
        ("only_p", total(only_p)),
        ("columns_from_last_dim", total(columns_from_last_dim)),
        ("values_not_ring_bytes", sum(powersgd_values(tuple(s), rank)[0] for s in shapes) * 4),
    ]


def powersgd_bytes_trial(t: Trial, fn) -> None:
    for shapes, model in MODELS:
        for rank, world_size in SETTINGS:
            with t.case(f"{model}; PowerSGD rank {rank} on {world_size} ranks"):
                expected = powersgd_bytes_per_step(shapes, rank, world_size)
                got = t.call(fn, [tuple(s) for s in shapes], rank, world_size)
                if numbers_close(got, expected):
                    continue
                mistake = next((k for k, v in _mistakes(shapes, rank, world_size) if numbers_close(got, v)), None)
                shown = f"{got:,.0f} B" if isinstance(got, int | float) else repr(got)
                t.fail("bytes sent", f"got {shown}, expected {expected:,.0f} B", mistake)
    t.note("a matrix is compressed into P and Q only where that saves more than half; the rest goes whole")


EXERCISES = (
    Exercise(
        name="powersgd_bytes_sent",
        page="comm_hooks",
        task="Return the bytes one rank sends in a step of DDP under `powerSGD_hook` once compression has started, "
        "for fp32 gradients of `shapes`, PowerSGD's `rank` (its `matrix_approximation_rank`, "
        "`min_compression_rate` 2) and `world_size` ranks, each all-reduce sending 2(n-1)/n of its bytes.",
        signature="def powersgd_bytes_sent(shapes: list[tuple[int, ...]], rank: int, world_size: int) -> float:",
        solution="hooks.powersgd_bytes_sent",
        library="distlab.predict.traffic.powersgd_bytes_per_step",
        trial=powersgd_bytes_trial,
        ranks=1,
        mistakes={
            "every_tensor_compressed": "a tensor is compressed only if (rows + columns) x rank x 2 is below rows x "
            "columns: a bias (k x 1) and a small matrix are all-reduced whole, their values as they are.",
            "forgot_uncompressed": "the tensors PowerSGD does not compress still go: flattened together into one "
            "all-reduce of their own, beside the Ps and the Qs.",
            "only_p": "each compressed matrix sends two small ones, P (rows x rank) and then Q (columns x rank): "
            "(rows + columns) x rank values.",
            "columns_from_last_dim": "PowerSGD sees a gradient as shape[0] rows and every other dimension's values as "
            "columns (a 3 x 3 convolution's weight is out_channels x in_channels * 9), not the last dimension.",
            "values_not_ring_bytes": "an all-reduce of V values in fp32 sends 2(n-1)/n x 4V bytes from each rank "
            "(the ring's reduce-scatter and all-gather), not 4V.",
        },
    ),
)
