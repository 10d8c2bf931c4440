"""The cost model (:mod:`distlab.predict.costmodel`) run on GPUs nobody here has: every input cited
(:mod:`distlab.predict.gpu_specs`) or assumed and said so, every output a prediction.

Per optimizer step of torch DDP and FSDP2 (both reshard settings) on a GPT preset in mixed precision (DDP under
autocast, FSDP2 with a 16-bit ``param_dtype``):

* compute: the step's FLOPs over the GPU's dense 16-bit peak times a cited achieved fraction (MFU);
* optimizer: Adam on this rank's values, 28 bytes read and written per value (an fp32 parameter or master
  weight read and written, two fp32 moments read and written, the gradient read) at the GPU's memory
  bandwidth (assumed: the step is memory-bound);
* communication: NCCL's ring, ``steps * latency + bytes sent / bus bandwidth``, each collective in its own
  dtype (``POLICIES``): DDP under autocast keeps fp32 parameters, so it all-reduces fp32 gradients unless a
  compression hook halves them; FSDP2 all-gathers in ``param_dtype`` and reduce-scatters in
  ``reduce_dtype``, which is fp32 in the course's policy (the default here, what the course's GPU sweep runs)
  and the 16-bit ``param_dtype`` itself in torch's default (``reduce_dtype=None``). Given as a range, from
  nothing hidden to as much hidden as can be (DDP: every bucket but the last behind backward; FSDP: every
  collective but the first all-gather and the last reduce-scatter behind compute);
* memory: what each strategy keeps (DDP under autocast: fp32 parameters, gradients and buckets beside
  Adam's moments, 20 bytes per parameter; FSDP2: fp32 shards, 16 bytes per parameter over N, and its
  gathered units in ``param_dtype``), plus activations by Korthikanti et al.'s count for a transformer
  layer (``ACTIVATIONS``) and the logits.

And the size a GPU sweep needs for its step to be compute-dominated (:func:`sweep_batch`): tokens per rank
whose compute, at the GPU's cited peak times its MFU, is several times the step's fixed costs
(:func:`fixed_s`: a step's launches, the optimizer's, the strategy's per call and per value, the collectives'
latencies), within the GPU's memory. Those fixed costs are host-side and were *measured*, on the course's one
H200 run (``HOST_RUN``), not cited: they stand in for every GPU until a run measures its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from ..models import GPT_PRESETS, build_model
from .costmodel import (
    RING_FACTOR,
    CollectiveModel,
    StrategyCosts,
    collective_calls,
    predict_peak_bytes,
    stepped_values,
    strategy_calls,
    training_flops,
)
from .gpu_specs import A100_40GB, GPU, KAGGLE_T4X2, SYSTEMS, System
from .memory import parameter_shapes, shard_unit_shapes

ACTIVATIONS = (
    "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', "
    "https://arxiv.org/abs/2205.05198, section 4.1: a layer stores s*b*h*(34 + 5*a*s/h) bytes in 16-bit training"
)
ADAM_BYTES_PER_VALUE = 28
POLICIES = {
    "course": {"ddp": (4, None), "fsdp": (4, 2), "fsdp-no-reshard": (4, 2)},
    "torch": {"ddp": (4, None), "fsdp": (2, 2), "fsdp-no-reshard": (2, 2)},
}
"""Bytes per value of (gradient reductions, parameter gathers) in mixed precision, by whose settings. DDP under
autocast all-reduces its fp32 gradients in both (2 only with ``fp16_compress_hook``: pass ``reduce_bytes=2``).
FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16 or fp16)`` gathers 16-bit parameters in both; it reduce-scatters
fp32 gradients under the course's policy (``reduce_dtype=torch.float32``, ``--fsdp-reduce-dtype fp32``, the default
of :class:`distlab.config.ParallelConfig`, which the course's GPU sweep runs), and 16-bit ones under torch's own
default (``reduce_dtype=None``: "the reduction uses the compute dtype", ``_fsdp_collectives.py``: ``reduce_dtype or
grad_dtype``)."""
POLICY_NAMES = {
    "course": "the course's policy (FSDP2 reduce-scatters in fp32)",
    "torch": "torch's defaults (FSDP2 reduce-scatters in its 16-bit param_dtype)",
}
"""How a page names each of ``POLICIES``."""
WIRE = POLICIES["course"]
"""The wire the predictions assume unless told otherwise: the course's policy, which its GPU runs measure."""
STATE = {"ddp": "fp32", "fsdp": "mixed", "fsdp-no-reshard": "mixed"}
"""What :func:`distlab.predict.costmodel.predict_peak_bytes` counts for each under autocast: DDP's fp32
parameters and gradients; FSDP2's fp32 shards hold as many bytes as "mixed" (16 per value over N) and its
gathered units are 16-bit. The same under either policy: FSDP2's sharded gradients are fp32 whatever dtype
they were reduced in."""
VARIANTS = ("ddp", "fsdp", "fsdp-no-reshard")


