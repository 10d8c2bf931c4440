"""What one optimizer step costs each rank, by strategy: its time and its peak memory, predicted.

    step time = compute + optimizer step + communication - overlap

* compute: the FLOPs of forward and backward (:func:`training_flops`) over a throughput, plus a fixed cost per
  step, fitted to steps timed with no communication at all (:class:`ComputeModel`), or for a GPU its cited peak
  times a cited achieved fraction; the optimizer step: the values this rank steps times a cost per value;
* communication: every collective the strategy issues (:func:`collective_calls`), each costed by
  the fit of that collective on that backend (:class:`CollectiveModel`: ``alpha + bytes * beta``;
  on GPUs ``steps * alpha + bytes sent / bus bandwidth``). A backend's own algorithm is in its fit:
  gloo's reduce-scatter runs a whole all-reduce underneath, NCCL's is a ring reduce-scatter;
* overlap: none where the collectives share the compute's cores (gloo on a CPU); on GPUs those of all but the
  last bucket or unit may hide behind backward (an upper bound);
* what a strategy costs around the same arithmetic, measured on one rank where nothing is sent: point by
  point (:func:`strategy_overheads`), or as a law, a cost per collective call and per parameter value
  (:class:`StrategyCosts`), for presets and sizes the one-rank run did not measure; checked on points left out of
  every fit (:func:`leave_one_out`).

    peak memory = parameters + gradients + optimizer state (:func:`distlab.predict.memory.expected_state_bytes`)
                  + gathered whole parameters + buffers a strategy keeps + activations

with activations measured once per model and batch, and the parts alive at the peak chosen by where it falls.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..comm.implementations import default_implementation
from ..models import GPT_PRESETS
from .memory import BYTES_PER_VALUE, Shape, expected_gathered_bytes, expected_state_bytes, gradient_buckets

DDP_FIRST_BUCKET_BYTES = 1 << 20  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)
BUCKET_BYTES = 25 << 20  # torch DDP's and the course's default bucket cap
# bytes each rank sends per byte of the whole tensor, for a ring algorithm (nccl-tests' bus factor)
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
RING_FACTOR["reduce_scatter"] = RING_FACTOR["all_gather"]
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1}


def matmul_flops(model: str, tokens: int) -> float:
    """Forward + backward FLOPs of a GPT preset's weight matrix products on ``tokens`` tokens: 2 per weight
    per token (the head's too), 3x for forward + backward."""
    cfg = GPT_PRESETS[model]
    return 3 * 2 * (cfg.n_layer * 12 * cfg.d_model**2 + cfg.d_model * cfg.vocab_size) * tokens


def attention_flops(model: str, tokens: int, seq_len: int) -> float:
    """Forward + backward FLOPs of attention's scores and weighted sum: 2 x 2 T d per token per layer
    (computed whole under the causal mask), 3.5x for forward + backward, as torch's FLOP formulas for
    fused attention count it (the backward recomputes the scores)."""
    cfg = GPT_PRESETS[model]
    return 3.5 * 4 * cfg.n_layer * seq_len * cfg.d_model * tokens


def training_flops(model: str, tokens: int, seq_len: int) -> float:
    """Forward + backward FLOPs of one step of a GPT preset on ``tokens`` tokens, as torch's FLOP counter
    counts them: the matrix products and attention."""
    return matmul_flops(model, tokens) + attention_flops(model, tokens, seq_len)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` weighted by 1/y (relative errors), with ``a, b >= 0``."""
    w = [1 / y for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    a, b = ((sy * sxx - sx * sxy) / det, (sw * sxy - sx * sy) / det) if det > 0 else (0.0, sy / max(sx, 1e-30))
    if a < 0:  # through the origin
        a, b = 0.0, sxy / sxx
    if b < 0:
        a, b = sy / sw, 0.0
    return a, b


@dataclass(frozen=True)
class ComputeModel:
    """Forward + backward: ``overhead_s + flops / flops_per_s``; the optimizer step:
    ``optimizer_overhead_s + values * optimizer_s_per_value``. Fitted per world size."""

    overhead_s: float
    flops_per_s: float
    optimizer_overhead_s: float
    optimizer_s_per_value: float

    @classmethod
    def fit(cls, presets: Sequence[dict]) -> ComputeModel:
        """From a sweep's ``local`` calibration (the same model trained with no communication)."""
        presets = calibrated(presets)
        flops = [training_flops(p["model"], p["tokens_per_rank"], p["seq_len"]) for p in presets]
        overhead, per_flop = _line(flops, [p["local"]["compute_s"] for p in presets])
        opt_overhead, per_value = _line(
            [p["parameters"] for p in presets], [p["local"]["optimizer_s"] for p in presets]
        )
        return cls(overhead, 1 / per_flop if per_flop > 0 else math.inf, opt_overhead, per_value)

    def compute_s(self, flops: float) -> float:
        return self.overhead_s + flops / self.flops_per_s

    def optimizer_s(self, values: float) -> float:
        return self.optimizer_overhead_s + values * self.optimizer_s_per_value


@dataclass(frozen=True)
class CollectiveModel:
    """One collective on one backend: ``alpha_s + bytes * beta_s_per_byte``, with ``bytes`` the whole
    tensor (an all-gather's output, a reduce-scatter's input)."""

    collective: str
    impl: str
    alpha_s: float
    beta_s_per_byte: float

    def time_s(self, size: float) -> float:
        return self.alpha_s + size * self.beta_s_per_byte

    @classmethod
    def fit(cls, rows: Sequence[dict], collective: str, impl: str) -> CollectiveModel:
        points = [(r["bytes"], r["time_s"]) for r in rows if r["collective"] == collective and r["impl"] == impl]
        alpha, beta = _line([p[0] for p in points], [p[1] for p in points])
        return cls(collective, impl, alpha, beta)

    @classmethod
    def nccl(cls, collective: str, world_size: int, bus_bytes_per_s: float, step_s: float, base_s: float):
        """A GPU ring from cited figures: ``base + steps * latency + (bytes sent per rank) / bus bandwidth``."""
        n = world_size
        return cls(
            collective,
            "nccl",
            base_s + RING_STEPS[collective](n) * step_s,
            RING_FACTOR[collective](n) / bus_bytes_per_s,
        )


def fit_collectives(rows: Sequence[dict]) -> dict[tuple[str, str], CollectiveModel]:
    """(collective, impl) -> its fit, for every pair a sweep timed."""
    pairs = sorted({(r["collective"], r["impl"]) for r in rows})
    return {pair: CollectiveModel.fit(rows, *pair) for pair in pairs}


def reduction_cost(fits: dict[tuple[str, str], CollectiveModel], impl: str, n: int) -> float | None:
    """gamma: seconds to reduce one byte, apart from the link's beta, where two collectives move the same bytes and
    one reduces: a ring's reduce-scatter and all-gather; torch's all-reduce on gloo (twice an all-gather's bytes)."""
    f = (n - 1) / n
    gather = fits.get(("all_gather", impl))
    reducing = fits.get(("reduce_scatter", impl)) if impl == "ring" else fits.get(("all_reduce", impl))
    if gather is None or reducing is None:
        return None
    sent = 1 if impl == "ring" else 2  # all-gathers' worth of bytes the reducing collective sends
    return (reducing.beta_s_per_byte - sent * gather.beta_s_per_byte) / f


def _flat_bytes(shapes: Sequence[Shape], n: int, per_parameter_padding: bool, bytes_per_value: int = 4) -> int:
    if per_parameter_padding:  # FSDP2: each parameter's dim 0 padded to a multiple of n
        return sum(-(-s[0] // n) * n * math.prod(s[1:]) if len(s) else n for s in shapes) * bytes_per_value
    return -(-sum(math.prod(s) for s in shapes) // n) * n * bytes_per_value


def _buckets(shapes: Sequence[Shape], first: int, cap: int, bytes_per_value: int = 4) -> list[int]:
    """torch DDP's bucket sizes (``compute_bucket_assignment_by_size``): filled in reverse registration order, each
    closed once it reaches its limit, ``first`` for the first bucket and ``cap`` after it."""
    buckets, current, limit = [], 0, first
    for shape in reversed(shapes):
        current += math.prod(shape) * bytes_per_value
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    return buckets + ([current] if current else [])


def collective_calls(
    variant: str,
    units: Sequence[Sequence[Shape]],
    n: int,
    backend: str,
    reduce_bytes: int = 4,
    order: Sequence[Shape] | None = None,
    gather_bytes: int | None = None,
) -> list[tuple[str, str, int]]:
    """(collective, implementation, bytes) of every collective one step of ``variant`` issues on ``n``
    ranks: ``units`` are the trainable parameters' shapes by shard unit, the root's last; ``order`` the
    same shapes in the order the model registers them (:func:`distlab.predict.memory.parameter_shapes`),
    which sets the buckets of DDP (torch's, with its default ``bucket_cap_mb``: a first bucket of 1 MiB,
    then 25 MiB) and of the course's ZeRO-1/2 (without it, the units' order). The course's ZeRO stages
    run what their strategies run by default (:func:`distlab.comm.implementations.default_implementation`,
    the rule's one home). Each collective carries its own dtype:
    ``reduce_bytes`` per gradient value (all-reduce, reduce-scatter), ``gather_bytes`` per parameter value
    (all-gather; by default the same)."""
    if n == 1:
        return []
    r, g = reduce_bytes, gather_bytes or reduce_bytes
    shapes = list(order) if order is not None else [s for unit in units for s in unit]
    if variant == "ddp":
        return [("all_reduce", "torch", b) for b in _buckets(shapes, DDP_FIRST_BUCKET_BYTES, BUCKET_BYTES, r)]
    if variant in ("zero1", "zero2"):  # one reduce-scatter per bucket, then one all-gather per bucket
        impl = default_implementation(backend)
        buckets = gradient_buckets(shapes)
        return [("reduce_scatter", impl, _flat_bytes(bucket, n, False, r)) for bucket in buckets] + [
            ("all_gather", impl, _flat_bytes(bucket, n, False, g)) for bucket in buckets
        ]
    if variant in ("zero3", "zero3-no-reshard", "fsdp", "fsdp-no-reshard"):
        fsdp = variant.startswith("fsdp")
        impl = "torch" if fsdp else default_implementation(backend)  # FSDP2 runs torch's on every backend
        gathers = 1 if variant.endswith("no-reshard") else 2
        calls = []
        for index, unit in enumerate(u for u in units if u):
            gathered, reduced = _flat_bytes(unit, n, fsdp, g), _flat_bytes(unit, n, fsdp, r)
            root = index == len([u for u in units if u]) - 1 and bool(units[-1])
            calls += [("all_gather", impl, gathered)] * (1 if root else gathers) + [("reduce_scatter", impl, reduced)]
        return calls
    raise ValueError(f"no collectives known for {variant!r}")


def stepped_values(variant: str, parameters: int, n: int, units: Sequence[Sequence[Shape]]) -> int:
    """Values this rank's optimizer steps: every one when replicated, its shard when sharded."""
    state = expected_state_bytes(parameters, variant, n, "adam", "fp32", units)
    return state["optimizer_state"] // BYTES_PER_VALUE["adam", "fp32"][2]


def predict_step_s(
    variant: str,
    model: str,
    tokens: int,
    seq_len: int,
    n: int,
    units: Sequence[Sequence[Shape]],
    compute: ComputeModel,
    collectives: dict[tuple[str, str], CollectiveModel],
    backend: str = "gloo",
    overlap: float = 0.0,
    order: Sequence[Shape] | None = None,
    overhead_s: float = 0.0,
) -> dict[str, float]:
    """The parts of one step's time on one rank. ``overlap``: the share of the communication of all
    but the last collective that hides behind backward (0 on a CPU: the same cores do both); ``order``
    as for :func:`collective_calls`; ``overhead_s``: what the strategy costs around the same arithmetic
    with nothing to communicate (:func:`strategy_overheads`)."""
    parameters = sum(math.prod(s) for unit in units for s in unit)
    calls = collective_calls(variant, units, n, backend, order=order)
    times = [collectives[collective, impl].time_s(size) for collective, impl, size in calls]
    flops_s = compute.compute_s(training_flops(model, tokens, seq_len))
    hidden = min(overlap * sum(times[:-1]), 2 / 3 * flops_s)  # backward is about 2/3 of the FLOPs
    parts = {
        "compute_s": flops_s,
        "optimizer_s": compute.optimizer_s(stepped_values(variant, parameters, n, units)),
        "communication_s": sum(times) - hidden,
        "overhead_s": overhead_s,
    }
    return parts | {"total_s": sum(parts.values()), "calls": len(calls)}


def predict_peak_bytes(
    variant: str,
    n: int,
    units: Sequence[Sequence[Shape]],
    activations: int,
    backward_extra: int = 0,
    precision: str = "fp32",
) -> dict[str, int]:
    """The most one rank holds during a step with Adam: the largest of the moments below, on top of
    the state it keeps all along (its parameters and optimizer state, torch DDP's buckets, ZeRO-1's flat
    gradients).

    * start of backward: every activation (``activations``, their high-water mark, measured once for
      the model and batch), the units still gathered, and what a sharding strategy is reducing: ZeRO-2's
      one bucket of whole gradients, or ZeRO-3's and FSDP2's one unit's gradient or all-gather buffer
      (``in_flight``; an empty root, whose unit holds nothing, is still the root: the last unit of ``units``);
    * during backward, where gradients pile up whole beside DDP's buckets: ``backward_extra``, the
      gradients and activations alive together at that moment, measured once with no communication at all
      (ZeRO-1 copies each gradient into its kept flat buffer as it arrives: nothing piles up);
    * the optimizer step: the gradients it steps. (torch's Adam allocates nothing of the model's size here.)"""
    parameters = sum(math.prod(s) for unit in units for s in unit)
    strategy = variant.removesuffix("-no-reshard")
    value_bytes = BYTES_PER_VALUE["adam", precision][1]
    state = expected_state_bytes(parameters, variant, n, "adam", precision, units)
    whole_gradients = parameters * value_bytes
    # torch DDP's buckets (allocated on one rank too), beside the gradients; ZeRO-1's flat gradients, instead
    buckets = whole_gradients if variant == "ddp" else state["gradients"] if variant == "zero1" else 0
    gathered = expected_gathered_bytes(variant, n, units, value_bytes)  # the root last, even empty
    if strategy == "zero2":
        bucket = max(_flat_bytes(b, n, False, value_bytes) for b in gradient_buckets([s for u in units for s in u]))
        in_flight = bucket  # allocated at its first gradient; its slice comes once activations have gone
    elif strategy in ("zero3", "fsdp"):  # an empty unit's is 0
        in_flight = max((_flat_bytes(u, n, strategy == "fsdp", value_bytes) for u in units[:-1]), default=0)
    else:
        in_flight = 0
    kept = state["parameters"] + state["optimizer_state"] + buckets
    moments = {
        "start_of_backward": kept + gathered + activations + in_flight,
        "backward": kept + backward_extra if strategy == "ddp" else 0,
        "optimizer_step": kept + (state["gradients"] if strategy != "zero1" else 0),
    }
    parts = {"gathered": gathered, "buckets": buckets, "in_flight": in_flight}
    return {"peak": max(moments.values()), **moments, **state, **parts}


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def error_summary(errors: Sequence[float]) -> dict[str, float]:
    magnitudes = [abs(e) for e in errors]
    return {"points": len(errors), "median_abs": statistics.median(magnitudes), "max_abs": max(magnitudes)}


def calibrated(presets: Sequence[dict]) -> list[dict]:
    """The points of a sweep that ran the calibration copy (``local``): every point but a GPU sweep's FSDP2 point,
    whose model is too large for one beside a variant. The fits and :func:`evaluate` read these alone."""
    return [preset for preset in presets if "local" in preset]


def strategy_overheads(one_rank: dict) -> dict[tuple[str, str], float]:
    """What each strategy costs around the bare model's arithmetic, from a one-rank sweep, where nothing
    communicates: ``(model, variant) -> `` its measured step less the same model's step with no wrapper at all
    (``local``), at least 0. That is what the FLOP and byte counts leave out: hooks, copies into and out of
    flat buffers, DTensor dispatch, Python around each unit and call. Measured in a run of its own, on one
    rank, and added at N ranks: it never sees the step it predicts."""
    if one_rank["environment"]["world_size"] != 1:
        raise ValueError("strategy overheads come from a one-rank sweep, where nothing communicates")
    return {
        (preset["model"], row["variant"]): max(0.0, row["time_s"] - preset["local"]["time_s"])
        for preset in calibrated(one_rank["metrics"]["presets"])
        for row in preset["variants"]
    }


def strategy_calls(variant: str, units: Sequence[Sequence[Shape]], order: Sequence[Shape] | None = None) -> int:
    """The collective calls one step of ``variant`` makes, counted as on two or more ranks: on one rank a
    strategy runs the same hooks around the same calls with nothing to send (:func:`collective_calls` lists
    none there: it costs what is sent)."""
    return len(collective_calls(variant, units, 2, "nccl", order=order))


def _nonnegative_fit(x1: Sequence[float], x2: Sequence[float], ys: Sequence[float], ws: Sequence[float]):
    """Least-squares ``y = a x1 + b x2`` weighted by ``ws``, with ``a, b >= 0`` (the best of the unconstrained
    solution, if it is non-negative, and of each rate alone)."""

    def residual(a: float, b: float) -> float:
        return sum(w * (y - a * u - b * v) ** 2 for u, v, y, w in zip(x1, x2, ys, ws))

    s11 = sum(w * u * u for u, w in zip(x1, ws))
    s22 = sum(w * v * v for v, w in zip(x2, ws))
    s12 = sum(w * u * v for u, v, w in zip(x1, x2, ws))
    s1y = sum(w * u * y for u, y, w in zip(x1, ys, ws))
    s2y = sum(w * v * y for v, y, w in zip(x2, ys, ws))
    candidates = [(0.0, 0.0), (max(0.0, s1y / s11) if s11 else 0.0, 0.0), (0.0, max(0.0, s2y / s22) if s22 else 0.0)]
    det = s11 * s22 - s12 * s12
    if det > 0:
        a, b = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    return min(candidates, key=lambda ab: residual(*ab))


def _shapes(preset: dict) -> tuple[list[Shape], list[Shape] | None]:
    units = [[tuple(s) for s in unit] for unit in preset["units"]]
    order = [tuple(s) for s in preset["parameter_shapes"]] if "parameter_shapes" in preset else None
    return units, order


@dataclass(frozen=True)
class StrategyCosts:
    """What each strategy costs around the bare model's arithmetic, as a law: a cost per collective call (hooks,
    Python and dispatch around each unit or bucket, the launches of its copies and of the call, however little it
    sends) and one per parameter value (copies into and out of flat buffers, casts). Neither grows with a step's
    tokens. :func:`strategy_overheads` measures the cost point by point; this fits two rates per strategy over a
    one-rank sweep's presets (:meth:`fit`), to predict presets and sizes it did not run (:func:`leave_one_out` checks
    that). On the one H200 run (one rank, nothing sent, 8 x 256 tokens, one host) the per-call rate separates the
    strategies (FSDP2 about a millisecond per call there), on a CPU the per-value rate. Both are host costs: on a
    GPU they add to a step only where the GPU waits for the host."""

    per_call_s: Mapping[str, float]
    per_value_s: Mapping[str, float]

    def overhead_s(self, variant: str, calls: int, values: int) -> float:
        return self.per_call_s.get(variant, 0.0) * calls + self.per_value_s.get(variant, 0.0) * values

    def for_preset(self, variant: str, preset: dict) -> float:
        """The cost for one preset of a sweep record (its units, registration order and parameter count)."""
        units, order = _shapes(preset)
        return self.overhead_s(variant, strategy_calls(variant, units, order), preset["parameters"])

    @classmethod
    def fit(cls, one_rank: dict) -> StrategyCosts:
        """Per strategy, ``per_call * calls + per_value * values`` (both at least 0) fitted to its one-rank steps less
        the bare model's, over every point of the run, each weighted by one over its measured step squared: the
        relative errors of the steps it predicts, where a strategy that costs nothing weighs as much as any other."""
        if one_rank["environment"]["world_size"] != 1:
            raise ValueError("strategy costs come from a one-rank sweep, where nothing communicates")
        points: dict[str, list[tuple[int, int, float, float]]] = {}
        for preset in calibrated(one_rank["metrics"]["presets"]):
            units, order = _shapes(preset)
            for row in preset["variants"]:
                extra = row["time_s"] - preset["local"]["time_s"]
                calls = strategy_calls(row["variant"], units, order)
                points.setdefault(row["variant"], []).append((calls, preset["parameters"], extra, row["time_s"]))
        per_call, per_value = {}, {}
        for variant, rows in points.items():
            per_call[variant], per_value[variant] = _nonnegative_fit(
                [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [1 / r[3] ** 2 for r in rows]
            )
        return cls(per_call, per_value)


def evaluate(
    result: dict,
    overheads: dict[tuple[str, str], float] | StrategyCosts | None = None,
    compute: ComputeModel | None = None,
) -> list[dict]:
    """Every calibrated point (:func:`calibrated`) of one sweep result (one world size): the model's step time and
    peak memory next to the measured ones, with inputs from the same run's calibration (the steps with no
    communication, the collectives' timings, the activations' high-water mark), never the strategies' own steps.
    ``overheads`` adds each strategy's cost around the arithmetic, a table (:func:`strategy_overheads`) or a law
    (:class:`StrategyCosts`); ``compute`` replaces the fit over every point of the run (:func:`leave_one_out`)."""
    metrics, n = result["metrics"], result["environment"]["world_size"]
    overheads = overheads or {}
    backend = result["environment"].get("backend", "gloo")
    compute = compute or ComputeModel.fit(metrics["presets"])
    collectives = fit_collectives(metrics["collectives"])
    rows = []
    for preset in calibrated(metrics["presets"]):
        units, order = _shapes(preset)
        local = max(preset["local"]["memory"]["ranks"], key=lambda rank: rank["peak"])
        activations = local["activations_peak"]
        backward_extra = local["peak"] - local["parameters"] - local["optimizer_state"]
        for row in preset["variants"]:
            key = (preset["model"], row["variant"])
            law = isinstance(overheads, StrategyCosts)
            extra = overheads.for_preset(row["variant"], preset) if law else overheads.get(key, 0.0)
            step = predict_step_s(
                row["variant"], preset["model"], preset["tokens_per_rank"], preset["seq_len"], n, units, compute,
                collectives, backend, order=order, overhead_s=extra,
            )  # fmt: skip
            memory = predict_peak_bytes(row["variant"], n, units, activations, backward_extra)
            measured_peak = max(rank["peak"] for rank in row["memory"]["ranks"])
            rows.append({
                "model": preset["model"], "tokens_per_rank": preset["tokens_per_rank"], "world_size": n,
                "point": preset.get("point", ""), "variant": row["variant"], "measured_s": row["time_s"],
                "predicted_s": step["total_s"],
                "time_error": relative_error(step["total_s"], row["time_s"]), "measured_peak": measured_peak,
                "predicted_peak": memory["peak"], "peak_error": relative_error(memory["peak"], measured_peak),
                "parts_s": {k: v for k, v in step.items() if k.endswith("_s") and k != "total_s"},
            })  # fmt: skip
    return rows


def one_rank_calibration(result: dict) -> list[dict]:
    """Every point of a one-rank sweep against the model calibrated on that same run: ``before`` compute + optimizer
    alone (the same step for every strategy: nothing is sent), ``after`` with :class:`StrategyCosts` fitted to the
    run. Both are fits, every point in its own: they say how well the rates bend, not how well the model predicts
    (:func:`leave_one_out`)."""
    law = StrategyCosts.fit(result)
    rows = []
    for before, after in zip(evaluate(result), evaluate(result, law), strict=True):
        rows.append(
            {k: before[k] for k in ("model", "tokens_per_rank", "point", "variant", "measured_s")}
            | {"before_s": before["predicted_s"], "before_error": before["time_error"]}
            | {"after_s": after["predicted_s"], "after_error": after["time_error"]}
            | {"per_call_s": law.per_call_s[after["variant"]], "per_value_s": law.per_value_s[after["variant"]]}
        )
    return rows


def point_key(preset: dict) -> tuple[str, int]:
    """A sweep point: its preset and its tokens per rank (a GPU sweep runs a preset at two sizes)."""
    return preset["model"], preset["tokens_per_rank"]


def _points(result: dict, keep) -> dict:
    """The sweep result with only the points (:func:`point_key`) ``keep`` is true of."""
    presets = [preset for preset in result["metrics"]["presets"] if keep(point_key(preset))]
    return result | {"metrics": result["metrics"] | {"presets": presets}}


LEAVE_ONE_OUT_MINIMUM = 3
"""Points a run needs to leave one out: each fit has two unknowns (a fixed cost and a rate), which two points fix."""


def leave_one_out(result: dict, one_rank: dict | None = None) -> list[dict]:
    """The model's test: every calibrated point of one sweep result predicted by the model fitted **without it**:
    :class:`ComputeModel` on the other points' bare steps, :class:`StrategyCosts` on the other points of ``one_rank``
    (``result`` itself on one rank; no law on several ranks without one), so neither a point's own steps nor its
    preset's one-rank steps predict it. The collectives' fits stay: timed apart, they hold no step. Rows as
    :func:`evaluate`'s, with ``left_out``; none under ``LEAVE_ONE_OUT_MINIMUM`` points. A fit evaluated on its own
    points (:func:`one_rank_calibration`) says only how well it bends."""
    one_rank = result if one_rank is None and result["environment"]["world_size"] == 1 else one_rank
    points = [point_key(preset) for preset in calibrated(result["metrics"]["presets"])]
    if len(points) < LEAVE_ONE_OUT_MINIMUM:
        return []
    rows = []
    for key in points:
        compute = ComputeModel.fit(_points(result, lambda k: k != key)["metrics"]["presets"])
        law = None if one_rank is None else StrategyCosts.fit(_points(one_rank, lambda k: k != key))
        rows += [row | {"left_out": True} for row in evaluate(_points(result, lambda k: k == key), law, compute)]
    return rows
