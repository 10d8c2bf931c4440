"""The ZeRO paper's memory arithmetic, with the padding each implementation really adds.

:func:`expected_state_bytes`, :func:`expected_gathered_bytes` and :func:`expected_peak_bytes` are the
model: bytes per parameter by optimizer and precision, divided by the N ranks stage by stage. What it is
compared with, every byte a rank really holds, is :mod:`distlab.measure.memory`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn

# The analytic model. Bytes per parameter value: (parameters, gradients, optimizer state).
# "mixed" is the ZeRO paper's mixed precision: fp16/bf16 parameters and gradients, and in the
# optimizer state an fp32 master copy beside Adam's two moments. distlab's --precision bf16/fp16
# is autocast over fp32 parameters: its state is "fp32".
BYTES_PER_VALUE = {
    ("adam", "fp32"): (4, 4, 8),  # exp_avg, exp_avg_sq
    ("adamw", "fp32"): (4, 4, 8),
    ("sgd", "fp32"): (4, 4, 4),  # momentum_buffer
    ("adam", "mixed"): (2, 2, 12),  # fp32 master, exp_avg, exp_avg_sq
    ("adamw", "mixed"): (2, 2, 12),
    ("sgd", "mixed"): (2, 2, 8),  # fp32 master, momentum
}
STEP_COUNTER_BYTES = {"adam": 4, "adamw": 4, "sgd": 0}
"""torch's Adam keeps one float32 scalar ``step`` per parameter tensor it steps (on the CPU
unless capturable or fused, even when training on CUDA); SGD keeps none."""
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-no-reshard": 3, "fsdp": 3, "fsdp-no-reshard": 3}
"""The course's models of a strategy, by name, with the ZeRO stage each one is: 1 shards the optimizer state
over the ranks, 2 also the gradients, 3 also the parameters. ``ddp`` is every replicated strategy; ``zero*``
cut flat buffers, ``fsdp*`` each parameter (FSDP2); ``-no-reshard`` keeps the gathered parameters from forward
to backward. A strategy names the model that predicts it (``Strategy.predicted_by`` in
:mod:`distlab.parallel`): the predictions never look a strategy up."""
Shape = Sequence[int]


def shard_unit_shapes(model: nn.Module) -> list[list[torch.Size]]:
    """Trainable parameter shapes (each parameter once) of every shard unit of an
    unwrapped model, in order, and last those left to the root (perhaps none)."""
    seen: set[int] = set()
    units = []
    for unit in [*model.shard_units(), model]:
        fresh = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in fresh)
        units.append([p.shape for p in fresh])
    return units


def parameter_shapes(model: nn.Module) -> list[torch.Size]:
    """Trainable parameter shapes (each parameter once) in the order the model registers them: the order
    DDP's buckets and the course's ZeRO-1/2 buckets are cut in, from the last."""
    return [p.shape for p in model.parameters() if p.requires_grad]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _rows(shape: Shape) -> tuple[int, int]:
    """dim 0 and the values in one dim-0 row (a scalar is one row of one)."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def _values_per_rank(strategy: str, n: int, units: Sequence[Sequence[Shape]], rank: int) -> tuple[int, int, int, int]:
    """Values one rank holds of (parameters, gradients, optimizer state), and its step counters."""
    shapes = [shape for unit in units for shape in unit]
    if strategy.startswith("fsdp"):  # FSDP2: each parameter's dim 0 padded to a multiple of N, shard = ceil(dim0/N)
        # rows; the optimizer's state has only this rank's own rows (torch.chunk's split, no padding)
        padded = sum(_ceil(d0, n) * row for d0, row in map(_rows, shapes))
        own = sum(max(0, min(_ceil(d0, n), d0 - rank * _ceil(d0, n))) * row for d0, row in map(_rows, shapes))
        return padded, padded, own, len(shapes)
    if strategy.startswith("zero3"):  # one flat buffer a unit, padded to a multiple of N; one optimizer tensor each
        shard = sum(_ceil(sum(math.prod(s) for s in unit), n) for unit in units)
        return shard, shard, shard, sum(1 for unit in units if unit)
    total, stage = sum(math.prod(s) for s in shapes), STAGE[strategy]
    if stage == 0:
        return total, total, total, len(shapes)
    # zero1/zero2: one flat buffer per gradient bucket, padded to a multiple of N; the parameters live in
    # those buffers, and the optimizer steps a view of this rank's slice of each
    buckets = gradient_buckets(shapes)
    shard = sum(_ceil(sum(math.prod(s) for s in bucket), n) for bucket in buckets)
    return shard * n, shard if stage == 2 else shard * n, shard, len(buckets)  # zero1 keeps its flat gradients


