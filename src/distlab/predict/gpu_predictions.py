"""The cost model (:mod:`distlab.predict.costmodel`) run on GPUs nobody here has: every input cited
(:mod:`distlab.predict.gpu_specs`) or assumed and said so, every output a prediction.

Per optimizer step of torch DDP and FSDP2 (both reshard settings) on a GPT preset, mixed precision:

* compute: the step's FLOPs over the GPU's dense 16-bit peak times a cited achieved fraction (MFU);
* optimizer: Adam on this rank's values, 28 bytes read and written per value (fp32 master, two fp32
  moments, a 16-bit gradient in, a 16-bit parameter out) at the GPU's memory bandwidth (assumed: the
  step is memory-bound);
* communication: NCCL's ring, ``steps * latency + bytes sent / bus bandwidth``, parameters and gradients
  communicated in 16 bits; given as a range, from nothing hidden to as much hidden as can be (DDP: every
  bucket but the last behind backward; FSDP: every collective but the first all-gather and the last
  reduce-scatter behind compute);
* memory: the ZeRO paper's 2 + 2 + 12 bytes per parameter, divided as the strategy divides them, plus
  activations by Korthikanti et al.'s count for a transformer layer (``ACTIVATIONS``) and the logits.
"""

from __future__ import annotations

import math
from functools import cache

from ..models import GPT_PRESETS, build_model
from .costmodel import CollectiveModel, collective_calls, predict_peak_bytes, stepped_values, training_flops
from .gpu_specs import SYSTEMS, System
from .memory import parameter_shapes, shard_unit_shapes

ACTIVATIONS = (
    "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', "
    "https://arxiv.org/abs/2205.05198, section 4.1: a layer stores s*b*h*(34 + 5*a*s/h) bytes in 16-bit training"
)
ADAM_BYTES_PER_VALUE = 28
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
    state: str = "mixed",
    wire_bytes: int = 2,
) -> dict:
    """One step of ``variant`` on ``gpus`` of ``system``'s GPUs, ``tokens`` per GPU: seconds (a range) and bytes.
    ``state``: "mixed" (16-bit parameters and gradients, fp32 master weights) or "fp32" (fp32 parameters under
    autocast); ``wire_bytes``: bytes per value the collectives carry."""
    gpu, units = system.gpu, units_of(model)
    parameters = sum(math.prod(s) for unit in units for s in unit)
    precision = "bf16" if gpu.bf16_flops else "fp16"
    compute = training_flops(model, tokens, seq_len) / (gpu.peak_flops(precision) * gpu.mfu)
    optimizer = stepped_values(variant, parameters, gpus, units) * ADAM_BYTES_PER_VALUE / gpu.memory_bandwidth
    times = []
    calls = collective_calls(variant, units, gpus, "nccl", bytes_per_value=wire_bytes, order=order_of(model))
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