@cache
def units_of(model: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """A preset's trainable shapes by shard unit (built on meta: nothing allocated)."""
    return tuple(tuple(tuple(s) for s in unit) for unit in shard_unit_shapes(build_model(model, device="meta")))


@cache
def order_of(model: str) -> tuple[tuple[int, ...], ...]:
    """A preset's trainable shapes in the order it registers them (DDP's buckets are cut in it)."""
    return tuple(tuple(s) for s in parameter_shapes(build_model(model, device="meta")))


def activation_bytes(model: str, tokens: int, seq_len: int) -> int:
    """Activations one rank keeps for backward (``ACTIVATIONS``), plus the logits and their fp32 copy for the loss."""
    cfg = GPT_PRESETS[model]
    per_layer = tokens * cfg.d_model * (34 + 5 * cfg.n_head * seq_len / cfg.d_model)
    return int(cfg.n_layer * per_layer + tokens * cfg.vocab_size * (2 + 4))


def predict(
    system: System,
    model: str,
    variant: str,
    gpus: int,
    tokens: int,
    seq_len: int,
    state: str | None = None,
    reduce_bytes: int | None = None,
    gather_bytes: int | None = None,
    policy: str = "course",
) -> dict:
    """One step of ``variant`` on ``gpus`` of ``system``'s GPUs, ``tokens`` per GPU: seconds (a range) and bytes.
    ``state``: what a rank keeps ("fp32": fp32 parameters under autocast; "mixed": 16-bit parameters and
    gradients beside fp32 master weights), by default ``STATE``'s; ``reduce_bytes`` and ``gather_bytes``: bytes
    per value the gradient reductions and the parameter gathers carry, by default ``policy``'s (``POLICIES``:
    "course", the course's fp32 reduce-scatter, or "torch", torch's default 16-bit one)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    state = state or STATE[variant]
    reduce_bytes = reduce_bytes or POLICIES[policy][variant][0]
    gather_bytes = gather_bytes or POLICIES[policy][variant][1]
    gpu, units = system.gpu, units_of(model)
    parameters = sum(math.prod(s) for unit in units for s in unit)
    precision = "bf16" if gpu.bf16_flops else "fp16"
    compute = training_flops(model, tokens, seq_len) / (gpu.peak_flops(precision) * gpu.mfu)
    optimizer = stepped_values(variant, parameters, gpus, units) * ADAM_BYTES_PER_VALUE / gpu.memory_bandwidth
    times = []
    calls = collective_calls(variant, units, gpus, "nccl", reduce_bytes, order_of(model), gather_bytes)
    for collective, _, size in calls:
        bus = system.allreduce_busbw if collective == "all_reduce" else system.gather_busbw
        ring = CollectiveModel.nccl(collective, gpus, bus, system.alpha_step_s, system.alpha_base_s)
        times.append(ring.time_s(size))
    if variant == "ddp":
        hideable, behind = sum(times[:-1]), 2 / 3 * compute
    else:
        hideable, behind = sum(times[1:-1]), compute
    exposed_least = sum(times) - min(hideable, behind)
    memory = predict_peak_bytes(variant, gpus, units, activation_bytes(model, tokens, seq_len), precision=state)
    slowest, fastest = compute + optimizer + sum(times), compute + optimizer + exposed_least
    return {
        "system": system.name, "gpu": gpu.name, "usable_memory_bytes": gpu.usable_memory_bytes,
        "model": model, "variant": variant, "gpus": gpus, "parameters": parameters, "policy": policy,
        "reduce_bytes": reduce_bytes, "gather_bytes": gather_bytes,
        "compute_s": compute, "optimizer_s": optimizer, "communication_s": sum(times),
        "bytes_sent": sum(size * RING_FACTOR[collective](gpus) for collective, _, size in calls),
        "step_s_no_overlap": slowest, "step_s_best_overlap": fastest,
        "tokens_per_s_no_overlap": gpus * tokens / slowest, "tokens_per_s_best_overlap": gpus * tokens / fastest,
        "peak_bytes": memory["peak"], "fits": memory["peak"] <= gpu.usable_memory_bytes,
    }  # fmt: skip


def achieved_flops(gpu: GPU) -> float:
    """What the predictions take one GPU to compute at: its dense 16-bit peak (bf16, or fp16 where it has no bf16,
    as on a T4) times its MFU."""
    return gpu.peak_flops("bf16" if gpu.bf16_flops else "fp16") * gpu.mfu


def crossing_tokens(system: System) -> float | None:
    """Tokens per GPU and step above which DDP's compute outlasts its fp32 all-reduce with nothing hidden, on
    ``system``'s GPU count: a step computes about 6 FLOPs per parameter per token, so ``t`` tokens take
    ``6 P t / (peak * MFU)``; the ring all-reduce of fp32 gradients sends ``2 (n-1)/n * 4 P`` bytes at the bus
    bandwidth whatever ``t``. ``P`` cancels: ``t = 8 (n-1)/n * peak * MFU / (6 * busbw)``, for every model size.
    (:func:`predict` crosses a little elsewhere: attention adds FLOPs that do not grow with ``P``, and each bucket
    adds its latency.) None on one GPU, which sends nothing."""
    n = system.count
    if n < 2:
        return None
    return 8 * (n - 1) / n * achieved_flops(system.gpu) / (6 * system.allreduce_busbw)


def table(models: tuple[str, ...], tokens: int = 2048, seq_len: int = 1024, policy: str = "course") -> list[dict]:
    """Every system at its own GPU count, every preset, every variant, on ``policy``'s wire (``POLICIES``)."""
    return [
        predict(system, model, variant, system.count, tokens, seq_len, policy=policy)
        for system in SYSTEMS.values()
        for model in models
        for variant in VARIANTS
    ]


# What a GPU sweep must be sized for: the step's fixed costs, measured once, against its compute, cited.

HOST_RUN = (
    "MEASURED, not cited: the course's first GPU run, one NVIDIA H200 SXM (torch 2.11, CUDA 13.0, bf16 autocast, "
    "one rank, 8 x 256 tokens per step; 16 Xeon cores of a VM), book/results/gpu/nvidia-h200-1x-20261127-055504/"
    "sweep.json, fitted by distlab.predict.costmodel.ComputeModel.fit (launches, optimizer) and StrategyCosts.fit "
    "(each strategy's cost per call and per value). These are the host's and the framework's costs, not the "
    "GPU's: taken for every GPU until a run on it measures its own (a slower host, such as Kaggle's, costs more)."
)
STEP_FIXED_S = 10.1e-3
"""Forward + backward's fixed cost per step (``ComputeModel.overhead_s``): kernel launches and Python (``HOST_RUN``)."""
OPTIMIZER_FIXED_S = 1.82e-3
"""Adam's fixed cost per step (``ComputeModel.optimizer_overhead_s``), ``HOST_RUN``."""
HOST_COSTS = StrategyCosts(
    per_call_s={"ddp": 0.210e-3, "zero1": 0.0646e-3, "zero2": 0.0659e-3, "zero3": 0.236e-3, "fsdp": 1.10e-3,
                "fsdp-no-reshard": 1.30e-3},
    per_value_s={"ddp": 0.0, "zero1": 0.0, "zero2": 53e-12, "zero3": 13e-12, "fsdp": 0.0, "fsdp-no-reshard": 6.4e-12},
)  # fmt: skip
"""Each strategy's cost around the bare model's arithmetic (:class:`~distlab.predict.costmodel.StrategyCosts`),
``HOST_RUN``: on that one host, one rank (nothing sent), 8 x 256 tokens, FSDP2 cost about 1.1 ms per collective call,
five times the course's ZeRO-3. Measured once; other hosts will differ. It is a host-side cost: at a
compute-dominated point the GPU hides it (the 2026-11-28 quick report's gpt-mini at 1016 x 256 tokens on the same
GPU: FSDP2's step within a few per cent of DDP's), so it sizes a sweep conservatively."""
COMPUTE_DOMINATED = 3.0
"""A step is compute-dominated when its predicted arithmetic is at least this many times its fixed costs
(:func:`fixed_s`): compute is then three quarters of the step or more. Under it, a point is launch-bound and
measures the host (Python, kernel launches, the framework's hooks) more than the GPU. A sweep is sized for it
(:func:`sweep_size`'s ``margin``), and the pages label every GPU point by it."""
FALLBACK_GPU = A100_40GB
"""ASSUMPTION for a GPU the course cites nothing for: the A100 40 GB's peaks and MFU, the middle of the cited
GPUs (T4: 14 TFLOP/s achieved; A100: 134; H100 and H200: 346). Only a sweep's size rests on it, never a
prediction the book shows: a faster GPU then runs a step less compute-dominated than planned, a slower one longer."""
FALLBACK_NETWORK = KAGGLE_T4X2
"""Collective latencies for a machine the course cites nothing for: NCCL's PCI constants, the larger."""
ACTIVATION_MARGIN = 1.25
"""The activations a step holds over Korthikanti's count (:func:`activation_bytes`): on the H200 run, at 8 x 256
tokens in bf16, the course's tracker counted 4 % (gpt-mini), 20 % (gpt-small) and 7 % (gpt-medium) more
(autocast keeps both dtypes of some tensors)."""
MEMORY_FRACTION = 0.7
"""The share of a GPU a sized sweep may plan to allocate: the allocator's fragmentation and CUDA's context
need the rest (the H200 run reserved 14 % more than it allocated)."""
LOGITS_LIMIT = 2**31 - 1
"""The most logits (tokens x vocabulary) a sized step may make: CUDA's cross-entropy kernels have failed past 2^31
elements (pytorch/pytorch#85786, open: 'fails in forward when n is greater than 42730' for a 50257-word vocabulary;
#111484, #190139: 32-bit offsets in its kernels), so a sweep stays under it."""
MATCHES = {"T4x2": ("T4",), "A100x2": ("A100", "40GB"), "H100x8": ("H100", "HBM3"), "H200x1": ("H200",)}
"""What a GPU's name must contain for a cited system to describe it: an A100 80 GB or an H100 PCIe differs from
the cited one, and an H200 is not an H100 (here, where the benchmarks and the GPU report both import it)."""
EXCLUDES = {"H200x1": ("NVL",)}
"""What it must not contain: an H200 NVL is a 600 W PCIe card with other peaks than the cited H200 SXM."""


def system_for(gpus: list[str]) -> System | None:
    """The course's cited system whose GPU these are (by the first one's name), or None."""
    if not gpus:
        return None
    name = gpus[0].replace(" ", "")
    return next(
        (
            SYSTEMS[key]
            for key, parts in MATCHES.items()
            if all(p in name for p in parts) and not any(p in name for p in EXCLUDES.get(key, ()))
        ),
        None,
    )


def gpu_for(gpus: list[str]) -> GPU | None:
    """The cited GPU of these names, or None."""
    system = system_for(gpus)
    return None if system is None else system.gpu


def compute_s(gpu: GPU, model: str, tokens: int, seq_len: int, precision: str) -> float:
    """Forward + backward of ``tokens`` at the GPU's cited dense peak in ``precision`` times its MFU."""
    return training_flops(model, tokens, seq_len) / (gpu.peak_flops(precision) * gpu.mfu)


def fixed_s(model: str, variant: str, gpus: int, system: System | None = None) -> float:
    """What one step of ``variant`` costs whatever its tokens: the launches of forward and backward, the optimizer's
    fixed cost, the strategy's cost per call and per value (all ``HOST_RUN``), and on more than one GPU each
    collective's latency (the system's NCCL constants, or ``FALLBACK_NETWORK``'s)."""
    units, order = units_of(model), order_of(model)
    parameters = sum(math.prod(s) for unit in units for s in unit)
    strategy = HOST_COSTS.overhead_s(variant, strategy_calls(variant, units, order), parameters)
    network = system or FALLBACK_NETWORK
    latency = sum(
        CollectiveModel.nccl(collective, gpus, 1.0, network.alpha_step_s, network.alpha_base_s).alpha_s
        for collective, _, _ in collective_calls(variant, units, gpus, "nccl", order=order)
    )
    return STEP_FIXED_S + OPTIMIZER_FIXED_S + strategy + latency


def sweep_step_s(
    gpu: GPU, model: str, variant: str, gpus: int, tokens: int, seq_len: int, precision: str, system: System | None
) -> float:
    """A rough step, for a sweep's time budget: compute + fixed costs + Adam at the memory bandwidth + every
    collective's bytes at the system's bus bandwidth, nothing hidden."""
    units = units_of(model)
    parameters = sum(math.prod(s) for unit in units for s in unit)
    optimizer = stepped_values(variant, parameters, gpus, units) * ADAM_BYTES_PER_VALUE / gpu.memory_bandwidth
    network = system or FALLBACK_NETWORK
    sent = sum(
        size * RING_FACTOR[collective](gpus)
        for collective, _, size in collective_calls(variant, units, gpus, "nccl", order=order_of(model))
    )
    return (
        compute_s(gpu, model, tokens, seq_len, precision)
        + fixed_s(model, variant, gpus, system)
        + optimizer
        + (sent / network.gather_busbw)
    )


@dataclass(frozen=True)
class SweepSize:
    """One preset's size in a GPU sweep, and what the model predicts there: the compute of a step, each variant's
    fixed costs (:func:`fixed_s`), the variants whose step is compute-dominated at this size (compute at least
    ``margin`` times their fixed costs), the bytes a rank is planned to hold, a rough step per variant, and whether
    each variant runs alone (the FSDP2 point: no calibration copy, no other variant built)."""

    model: str
    batch: int
    seq_len: int
    compute_s: float
    fixed_s: dict[str, float]
    dominated: tuple[str, ...]
    held_bytes: int
    step_s: dict[str, float]
    alone: bool = False

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


def sweep_size(
    gpu: GPU,
    model: str,
    variants: tuple[str, ...] | list[str],
    gpus: int,
    seq_len: int,
    precision: str,
    memory_bytes: int,
    resident_bytes: int,
    system: System | None = None,
    margin: float = COMPUTE_DOMINATED,
    alone: bool = False,
) -> SweepSize | None:
    """The batch (sequences of ``seq_len`` per rank, a multiple of 8) at which ``model``'s step is compute-dominated:
    the fewest sequences whose compute (:func:`compute_s`) is ``margin`` times the largest fixed cost among
    ``variants`` (:func:`fixed_s`), or, where that does not fit, the most that fit. What a rank holds must stay
    under ``MEMORY_FRACTION`` of ``memory_bytes``: ``resident_bytes`` (every variant built at once), one step's
    whole fp32 gradients and its activations (:func:`activation_bytes` times ``ACTIVATION_MARGIN``); and its logits
    under ``LOGITS_LIMIT``. None where not even the smallest fixed cost can be dominated within those limits.

    ``alone``: the FSDP2 point, where each variant runs by itself (``resident_bytes`` is the largest one's) and
    FSDP2 holds whole fp32 gradients one unit at a time, reduce-scattering each as its backward ends."""
    fixed = {variant: fixed_s(model, variant, gpus, system) for variant in variants}
    per_sequence = compute_s(gpu, model, seq_len, seq_len, precision)
    needed = {variant: 8 * math.ceil(margin * cost / per_sequence / 8) for variant, cost in fixed.items()}
    parameters = sum(math.prod(s) for unit in units_of(model) for s in unit)
    whole = max(sum(math.prod(s) for s in unit) for unit in units_of(model)) if alone else parameters
    room = MEMORY_FRACTION * memory_bytes - resident_bytes - 4 * whole
    per_held_sequence = ACTIVATION_MARGIN * activation_bytes(model, 1024 * seq_len, seq_len) / 1024
    fitting = 8 * int(room / per_held_sequence / 8) if room > 0 else 0
    fitting = min(fitting, 8 * (LOGITS_LIMIT // (seq_len * GPT_PRESETS[model].vocab_size) // 8))
    batch = min(max(needed.values()), fitting)
    if batch < min(needed.values()):
        return None
    compute = compute_s(gpu, model, batch * seq_len, seq_len, precision)
    held = resident_bytes + 4 * whole + ACTIVATION_MARGIN * activation_bytes(model, batch * seq_len, seq_len)
    return SweepSize(
        model, batch, seq_len, compute, fixed, tuple(v for v in variants if compute >= margin * fixed[v]), int(held),
        {v: sweep_step_s(gpu, model, v, gpus, batch * seq_len, seq_len, precision, system) for v in variants}, alone,
    )  # fmt: skip


def sweep_seconds(sizes: list[SweepSize], steps: int) -> float:
    """A sized sweep's predicted run time, builds left out: per preset, every variant and the calibration copy
    for ``steps`` (warm-up included), then about four more steps of each variant (memory, traffic, and its CUDA
    peak alone after a warm-up step); at the FSDP2 point each variant alone for ``steps`` and three more."""
    total = 0.0
    for size in sizes:
        if size.alone:
            total += (steps + 3) * sum(size.step_s.values())
            continue
        slowest = max(size.step_s.values())
        total += (len(size.step_s) + 1) * steps * slowest + 4 * sum(size.step_s.values())
    return total
