"""The memory calculator: bytes per rank, strategy by strategy, for a model known only by its size.

:func:`memory_per_rank` answers "does a model of P parameters train on N GPUs of M GiB each?" with
the ZeRO memory model of :mod:`distlab.predict.memory`: one row per strategy (DDP, ZeRO-1, ZeRO-2, FSDP
FULL_SHARD, FSDP SHARD_GRAD_OP), each with its parameters, gradients, optimizer state, gathered
parameters, activations, total and whether it fits. :func:`largest_fitting_parameters` turns the
question round: the most parameters each strategy fits on those GPUs. The book's calculator
(``book/_static/distlab-calculator.js``) computes both in the reader's browser, and
``tests/test_calculator.py`` checks that page and library give the same numbers.

The model is cut into ``shard_units`` equal units (a GPT's blocks), which FSDP gathers one at a time;
the units are flat, so every count is exact for the padding each unit's flat shard adds, not for the
per-parameter padding of a real model's shapes (:func:`distlab.predict.memory.shard_unit_shapes` gives those).
"""

from __future__ import annotations

from distlab.predict.memory import BYTES_PER_VALUE, Shape, expected_gathered_bytes, expected_state_bytes

GIB = 2**30
PRECISIONS = {"fp32": "fp32", "mixed": "mixed bf16/fp16"}
"""The precisions of :data:`distlab.predict.memory.BYTES_PER_VALUE`: fp32 everywhere, or the ZeRO paper's mixed
precision (16-bit parameters and gradients, fp32 master weights in the optimizer state)."""
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD with momentum"}
STRATEGIES = {
    "DDP": "ddp",
    "ZeRO-1": "zero1",
    "ZeRO-2": "zero2",
    "FSDP FULL_SHARD (ZeRO-3)": "fsdp",
    "FSDP SHARD_GRAD_OP": "fsdp-no-reshard",
}
"""Row label -> the model of :data:`distlab.predict.memory.STAGE`. Both FSDP rows hold ZeRO-3's state at rest;
they differ in the gathered parameters at the peak."""
ROW_FIELDS = ("strategy", "parameters", "gradients", "optimizer_state", "gathered", "activations", "total", "fits")
DEFAULT_SHARD_UNITS = 32
"""gpt-6.7b's (and a 7B Llama's) 32 transformer blocks."""


def equal_units(parameters: int, shard_units: int) -> list[list[Shape]]:
    """``parameters`` values in ``shard_units`` flat units as equal as integers allow (the first ones
    one value larger), and last an empty root: the ``units`` form of :mod:`distlab.predict.memory`."""
    size, larger = divmod(parameters, shard_units)
    return [[(size + 1,)] for _ in range(larger)] + [[(size,)] for _ in range(shard_units - larger)] + [[]]


def _check(parameters, gpus, memory_gib, precision, optimizer, activations_gib, shard_units) -> None:
    """One line saying which input is wrong and what it may be."""
    if not isinstance(parameters, int) or parameters < 1:
        raise ValueError(f"parameters must be a whole number of at least 1, not {parameters!r}")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a whole number of at least 1, not {gpus!r}")
    if not memory_gib > 0:
        raise ValueError(f"memory_gib (memory per GPU, GiB) must be positive, not {memory_gib!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {optimizer!r}")
    if not activations_gib >= 0:
        raise ValueError(f"activations_gib must be 0 or more, not {activations_gib!r}")
    if not isinstance(shard_units, int) or not 1 <= shard_units <= parameters:
        raise ValueError(f"shard_units must be a whole number from 1 to parameters ({parameters}), not {shard_units!r}")


def _row(
    label: str,
    parameters: int,
    gpus: int,
    memory_gib: float,
    precision: str,
    optimizer: str,
    activations: int,
    shard_units: int,
) -> dict:
    """One strategy's row of :func:`memory_per_rank` (inputs already checked)."""
    strategy = STRATEGIES[label]
    units = equal_units(parameters, shard_units)
    parameter_bytes = BYTES_PER_VALUE[optimizer, precision][0]
    sharded_units = units if strategy.startswith("fsdp") else None  # zero1/zero2: one flat buffer per 5 MB bucket
    state = expected_state_bytes(parameters, strategy, gpus, optimizer, precision, units=sharded_units)
    gathered = expected_gathered_bytes(strategy, gpus, units, parameter_bytes)
    total = state["parameters"] + state["gradients"] + state["optimizer_state"] + gathered + activations
    return {"strategy": label, **state, "gathered": gathered, "activations": activations, "total": total} | {
        "fits": total <= memory_gib * GIB
    }


def memory_per_rank(
    parameters: int,
    gpus: int,
    memory_gib: float,
    precision: str = "mixed",
    optimizer: str = "adam",
    activations_gib: float = 0.0,
    shard_units: int = DEFAULT_SHARD_UNITS,
) -> list[dict]:
    """Bytes rank 0 holds at its peak under each strategy, and whether they fit in ``memory_gib``.

    One dict per strategy of :data:`STRATEGIES`, with the keys of :data:`ROW_FIELDS`: the state of
    :func:`distlab.predict.memory.expected_state_bytes`, the whole parameters FSDP gathers (one unit at a time
    with FULL_SHARD, all of them with SHARD_GRAD_OP: :func:`distlab.predict.memory.expected_gathered_bytes`)
    in the parameters' dtype, ``activations_gib`` (the
    same for every strategy: they depend on batch, sequence and model), their ``total`` and
    ``fits = total <= memory_gib`` GiB."""
    _check(parameters, gpus, memory_gib, precision, optimizer, activations_gib, shard_units)
    activations = int(activations_gib * GIB)
    return [
        _row(label, parameters, gpus, memory_gib, precision, optimizer, activations, shard_units)
        for label in STRATEGIES
    ]


LARGEST_SEARCHED = 10**14
"""The largest model :func:`largest_fitting_parameters` tries (100 trillion parameters): every byte count
below it stays under 2**53, where the page's JavaScript numbers are still exact integers."""


def largest_fitting_parameters(
    gpus: int,
    memory_gib: float,
    precision: str = "mixed",
    optimizer: str = "adam",
    activations_gib: float = 0.0,
    shard_units: int = DEFAULT_SHARD_UNITS,
) -> dict[str, int]:
    """The most parameters each strategy fits in ``memory_gib`` per GPU (rows as :func:`memory_per_rank`).

    A bisection over the parameter count, whose totals never fall as it grows: 0 where even a model of
    ``shard_units`` parameters does not fit, :data:`LARGEST_SEARCHED` where that one still fits."""
    _check(shard_units, gpus, memory_gib, precision, optimizer, activations_gib, shard_units)
    activations = int(activations_gib * GIB)
    largest = {}
    for label in STRATEGIES:

        def fits(parameters: int, label: str = label) -> bool:
            return _row(label, parameters, gpus, memory_gib, precision, optimizer, activations, shard_units)["fits"]

        if not fits(shard_units):
            largest[label] = 0
            continue
        if fits(LARGEST_SEARCHED):
            largest[label] = LARGEST_SEARCHED
            continue
        fitting, too_large = shard_units, LARGEST_SEARCHED
        while too_large - fitting > 1:
            middle = (fitting + too_large) // 2
            fitting, too_large = (middle, too_large) if fits(middle) else (fitting, middle)
        largest[label] = fitting
    return largest
