"""The memory calculator: bytes per rank, strategy by strategy, for a model known only by its size.

:func:`memory_per_rank` answers "does a model of P parameters train on N GPUs of M GiB each?" with
the ZeRO memory model of :mod:`distlab.predict.memory`: one row per strategy (torch DDP with its default
buckets and with ``gradient_as_bucket_view``, the course's ZeRO-1 and ZeRO-2, FSDP FULL_SHARD and
SHARD_GRAD_OP), each with its parameters, gradients, optimizer state, communication buffers, gathered
parameters, activations, total, whether it fits, and the bytes a rank sends in one step.
:func:`largest_fitting_parameters` turns the question round: the most parameters each strategy fits on
those GPUs. The book's calculator (``book/_static/distlab-calculator.js``) computes both in the reader's
browser, and ``tests/test_calculator.py`` checks that page and library give the same numbers.

The model is cut into ``shard_units`` equal units (a GPT's blocks), which FSDP gathers one at a time, or
into one unit of ``largest_unit`` values (a model's largest layer) and equal units for the rest
(:func:`model_units`); the units are flat, so every count is exact for the padding each unit's flat shard
adds, not for the per-parameter padding of a real model's shapes (:func:`distlab.predict.memory.shard_unit_shapes`
gives those). Activations are either typed in GiB or counted by Korthikanti et al.'s formula for a transformer
layer (:func:`layer_activation_bytes`), one layer per shard unit, with fused attention (no ``s*s`` term) unless
eager attention is chosen.

The precision is one setup, whole (:data:`PRECISIONS`), as torch has them: under torch's mixed precision DDP and
the course's ZeRO hold fp32 state and reduce in fp32, while FSDP2 gathers in its 16-bit ``param_dtype`` and
reduce-scatters in 16 bits (torch's default, where the page opens) or in fp32 (the course's policy). So each row
sends in its own dtypes, and the page can show torch's own pairing: FULL_SHARD sending three quarters of DDP's
bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distlab.predict.memory import BYTES_PER_VALUE, Shape, expected_gathered_bytes, expected_state_bytes

GIB = 2**30


@dataclass(frozen=True)
class Precision:
    """One precision setup, whole: what every row holds and what every collective sends, in bytes per value.

    ``state`` is the precision of :data:`distlab.predict.memory.BYTES_PER_VALUE` the state at rest is counted in
    (parameters, gradients, optimizer state). DDP and the course's ZeRO-1/2 send that state as it is: they
    reduce their gradients and ZeRO gathers its parameters in the dtypes they are held in. FSDP2 gathers its
    parameters in ``param_dtype`` (``fsdp_gather`` bytes, also what its gathered units hold) and reduce-scatters
    its gradients in ``reduce_dtype`` (``fsdp_reduce`` bytes). Activations are 16-bit unless ``state`` is fp32
    without autocast (:func:`activation_bytes`: ``activations`` names the precision it takes).

    ``fp32_gradients`` are bytes per value the optimizer steps of an fp32 copy of its gradients beside the
    16-bit ones (DeepSpeed's fp32 gradient partition; 0 where there is none), and ``zero3_16bit_gradients``
    False where under ZeRO-3 that fp32 partition is the only gradient a rank keeps (DeepSpeed's stage 3)."""

    label: str
    state: str
    fsdp_gather: int
    fsdp_reduce: int
    activations: str
    fp32_gradients: int = 0
    zero3_16bit_gradients: bool = True


PRECISIONS = {
    "torch": Precision(
        "torch's defaults: DDP and ZeRO under autocast (fp32 state and reduce); FSDP2 with a 16-bit param_dtype and "
        "reduce_dtype=None (16-bit reduce)",
        state="fp32",
        fsdp_gather=2,
        fsdp_reduce=2,
        activations="16-bit",
    ),
    "course": Precision(
        "torch's mixed precision with FSDP2's reduce_dtype=torch.float32 (this course's policy); DDP and ZeRO under "
        "autocast as above",
        state="fp32",
        fsdp_gather=2,
        fsdp_reduce=4,
        activations="16-bit",
    ),
    "fp32": Precision(
        "fp32 everywhere (no autocast, no MixedPrecisionPolicy)",
        state="fp32",
        fsdp_gather=4,
        fsdp_reduce=4,
        activations="fp32",
    ),
    "zero-paper": Precision(
        "the ZeRO paper's mixed precision: 16-bit parameters, gradients and collectives, fp32 master weights",
        state="mixed",
        fsdp_gather=2,
        fsdp_reduce=2,
        activations="16-bit",
    ),
    "deepspeed": Precision(
        "DeepSpeed's memory estimators (ZeRO-2 and ZeRO-3, no offload): the ZeRO paper's mixed precision and an fp32 "
        "gradient partition",
        state="mixed",
        fsdp_gather=2,
        fsdp_reduce=2,
        activations="16-bit",
        fp32_gradients=4,
        zero3_16bit_gradients=False,
    ),
}
"""The calculator's precision choices, each labelled with whose setup it is (the page opens on ``"torch"``).

torch's mixed precision is autocast over fp32 parameters for DDP and the course's ZeRO-1/2: they hold fp32
parameters, gradients (and DDP's bucket copy of them) and Adam's fp32 moments, 4 + 4 + 8 B, and reduce fp32
gradients. FSDP2 with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (or fp16) keeps fp32 shards at rest,
the same 4 + 4 + 8 B over N, gathers 16-bit parameters, and reduce-scatters in ``reduce_dtype``: torch's default
None reduces in ``param_dtype`` (``"torch"``: FULL_SHARD sends 2 + 2 x 2 = 6 B a value where DDP sends 2 x 4 = 8,
three quarters), the course's ``reduce_dtype=torch.float32`` in fp32 (``"course"``: 4 + 2 x 2 = 8, DDP's bytes);
the same pairs as :data:`distlab.predict.gpu_predictions.POLICIES`. ``"zero-paper"`` is the ZeRO paper's
accounting (Rajbhandari et al., 2020), which the chapters cite: 16-bit parameters and gradients, fp32
master weights and moments in the optimizer state (2 + 2 + 12 B), every collective in 16 bits. It is the paper's
alone: DeepSpeed keeps an fp32 gradient partition besides, and its own estimators count 13-22 % more
(``"deepspeed"``); torch's DDP and FSDP2 do not hold it either. A DDP row under it is that accounting applied to
DDP's buckets.

``"deepspeed"`` is what DeepSpeed's estimators count with no offload on one node (deepspeedai/DeepSpeed edaa722):
``estimate_zero2_model_states_mem_needs`` (``deepspeed/runtime/zero/stage_1_and_2.py:3081-3098``) gives
``2 * total_params + int(18 * total_params / total_gpus)``, "18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
8_optimizer_states_32bit", and ``estimate_zero3_model_states_mem_needs`` (``deepspeed/runtime/zero/stage3.py:
3744-3780``) ``largest_layer_memory + int(18 * total_params / total_gpus)`` with ``largest_layer_memory = 4 *
largest_layer_params``, where the 18 are the 16-bit parameter shard and the 16 that its optimizer offload moves
off the GPU (its offload branch keeps ``int(2 * total_params / total_gpus)``). So the ZeRO paper's 2 + 2 + 12 B and
an fp32 gradient partition of 4 B per value stepped, which under ZeRO-3 replaces the 16-bit gradient shard; the
ZeRO-3 row's largest unit gathered in 16 bits and its 16-bit gradient held whole are the estimator's 4 B x the
largest layer (give ``largest_unit``: DeepSpeed gathers module by module, so its largest layer is one module's
parameters). The estimators count model states only: the course's ZeRO-2 bucket and the activations come on top,
and the rows they have no estimator for (DDP, ZeRO-1, SHARD_GRAD_OP) take the same accounting."""
DEFAULT_PRECISION = "torch"
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD with momentum"}
STRATEGIES = {
    "DDP, torch's default buckets": "ddp",
    "DDP, gradient_as_bucket_view": "ddp",
    "ZeRO-1": "zero1",
    "ZeRO-2": "zero2",
    "FSDP FULL_SHARD (ZeRO-3)": "fsdp",
    "FSDP SHARD_GRAD_OP": "fsdp-no-reshard",
}
"""Row label -> the model of :data:`distlab.predict.memory.STAGE`. torch DDP's default
(``gradient_as_bucket_view=False``) keeps a second copy of every gradient in its buckets; with the flag the
gradients are views of the buckets. Both FSDP rows hold ZeRO-3's state at rest and one unit's whole gradient
while they reduce it; they differ in the gathered parameters at the peak."""
ROW_FIELDS = (
    "strategy", "parameters", "gradients", "optimizer_state", "buckets", "gathered", "activations", "total",
    "fits", "sent", "sent_vs_ddp",
)  # fmt: skip
DEFAULT_SHARD_UNITS = 32
"""gpt-6.7b's (and a 7B Llama's) 32 transformer blocks."""
ZERO_BUCKET_VALUES = 5 * 2**20 // 4
"""The course's ZeRO-2 reduces one 5 MiB bucket of fp32-sized gradient values at a time
(:data:`distlab.parallel.zero.ZERO_BUCKET_CAP_MB`): that bucket, whole, is what it holds beyond its slice."""
ACTIVATIONS_SOURCE = (
    "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models' (2022), "
    "https://arxiv.org/abs/2205.05198, section 4.1"
)
ATTENTION = {
    "fused": "fused attention (FlashAttention, torch's scaled_dot_product_attention): no s^2 term",
    "eager": "eager attention, which stores the scores, softmax and dropout mask: + 5*a*s^2*b bytes a layer",
}
"""How a layer's attention keeps what backward needs. A fused kernel never stores the ``a*s*s`` scores and recomputes
them in backward (the course's GPT calls ``F.scaled_dot_product_attention``, ``src/distlab/models.py``); the
Ultra-Scale Playbook's activation chart and Megatron-LM's ``compute_activation_memory_without_sp`` count 34*s*b*h
a layer, as ``"fused"`` does. ``"eager"`` is Korthikanti et al.'s full count."""
DEFAULT_ATTENTION = "fused"


@dataclass(frozen=True)
class Transformer:
    """What Korthikanti et al.'s activation count needs of one transformer layer and its batch.

    ``hidden`` is h, ``heads`` a, ``seq_len`` s and ``micro_batch`` b (sequences per GPU per forward);
    ``recompute`` is full activation checkpointing, which keeps only each layer's input; ``attention`` a key of
    :data:`ATTENTION`."""

    hidden: int
    heads: int
    seq_len: int
    micro_batch: int
    recompute: bool = False
    attention: str = DEFAULT_ATTENTION


def layer_activation_bytes(layer: Transformer) -> int:
    """Bytes one transformer layer keeps for backward in 16-bit training (``ACTIVATIONS_SOURCE``): ``34*s*b*h``
    with fused attention; with eager attention also its scores, softmax and dropout mask, ``5*a*s*s*b``
    (Korthikanti et al.'s ``s*b*h*(34 + 5*a*s/h)``); with full recomputation only the layer's 16-bit input,
    ``2*s*b*h``."""
    s, b, h, a = layer.seq_len, layer.micro_batch, layer.hidden, layer.heads
    if layer.recompute:
        return 2 * s * b * h
    return 34 * s * b * h + (5 * a * s * s * b if layer.attention == "eager" else 0)


def activation_bytes(layers: int, layer: Transformer, precision: str) -> int:
    """``layers`` layers' activations; doubled when ``precision`` is ``"fp32"`` (no autocast), where what the
    formula counts in 16 bits is 32 (the 1-byte dropout masks doubled too: an upper bound)."""
    return layers * layer_activation_bytes(layer) * (2 if precision == "fp32" else 1)


def equal_units(parameters: int, shard_units: int) -> list[list[Shape]]:
    """``parameters`` values in ``shard_units`` flat units as equal as integers allow (the first ones
    one value larger), and last an empty root: the ``units`` form of :mod:`distlab.predict.memory`."""
    size, larger = divmod(parameters, shard_units)
    return [[(size + 1,)] for _ in range(larger)] + [[(size,)] for _ in range(shard_units - larger)] + [[]]


def model_units(parameters: int, shard_units: int, largest_unit: int | None = None) -> list[list[Shape]]:
    """The calculator's model cut into units: :func:`equal_units`, or with ``largest_unit`` first one unit of that
    many values (a model's largest layer: its embedding, say) and the rest in ``shard_units - 1`` equal units. The
    unit is at most what leaves one value to each other unit, and with one unit it is the whole model."""
    if largest_unit is None or shard_units == 1:
        return equal_units(parameters, shard_units)
    first = min(largest_unit, parameters - (shard_units - 1))
    return [[(first,)], *equal_units(parameters - first, shard_units - 1)]


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Inputs:
    """What the calculator is asked about a machine and a run, whatever the model's size: ``gpus`` of
    ``memory_gib`` GiB each, the ``precision`` and ``optimizer``, the activations (``activations_gib``, or with
    ``transformer`` Korthikanti et al.'s count for ``shard_units`` layers) and the model cut into ``shard_units``
    units, equal or the first of ``largest_unit`` values (:func:`model_units`). ``precision`` is a key of
    :data:`PRECISIONS`: it sets what is held and in which dtypes each collective sends. ``trainable_fraction`` is
    the share of the values that train (1.0: all; below it a frozen base, whose values hold their weights only).
    Refused in one line if any is wrong (``shard_units`` against a model's size: :meth:`check`)."""

    gpus: int
    memory_gib: float
    precision: str = DEFAULT_PRECISION
    optimizer: str = "adam"
    activations_gib: float = 0.0
    shard_units: int = DEFAULT_SHARD_UNITS
    transformer: Transformer | None = None
    largest_unit: int | None = None
    trainable_fraction: float = 1.0

    def __post_init__(self):
        if not _whole(self.gpus) or self.gpus < 1:
            raise ValueError(f"gpus must be a whole number of at least 1, not {self.gpus!r}")
        if not self.memory_gib > 0:
            raise ValueError(f"memory_gib (memory per GPU, GiB) must be positive, not {self.memory_gib!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {self.optimizer!r}")
        if not self.activations_gib >= 0:
            raise ValueError(f"activations_gib must be 0 or more, not {self.activations_gib!r}")
        if not _whole(self.shard_units) or self.shard_units < 1:
            raise ValueError(f"shard_units must be a whole number of at least 1, not {self.shard_units!r}")
        if self.largest_unit is not None and (not _whole(self.largest_unit) or self.largest_unit < 1):
            raise ValueError(f"largest_unit must be None or a whole number of at least 1, not {self.largest_unit!r}")
        if not 0 < self.trainable_fraction <= 1:
            raise ValueError(f"trainable_fraction must be above 0 and at most 1, not {self.trainable_fraction!r}")
        if self.transformer is not None:
            for name in ("hidden", "heads", "seq_len", "micro_batch"):
                value = getattr(self.transformer, name)
                if not _whole(value) or value < 1:
                    raise ValueError(f"transformer {name} must be a whole number of at least 1, not {value!r}")
            if self.transformer.attention not in ATTENTION:
                choices = ", ".join(ATTENTION)
                raise ValueError(f"transformer attention must be one of {choices}, not {self.transformer.attention!r}")

    def check(self, parameters: int) -> None:
        """A model of ``parameters`` values, cut into ``shard_units`` units of at least one value each."""
        if not _whole(parameters) or parameters < 1:
            raise ValueError(f"parameters must be a whole number of at least 1, not {parameters!r}")
        if self.shard_units > parameters:
            raise ValueError(
                f"shard_units must be a whole number from 1 to parameters ({parameters}), not {self.shard_units!r}"
            )

    @property
    def activations(self) -> int:
        """Bytes of activations a rank holds at its peak, the same for every strategy."""
        if self.transformer is None:
            return int(self.activations_gib * GIB)
        return activation_bytes(self.shard_units, self.transformer, PRECISIONS[self.precision].activations)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def bytes_sent(
    label: str, units: list[list[Shape]], gpus: int, gather_bytes: int, reduce_bytes: int, trainable: float = 1.0
) -> int:
    """Bytes one rank sends in one step under ``label`` in NCCL's ring, the model in ``units`` of one flat shape
    each (:func:`row_units`): one flat buffer (DDP, ZeRO-1/2, padded to a multiple of N) or FSDP's units, each
    padded: an all-reduce sends 2(N-1) shards, a reduce-scatter or an all-gather N-1, each of ``reduce_bytes``
    (gradients) or ``gather_bytes`` (parameters) a value. ZeRO-1/2 reduce-scatter the gradients and all-gather the
    updated parameters; FULL_SHARD gathers every unit twice (forward, backward), SHARD_GRAD_OP once. In one dtype
    these are :func:`distlab.predict.traffic.expected_bytes_per_step`'s 2Ψ(N-1)/N and 3Ψ(N-1)/N
    (tests/test_calculator.py checks both).

    Over a frozen base only the ``trainable`` fraction has gradients: DDP reduces, and ZeRO-1/2 reduce and gather
    back, only those (:func:`_trainable`); FSDP still gathers every parameter and reduce-scatters the fraction."""
    n, strategy = gpus, STRATEGIES[label]
    shard = sum(_ceil(shape[0], n) for unit in units for shape in unit)
    if strategy == "ddp":
        return _trainable(2 * (n - 1) * shard * reduce_bytes, trainable)
    if strategy in ("zero1", "zero2"):
        return _trainable((n - 1) * shard * (reduce_bytes + gather_bytes), trainable)
    gathers = 2 if strategy == "fsdp" else 1
    return (n - 1) * shard * gathers * gather_bytes + _trainable((n - 1) * shard * reduce_bytes, trainable)


def _trainable(whole: int, fraction: float) -> int:
    """The bytes of ``whole`` that belong to the trainable ``fraction`` of the model, rounded down (the page's
    JavaScript rounds the same float product the same way)."""
    return int(whole * fraction)


def row_units(label: str, parameters: int, inputs: Inputs) -> list[list[Shape]]:
    """The units a row's model is cut into: FSDP's of :func:`model_units`; DDP and ZeRO-1/2 one flat tensor
    (the course's ZeRO cuts it into one bucket)."""
    if STRATEGIES[label].startswith("fsdp"):
        return model_units(parameters, inputs.shard_units, inputs.largest_unit)
    return [[(parameters,)]]


def _stepped_values(strategy: str, parameters: int, gpus: int, units: list[list[Shape]]) -> int:
    """Values rank 0's optimizer steps (SGD in fp32 keeps 4 B a value and no step counter)."""
    return expected_state_bytes(parameters, strategy, gpus, "sgd", "fp32", units)["optimizer_state"] // 4


def _row(label: str, parameters: int, inputs: Inputs) -> dict:
    """One strategy's row of :func:`memory_per_rank` (inputs already checked)."""
    strategy, gpus = STRATEGIES[label], inputs.gpus
    precision = PRECISIONS[inputs.precision]
    units = row_units(label, parameters, inputs)
    fsdp = strategy.startswith("fsdp")
    parameter_bytes, gradient_bytes = BYTES_PER_VALUE[inputs.optimizer, precision.state][:2]
    state = expected_state_bytes(parameters, strategy, gpus, inputs.optimizer, precision.state, units)
    if precision.fp32_gradients:  # DeepSpeed's fp32 gradient partition; under its ZeRO-3, the only gradient kept
        sixteen_bit = state["gradients"] if precision.zero3_16bit_gradients or not fsdp else 0
        state["gradients"] = _stepped_values(strategy, parameters, gpus, units) * precision.fp32_gradients + sixteen_bit
    gathered = expected_gathered_bytes(strategy, gpus, units, precision.fsdp_gather)
    if label == "DDP, torch's default buckets":
        buckets = parameters * gradient_bytes
    elif strategy == "zero2":
        buckets = _ceil(min(parameters, ZERO_BUCKET_VALUES), gpus) * gpus * gradient_bytes
    elif fsdp:  # the largest unit's whole gradient until its reduce-scatter, as costmodel.predict_peak_bytes
        # counts it; beside it, while torch casts it into a reduce_dtype unlike its param_dtype, its source
        # (FSDP2's foreach_reduce frees the unsharded gradients after the copy-in: _fsdp_collectives.py)
        cast_from = precision.fsdp_gather if precision.fsdp_reduce != precision.fsdp_gather else 0
        largest = max(_ceil(shape[0], gpus) * gpus for unit in units[:-1] for shape in unit)
        buckets = largest * (precision.fsdp_reduce + cast_from)
    else:
        buckets = 0
    fraction = inputs.trainable_fraction  # frozen values hold their weights only: no gradient, no optimizer state
    state["gradients"] = _trainable(state["gradients"], fraction)
    state["optimizer_state"] = _trainable(state["optimizer_state"], fraction)
    buckets = _trainable(buckets, fraction)
    activations = inputs.activations
    total = state["parameters"] + state["gradients"] + state["optimizer_state"] + buckets + gathered + activations
    if fsdp:  # FSDP2: param_dtype on the gathers, reduce_dtype on the reduce-scatters
        gather_bytes, reduce_bytes = precision.fsdp_gather, precision.fsdp_reduce
    else:  # DDP and ZeRO-1/2 send what they hold: its gradients, and ZeRO its updated parameters
        gather_bytes, reduce_bytes = parameter_bytes, gradient_bytes
    sent = bytes_sent(label, units, gpus, gather_bytes, reduce_bytes, fraction)
    return {"strategy": label, **state, "buckets": buckets, "gathered": gathered, "activations": activations} | {
        "total": total,
        "fits": total <= inputs.memory_gib * GIB,
        "sent": sent,
    }


def memory_per_rank(parameters: int, inputs: Inputs) -> list[dict]:
    """Bytes rank 0 holds at its peak under each strategy, whether they fit in ``inputs.memory_gib``, and what it
    sends.

    One dict per strategy of :data:`STRATEGIES`, with the keys of :data:`ROW_FIELDS`: the state of
    :func:`distlab.predict.memory.expected_state_bytes` (with DeepSpeed's fp32 gradient partition under
    ``"deepspeed"``); ``buckets``, the whole gradients held to be reduced: torch DDP's second copy of the gradients
    (its default), the one bucket the course's ZeRO-2 reduces at a time, or FSDP's largest unit's gradient before
    its reduce-scatter in ``reduce_dtype`` (and its ``param_dtype`` source where the two differ); the whole
    parameters FSDP gathers (one unit at a time with FULL_SHARD, all of them with SHARD_GRAD_OP:
    :func:`distlab.predict.memory.expected_gathered_bytes`) in FSDP2's ``param_dtype``; the activations, the same
    for every strategy (:attr:`Inputs.activations`); their ``total``; ``fits = total <= memory_gib`` GiB; and
    ``sent``, the bytes of :func:`bytes_sent` in the dtypes of the :data:`PRECISIONS` chosen, and ``sent_vs_ddp``,
    those over DDP's (None on one GPU, where nothing is sent)."""
    inputs.check(parameters)
    rows = [_row(label, parameters, inputs) for label in STRATEGIES]
    ddp_sent = rows[0]["sent"]
    return [row | {"sent_vs_ddp": row["sent"] / ddp_sent if ddp_sent else None} for row in rows]


LARGEST_SEARCHED = 10**14
"""The largest model :func:`largest_fitting_parameters` tries (100 trillion parameters): every byte count
below it stays under 2**53, where the page's JavaScript numbers are still exact integers."""


def largest_fitting_parameters(inputs: Inputs) -> dict[str, int]:
    """The most parameters each strategy fits in ``inputs.memory_gib`` per GPU (rows as :func:`memory_per_rank`;
    with a ``transformer`` the activations stay those of its layer, whatever the parameter count).

    A bisection over the parameter count, whose totals never fall as it grows: 0 where even a model of
    ``shard_units`` parameters does not fit, :data:`LARGEST_SEARCHED` where that one still fits."""
    shard_units = inputs.shard_units
    largest = {}
    for label in STRATEGIES:

        def fits(parameters: int, label: str = label) -> bool:
            return _row(label, parameters, inputs)["fits"]

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


def transformer_from(inputs: dict | None) -> Transformer | None:
    """The page's ``transformer`` object (``{"hidden": ..., ...}`` or null) as a :class:`Transformer`."""
    return None if inputs is None else Transformer(**inputs)


def transformer_inputs(layer: Transformer | None) -> dict | None:
    """The inverse of :func:`transformer_from`: what the page's JavaScript takes."""
    return None if layer is None else asdict(layer)
