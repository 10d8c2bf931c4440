"""The GPU predictions carry each strategy's real wire dtypes (review F3): torch DDP under autocast all-reduces
fp32 gradients, FSDP2 gathers in param_dtype and reduce-scatters in reduce_dtype, so under the course's
policy FULL_SHARD sends DDP's bytes, not 1.5x; a compression hook halves DDP's."""

from __future__ import annotations

import math

import pytest

from distlab.predict import gpu_predictions
from distlab.predict.gpu_specs import SYSTEMS

MODEL, TOKENS, SEQ = "gpt-small", 2048, 1024


def _bytes_sent(variant: str, gpus: int, **wire) -> float:
    return gpu_predictions.predict(SYSTEMS["T4x2"], MODEL, variant, gpus, TOKENS, SEQ, **wire)["bytes_sent"]


def _root_values() -> int:
    """The root unit (embeddings, final norm) is gathered once: FSDP2 keeps it from forward into backward."""
    return sum(math.prod(shape) for shape in gpu_predictions.units_of(MODEL)[-1])


@pytest.mark.parametrize("gpus", [2, 8])
def test_ddp_sends_fp32_gradients_and_full_shard_sends_as_much(gpus):
    parameters = gpu_predictions.predict(SYSTEMS["T4x2"], MODEL, "ddp", gpus, TOKENS, SEQ)["parameters"]
    share, root = (gpus - 1) / gpus, _root_values()
    ddp = _bytes_sent("ddp", gpus)
    assert ddp == pytest.approx(2 * share * 4 * parameters, rel=1e-6)  # fp32, every value
    # bf16 gathers in forward and again in backward (the root once) + an fp32 reduce-scatter: 2 + 2 + 4 bytes
    # per value, DDP's 8 but for the root's second gather (FSDP pads each parameter to a multiple of N: rel)
    full_shard = share * (2 * 2 * parameters - 2 * root + 4 * parameters)
    assert _bytes_sent("fsdp", gpus) == pytest.approx(full_shard, rel=1e-4)
    assert abs(full_shard - ddp) == pytest.approx(share * 2 * root)
    # SHARD_GRAD_OP gathers once: 2 + 4 bytes per value, three quarters of DDP's
    assert _bytes_sent("fsdp-no-reshard", gpus) == pytest.approx(0.75 * ddp, rel=1e-4)


def test_the_wire_follows_the_options():
    ddp = _bytes_sent("ddp", 2)
    assert _bytes_sent("ddp", 2, reduce_bytes=2) == pytest.approx(ddp / 2)  # fp16_compress_hook
    # reduce_dtype = param_dtype: every collective in 16 bits, a quarter less than with an fp32 reduce-scatter
    fsdp = _bytes_sent("fsdp", 2)
    parameters = ddp / 4
    assert fsdp - _bytes_sent("fsdp", 2, reduce_bytes=2) == pytest.approx(parameters, rel=1e-4)


def test_ddp_keeps_fp32_parameters_gradients_and_buckets():
    """Under autocast torch DDP keeps fp32 parameters, fp32 gradients and their fp32 buckets beside Adam's
    two fp32 moments: 20 bytes per parameter at the optimizer step (activations gone by then); FSDP2's fp32
    shards hold 16 over N."""
    row = gpu_predictions.predict(SYSTEMS["H100x8"], MODEL, "ddp", 8, TOKENS, SEQ)
    parameters, activations = row["parameters"], gpu_predictions.activation_bytes(MODEL, TOKENS, SEQ)
    steps = len(gpu_predictions.order_of(MODEL)) * 4  # Adam's fp32 step counter per tensor
    assert row["peak_bytes"] == max(20 * parameters, 16 * parameters + activations) + steps


def test_one_h200_is_compute_and_optimizer_only():
    """On one GPU a step has no collective: the prediction is the compute at the cited dense peak times the MFU,
    and Adam's bytes at the cited memory bandwidth (what a one-rank run checks)."""
    system = SYSTEMS["H200x1"]
    row = gpu_predictions.predict(system, MODEL, "ddp", system.count, TOKENS, SEQ)
    assert row["communication_s"] == 0 and row["bytes_sent"] == 0
    step = row["compute_s"] + row["optimizer_s"]
    assert row["step_s_no_overlap"] == row["step_s_best_overlap"] == pytest.approx(step)
    assert row["optimizer_s"] == pytest.approx(row["parameters"] * 28 / 4.8e12)
    flops = row["compute_s"] * system.gpu.peak_flops("bf16") * system.gpu.mfu
    on_h100 = gpu_predictions.predict(SYSTEMS["H100x8"], MODEL, "ddp", 1, TOKENS, SEQ)
    assert row["compute_s"] == pytest.approx(on_h100["compute_s"])  # the same die, the same cited peak and MFU
    assert flops == pytest.approx(on_h100["compute_s"] * 989.5e12 * 0.35)
    assert row["optimizer_s"] < on_h100["optimizer_s"]  # faster memory: 4.8 TB/s against 3.35
    assert row["fits"] and row["usable_memory_bytes"] == system.gpu.usable_memory_bytes