def gradient_buckets(shapes: Sequence[Shape], cap_mb: float = 5.0, bytes_per_value: int = 4) -> list[list[Shape]]:
    """The course's gradient buckets (:func:`distlab.parallel.mini_ddp.bucket_groups`) over parameter shapes
    listed in the order the model registers them: from the last, a new bucket whenever ``cap_mb`` would be
    passed (5 MB: the course's ZeRO-1/2 default, :data:`distlab.parallel.zero.ZERO_BUCKET_CAP_MB`)."""
    buckets, current, size, cap = [], [], 0, int(cap_mb * 2**20)
    for shape in reversed(shapes):
        nbytes = math.prod(shape) * bytes_per_value
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(shape)
        size += nbytes
    return buckets + ([current] if current else [])


def expected_state_bytes(
    parameters: int,
    strategy: str,
    world_size: int,
    optimizer: str = "adam",
    precision: str = "fp32",
    units: Sequence[Sequence[Shape]] | None = None,
    rank: int = 0,
) -> dict[str, int]:
    """Bytes of ``parameters``, ``gradients`` (as the optimizer steps) and ``optimizer_state`` on one rank,
    for ``strategy`` a model of :data:`STAGE`.

    ddp (every replicated strategy) holds everything; zero1 divides the optimizer state
    by N, zero2 also the gradients, zero3 and fsdp also the parameters. A divided value
    is ``ceil(values / N)`` of the padded buffer the implementation really cuts:

    * zero1, zero2: one flat buffer per gradient bucket;
    * zero3: one flat buffer per shard unit;
    * fsdp (FSDP2): each parameter on its own, dim 0 padded to a multiple of N; its
      Adam state is unpadded, this ``rank``'s own rows (rank 0 holds the most).

    Adam's ``step`` counters count one per tensor stepped: every parameter, but one flat
    shard per bucket for zero1/zero2 and one per unit for zero3. They are CPU tensors (torch
    keeps ``step`` on the host unless Adam is capturable or fused), so they are the rank's
    memory on gloo, as the course measures it; on a GPU they are host memory, and the GPU
    holds 4 bytes less per tensor than this counts. ``units`` are the trainable
    parameters' shapes by shard unit (:func:`shard_unit_shapes`); without them the model
    is one flat tensor of ``parameters`` values. zero1/zero2 cut their buckets from the
    shapes in the order given (:func:`gradient_buckets`, 5 MB each): a model under
    1.3M parameters is one bucket, and for a larger one only shapes in the order the
    model registers them put the bucket boundaries, a few values of padding each, exactly
    where the implementation does."""
    units = [[(parameters,)]] if units is None else units
    if sum(math.prod(s) for unit in units for s in unit) != parameters:
        raise ValueError(f"the shapes in units hold a different number of values than parameters={parameters}")
    if strategy not in STAGE or (optimizer, precision) not in BYTES_PER_VALUE:
        raise ValueError(f"no model for {strategy} with {optimizer} in {precision}: see STAGE and BYTES_PER_VALUE")
    values = _values_per_rank(strategy, world_size, units, rank)
    per_value = BYTES_PER_VALUE[optimizer, precision]
    return {
        "parameters": values[0] * per_value[0],
        "gradients": values[1] * per_value[1],
        "optimizer_state": values[2] * per_value[2] + values[3] * STEP_COUNTER_BYTES[optimizer],
    }


def expected_gathered_bytes(
    strategy: str, world_size: int, units: Sequence[Sequence[Shape]], bytes_per_value: int = 4
) -> int:
    """The most whole (gathered, padded) parameters the zero3 and fsdp models hold at once; 0 for the others.

    ``units`` as from :func:`shard_unit_shapes`, the root's last. Both keep the root gathered from
    forward into backward (it is needed first), and with ``reshard_after_forward`` and no prefetch
    gather one other unit at a time; their ``-no-reshard`` models keep every unit gathered from its
    forward to its backward, so all at once at the end of forward. FSDP2 pads each parameter's dim 0,
    zero3 the unit's flat buffer."""
    n = world_size
    if strategy.startswith("fsdp"):
        gathered = [sum(_ceil(d0, n) * n * row for d0, row in map(_rows, unit)) for unit in units]
    elif strategy.startswith("zero3"):
        gathered = [_ceil(sum(math.prod(s) for s in unit), n) * n for unit in units]
    else:
        return 0
    if strategy.endswith("-no-reshard"):
        return sum(gathered) * bytes_per_value
    return (gathered[-1] + max(gathered[:-1], default=0)) * bytes_per_value


def expected_peak_bytes(state: Mapping[str, int], gathered: int, activations: int) -> int:
    """The peak the model predicts: the state, the gathered parameters (:func:`expected_gathered_bytes`)
    and the activations (measured: they depend on batch, sequence and model, not on the strategy)."""
    return state["parameters"] + state["gradients"] + state["optimizer_state"] + gathered + activations
