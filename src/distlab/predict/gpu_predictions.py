"""The cost model (:mod:`distlab.predict.costmodel`) run on GPUs nobody here has: every input cited
(:mod:`distlab.predict.gpu_specs`) or assumed and said so, every output a prediction.

Per optimizer step of torch DDP and FSDP2 (both reshard settings) on a GPT preset, mixed precision as torch
does it by default:

* compute: the step's FLOPs over the GPU's dense 16-bit peak times a cited achieved fraction (MFU);
* optimizer: Adam on this rank's values, 28 bytes read and written per value (an fp32 parameter or master
  weight read and written, two fp32 moments read and written, the gradient read) at the GPU's memory
  bandwidth (assumed: the step is memory-bound);
* communication: NCCL's ring, ``steps * latency + bytes sent / bus bandwidth``, each collective in its own
  dtype (``WIRE``): DDP under autocast keeps fp32 parameters, so it all-reduces fp32 gradients unless a
  compression hook halves them; FSDP2 all-gathers in ``param_dtype`` and reduce-scatters in
  ``reduce_dtype`` (fp32 in the course's policy). Given as a range, from nothing hidden to as much hidden
  as can be (DDP: every bucket but the last behind backward; FSDP: every collective but the first
  all-gather and the last reduce-scatter behind compute);
* memory: what each strategy keeps (DDP under autocast: fp32 parameters, gradients and buckets beside
  Adam's moments, 20 bytes per parameter; FSDP2: fp32 shards, 16 bytes per parameter over N, and its
  gathered units in ``param_dtype``), plus activations by Korthikanti et al.'s count for a transformer
  layer (``ACTIVATIONS``) and the logits.
"""

from __future__ import annotations

import math
from functools import cache

from ..models import GPT_PRESETS, build_model
from .costmodel import (
    RING_FACTOR,
    CollectiveModel,
    collective_calls,
    predict_peak_bytes,
    stepped_values,
    training_flops,
)
from .gpu_specs import SYSTEMS, System
from .memory import parameter_shapes, shard_unit_shapes

ACTIVATIONS = (
    "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', "
    "https://arxiv.org/abs/2205.05198, section 4.1: a layer stores s*b*h*(34 + 5*a*s/h) bytes in 16-bit training"
)
ADAM_BYTES_PER_VALUE = 28
WIRE = {"ddp": (4, None), "fsdp": (4, 2), "fsdp-no-reshard": (4, 2)}
"""Bytes per value of (gradient reductions, parameter gathers) under torch's defaults in mixed precision: DDP
all-reduces its fp32 gradients (2 with ``fp16_compress_hook``); FSDP2 with ``MixedPrecisionPolicy(param_dtype
=bf16 or fp16, reduce_dtype=fp32)`` gathers 16-bit parameters and reduce-scatters fp32 gradients."""
STATE = {"ddp": "fp32", "fsdp": "mixed", "fsdp-no-reshard": "mixed"}
"""What :func:`distlab.predict.costmodel.predict_peak_bytes` counts for each under autocast: DDP's fp32
parameters and gradients; FSDP2's fp32 shards hold as many bytes as "mixed" (16 per value over N) and its
gathered units are 16-bit."""
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
) -> dict:
    """One step of ``variant`` on ``gpus`` of ``system``'s GPUs, ``tokens`` per GPU: seconds (a range) and bytes.
    ``state``: what a rank keeps ("fp32": fp32 parameters under autocast; "mixed": 16-bit parameters and
    gradients beside fp32 master weights); ``reduce_bytes`` and ``gather_bytes``: bytes per value the gradient
    reductions and the parameter gathers carry. Each defaults to torch's behaviour (``STATE``, ``WIRE``)."""
    state = state or STATE[variant]
    reduce_bytes = reduce_bytes or WIRE[variant][0]
    gather_bytes = gather_bytes or WIRE[variant][1]
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
        "model": model, "variant": variant, "gpus": gpus, "parameters": parameters,
        "compute_s": compute, "optimizer_s": optimizer, "communication_s": sum(times),
        "bytes_sent": sum(size * RING_FACTOR[collective](gpus) for collective, _, size in calls),
        "step_s_no_overlap": slowest, "step_s_best_overlap": fastest,
        "tokens_per_s_no_overlap": gpus * tokens / slowest, "tokens_per_s_best_overlap": gpus * tokens / fastest,
        "peak_bytes": memory["peak"], "fits": memory["peak"] <= gpu.usable_memory_bytes,
    }  # fmt: skip


def table(models: tuple[str, ...], tokens: int = 2048, seq_len: int = 1024) -> list[dict]:
    """Every system at its own GPU count, every preset, every variant."""
    return [
        predict(system, model, variant, system.count, tokens, seq_len)
        for system in SYSTEMS.values()
        for model in models
        for variant in VARIANTS
    ]
