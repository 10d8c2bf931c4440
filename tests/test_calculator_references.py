"""The memory calculator's rows (:mod:`distlab.predict.calculator`, which the page's JavaScript computes to the
byte: ``tests/test_calculator.py``) against what they stand for: arithmetic by hand for 7B on eight 80 GiB GPUs,
the rings' and the traffic models' bytes sent, Korthikanti et al.'s activations, DeepSpeed's memory estimators,
the playbook's 8B activations and the course's own peak model; the page's JavaScript gives the same rows there too."""

from __future__ import annotations

import pytest

from distlab.predict.calculator import (
    GIB,
    PRECISIONS,
    STRATEGIES,
    Inputs,
    Transformer,
    activation_bytes,
    layer_activation_bytes,
    memory_per_rank,
    row_units,
    transformer_from,
    transformer_inputs,
)
from distlab.predict.costmodel import predict_peak_bytes
from distlab.predict.gpu_predictions import POLICIES
from distlab.predict.memory import BYTES_PER_VALUE
from distlab.predict.traffic import expected_bytes_per_step, frozen_crossing
from test_calculator import UNIT, ZERO_BUCKET, P, _library, rows_for, run_calculator_js


def test_seven_billion_on_eight_80_gib_gpus_by_hand():
    """8 x 80 GiB: DDP does not fit in any precision (at least 16 B/param is 104 GiB), ZeRO-1 and on do; FULL_SHARD
    sends 0.75x DDP's bytes with torch's defaults, 1x with the course's fp32 reduce, 1.5x in one dtype."""
    eighth, n = P // 8, 8
    by = {precision: {r["strategy"]: r for r in rows_for(P, n, 80.0, precision)} for precision in PRECISIONS}
    # one block's gradient before its reduce-scatter: bf16 with torch's default, bf16 and its fp32 cast with the
    # course's reduce_dtype=torch.float32
    for precision, reducing in (("torch", 2 * UNIT), ("course", (2 + 4) * UNIT)):
        rows = by[precision]
        assert rows["DDP, torch's default buckets"]["total"] == 20 * P + 4
        assert rows["ZeRO-1"]["total"] == 8 * P + 8 * eighth + 4
        assert rows["ZeRO-2"]["total"] == 4 * P + 12 * eighth + 4 + 4 * ZERO_BUCKET
        assert rows["FSDP FULL_SHARD (ZeRO-3)"]["total"] == 16 * eighth + 32 * 4 + 2 * UNIT + reducing
        assert rows["FSDP SHARD_GRAD_OP"]["total"] == 16 * eighth + 32 * 4 + 2 * P + reducing
        assert rows["DDP, torch's default buckets"]["sent"] == 2 * 7 * eighth * 4 == 7 * P
    assert by["torch"]["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == 7 * eighth * (2 + 2 * 2)
    assert by["course"]["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == 7 * eighth * (4 + 2 * 2)
    assert by["fp32"]["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == 7 * eighth * (4 + 2 * 4)
    assert by["zero-paper"]["DDP, torch's default buckets"]["total"] == 18 * P + 4  # 2 + 2 + 12, and 2 B of buckets
    assert by["zero-paper"]["DDP, torch's default buckets"]["sent"] == 2 * 7 * eighth * 2
    ratios = {precision: rows["FSDP FULL_SHARD (ZeRO-3)"]["sent_vs_ddp"] for precision, rows in by.items()}
    assert ratios == {"torch": 0.75, "course": 1.0, "fp32": 1.5, "zero-paper": 1.5, "deepspeed": 1.5}
    for rows in by.values():
        assert [label for label, row in rows.items() if not row["fits"]] == list(STRATEGIES)[:2]


def test_memory_per_gpu_decides_fits_at_the_byte():
    row = rows_for(1_000_000, 1, 1.0, "fp32", "sgd")[1]  # DDP: 12 bytes a parameter, no step counter
    exactly = row["total"] / GIB
    assert rows_for(1_000_000, 1, exactly, "fp32", "sgd")[1]["fits"]
    assert not rows_for(1_000_000, 1, exactly * (1 - 1e-9), "fp32", "sgd")[1]["fits"]


@pytest.mark.parametrize("precision", ["torch", "course", "fp32"])
def test_torch_ddp_under_autocast_holds_20_bytes_a_parameter_with_adam(precision):
    """fp32 parameters (autocast leaves them), gradients, buckets, two moments: 4 + 4 + 4 + 8."""
    rows = {row["strategy"]: row for row in rows_for(10**9, 2, 80.0, precision, "adam")}
    assert rows["DDP, torch's default buckets"]["total"] == 20 * 10**9 + 4
    assert rows["DDP, gradient_as_bucket_view"]["total"] == 16 * 10**9 + 4
    assert rows["DDP, torch's default buckets"]["buckets"] == 4 * 10**9


@pytest.mark.parametrize(
    "precision, ddp, zero, full_shard, shard_grad_op",
    [  # bytes per value of (DDP's all-reduce, ZeRO's reduce-scatter + gather, FULL_SHARD's, SHARD_GRAD_OP's)
        ("torch", 4, 4 + 4, 2 + 2 * 2, 2 + 2),  # FSDP2 reduces in its 16-bit param_dtype: 0.75x DDP
        ("course", 4, 4 + 4, 4 + 2 * 2, 4 + 2),  # reduce_dtype=fp32: DDP's bytes
        ("fp32", 4, 4 + 4, 4 + 2 * 4, 4 + 4),  # one dtype: 1.5x
        ("zero-paper", 2, 2 + 2, 2 + 2 * 2, 2 + 2),  # one dtype, 16 bits: 1.5x
        ("deepspeed", 2, 2 + 2, 2 + 2 * 2, 2 + 2),  # as the paper's: DeepSpeed's fp32 partition is never sent
    ],
)
def test_bytes_sent_are_the_rings(precision, ddp, zero, full_shard, shard_grad_op):
    """DDP sends 2(N-1)/N of the gradients; ZeRO-1/2 as much, half of it the gathered parameters; FULL_SHARD
    gathers twice, SHARD_GRAD_OP once, each collective in its own dtype. One GPU sends nothing."""
    p, n = 8_000_000, 4
    sent = {row["strategy"]: row["sent"] for row in rows_for(p, n, 80.0, precision, "adam", shard_units=8)}
    assert sent["DDP, torch's default buckets"] == sent["DDP, gradient_as_bucket_view"] == 2 * 3 * (p // 4) * ddp
    assert sent["ZeRO-1"] == sent["ZeRO-2"] == 3 * (p // 4) * zero
    assert sent["FSDP FULL_SHARD (ZeRO-3)"] == 3 * (p // 4) * full_shard
    assert sent["FSDP SHARD_GRAD_OP"] == 3 * (p // 4) * shard_grad_op
    assert all(row["sent"] == 0 and row["sent_vs_ddp"] is None for row in rows_for(p, 1, 80.0, precision))


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_bytes_sent_are_the_traffic_models(precision):
    """Every row's bytes sent is :func:`distlab.predict.traffic.expected_bytes_per_step` over the padded values, in
    the row's dtypes (a FULL_SHARD whose reduce-scatter is wider than its gathers adds the difference on one
    reduce-scatter), and torch's and the course's FSDP2 wires are :data:`distlab.predict.gpu_predictions.POLICIES`."""
    setup = PRECISIONS[precision]
    parameter_bytes, gradient_bytes, _ = BYTES_PER_VALUE["adam", setup.state]
    if precision in POLICIES:
        policy = POLICIES[precision]
        assert policy["ddp"][0] == gradient_bytes
        assert policy["fsdp"] == policy["fsdp-no-reshard"] == (setup.fsdp_reduce, setup.fsdp_gather)
    for p, n, units in [(1_234_567, 3, 7), (124_439_808, 8, 12), (7_000_000_000, 2, 32), (13_000_000_007, 5, 40)]:
        rows = rows_for(p, n, 80.0, precision, "adam", shard_units=units)
        flat = -(-p // n) * n
        size, larger = divmod(p, units)
        sharded = (larger * -(-(size + 1) // n) + (units - larger) * -(-size // n)) * n
        assert parameter_bytes == gradient_bytes  # DDP and ZeRO send in one dtype
        for row in rows:
            strategy = STRATEGIES[row["strategy"]]
            if strategy in ("ddp", "zero1", "zero2"):
                assert row["sent"] == expected_bytes_per_step(strategy, flat, n, gradient_bytes), row["strategy"]
            else:
                one_dtype = expected_bytes_per_step(strategy, sharded, n, setup.fsdp_gather)
                wider = (setup.fsdp_reduce - setup.fsdp_gather) * sharded * (n - 1) / n
                assert row["sent"] == one_dtype + wider, row["strategy"]


def test_activations_by_korthikanti_et_al():
    """34sbh + 5as^2b bytes a layer with eager attention (section 4.1), 34sbh with fused attention (the default),
    2sbh with full recomputation, one layer per shard unit."""
    gpt3_layer = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1, attention="eager")
    assert layer_activation_bytes(gpt3_layer) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    fused = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1)
    assert fused.attention == "fused" and layer_activation_bytes(fused) == 34 * 2048 * 12288
    recomputed = Transformer(hidden=12288, heads=96, seq_len=2048, micro_batch=1, recompute=True)
    assert layer_activation_bytes(recomputed) == 2 * 2048 * 12288
    for precision in ("torch", "course", "zero-paper"):  # autocast's activations are 16-bit
        rows = rows_for(10**9, 2, 80.0, precision, shard_units=96, transformer=gpt3_layer)
        assert {row["activations"] for row in rows} == {96 * layer_activation_bytes(gpt3_layer)}
    fp32 = rows_for(10**9, 2, 80.0, "fp32", shard_units=96, transformer=gpt3_layer)
    assert fp32[0]["activations"] == 2 * rows[0]["activations"]
    assert transformer_from(transformer_inputs(gpt3_layer)) == gpt3_layer


# DeepSpeed's estimators, no offload, one node (deepspeedai/DeepSpeed edaa722): estimate_zero2_model_states_mem_needs
# (deepspeed/runtime/zero/stage_1_and_2.py:3081-3098) and estimate_zero3_model_states_mem_needs
# (deepspeed/runtime/zero/stage3.py:3744-3780), in GB as they print them. GPT-2 XL's largest layer is its 50257 x 1600
# embedding, Llama-2-7B's its 32000 x 4096 one; DeepSpeed's ZeRO-3 gathers module by module, and both models have
# 291 modules with parameters of their own (GPT-2 XL: 2 embeddings, 6 in each of 48 blocks, the last norm;
# Llama-2-7B: the embedding, 9 in each of 32 blocks, the last norm and the head).
DEEPSPEED = [  # parameters, largest layer, GPUs, ZeRO-2 GB, ZeRO-3 GB
    (1_557_611_200, 50257 * 1600, 2, 17.134, 14.340),
    (1_557_611_200, 50257 * 1600, 8, 6.620, 3.826),
    (6_738_415_616, 32000 * 4096, 2, 74.123, 61.170),
    (6_738_415_616, 32000 * 4096, 8, 28.638, 15.686),
]


@pytest.mark.parametrize("parameters, largest, gpus, zero2_gb, zero3_gb", DEEPSPEED)
def test_the_deepspeed_setting_is_deepspeeds_estimators(parameters, largest, gpus, zero2_gb, zero3_gb):
    """ZeRO-2: 2Ψ + 18Ψ/N, the row's model states (its parameters, gradients and optimizer state: the estimator
    leaves out buckets); ZeRO-3: 4 B x the largest layer + 18Ψ/N, the FULL_SHARD row's total without activations
    (the largest unit gathered and its gradient, both 16-bit). The ZeRO paper's setting holds 4Ψ/N less under
    ZeRO-2 (no fp32 gradient partition): DeepSpeed's estimator counts 13-22 % more."""
    inputs = {"precision": "deepspeed", "shard_units": 291, "largest_unit": largest}
    rows = {row["strategy"]: row for row in rows_for(parameters, gpus, 80.0, **inputs)}
    zero2, full_shard = rows["ZeRO-2"], rows["FSDP FULL_SHARD (ZeRO-3)"]
    assert round((zero2["parameters"] + zero2["gradients"] + zero2["optimizer_state"]) / 1e9, 3) == zero2_gb
    assert round(full_shard["total"] / 1e9, 3) == zero3_gb
    assert full_shard["gathered"] == full_shard["buckets"] == 2 * largest  # the largest layer, 16-bit, whole
    assert round((2 * parameters + 18 * parameters // gpus) / 1e9, 3) == zero2_gb  # the estimators' own formulas
    assert round((4 * largest + 18 * parameters // gpus) / 1e9, 3) == zero3_gb
    paper = {row["strategy"]: row for row in rows_for(parameters, gpus, 80.0, **inputs | {"precision": "zero-paper"})}
    paper_state = sum(paper["ZeRO-2"][part] for part in ("parameters", "gradients", "optimizer_state"))
    assert zero2["gradients"] - paper["ZeRO-2"]["gradients"] == 4 * -(-parameters // gpus)
    assert 1.13 < zero2_gb * 1e9 / paper_state < 1.23  # DeepSpeed's estimator counts 13-22 % more
    page = run_calculator_js([{"parameters": parameters, "gpus": gpus, "memory_gib": 80.0} | inputs])["rows"][0]
    assert page == list(rows.values())


PLAYBOOK_8B_GIB = {1024: 4.25, 4096: 17.0, 16384: 68.0}
"""The Ultra-Scale Playbook's activations of an 8B model (32 layers, h 4096, 32 heads) for one sequence: 34·s·b·h
bytes a layer, no s^2 term."""


def test_fused_attention_by_default_is_the_playbooks_8b_activations():
    """Fused attention (torch's SDPA, which the course's GPT calls) stores no s^2 scores: the Playbook's figures,
    linear in the tokens. Eager attention adds 5·a·s^2·b a layer: more than three times the bytes for twice the
    tokens. The page computes both as the library does."""
    inputs = []
    for seq_len, gib in PLAYBOOK_8B_GIB.items():
        fused = Transformer(hidden=4096, heads=32, seq_len=seq_len, micro_batch=1)
        eager = Transformer(hidden=4096, heads=32, seq_len=seq_len, micro_batch=1, attention="eager")
        assert activation_bytes(32, fused, "mixed") == gib * GIB
        assert activation_bytes(32, eager, "mixed") == gib * GIB + 32 * 5 * 32 * seq_len**2
        inputs += [
            {"parameters": 8 * 10**9, "gpus": 8, "memory_gib": 80.0, "transformer": transformer_inputs(layer)}
            for layer in (fused, eager)
        ]
    page = run_calculator_js(inputs)["rows"]
    assert page == [rows_for(**_library(case)) for case in inputs]
    assert [rows[0]["activations"] / GIB for rows in page[::2]] == list(PLAYBOOK_8B_GIB.values())
    eager_1k, eager_4k = page[1][0]["activations"], page[3][0]["activations"]
    assert eager_4k > 4 * eager_1k  # eager grows faster than the tokens


# The rows the peak model covers, and its variant for each: torch DDP's default buckets are its "ddp".
PEAK_MODEL = {
    "DDP, torch's default buckets": "ddp",
    "ZeRO-1": "zero1",
    "ZeRO-2": "zero2",
    "FSDP FULL_SHARD (ZeRO-3)": "fsdp",
    "FSDP SHARD_GRAD_OP": "fsdp-no-reshard",
}
SAME_DTYPES = {"fp32": "fp32", "zero-paper": "mixed"}
"""The calculator's precision settings the peak model can state (one dtype held, gathered and reduced): its
``precision`` for each."""


@pytest.mark.parametrize("precision", list(SAME_DTYPES))
@pytest.mark.parametrize(
    "parameters, gpus, units, largest",
    [(1_234_567, 3, 7, None), (1_000_000, 2, 32, 80_000), (124_439_808, 4, 12, None), (7_000_000_000, 8, 32, None)],
)
def test_the_calculator_is_the_course_peak_model(precision, parameters, gpus, units, largest):
    """Every row the peak model (:func:`distlab.predict.costmodel.predict_peak_bytes`) covers, on the same units
    (:func:`row_units`) and activations: the same state, gathered parameters and in-flight gradients (ZeRO-2's
    bucket, FSDP's largest unit's gradient before its reduce-scatter), and a total that is the peak model's start of
    backward plus the gradient shards, which the calculator keeps from the last step and the peak model frees
    (zero_grad) until the optimizer step. ZeRO-1/2 only where the model is one of the course's 5 MB buckets: the
    calculator cuts its flat model into none, the peak model into 5 MB ones."""
    activations = 3 * 10**8
    inputs = Inputs(gpus, 80.0, precision, shard_units=units, activations_gib=activations / GIB, largest_unit=largest)
    rows = {row["strategy"]: row for row in memory_per_rank(parameters, inputs)}
    for label, variant in PEAK_MODEL.items():
        if variant.startswith("zero") and parameters > ZERO_BUCKET:
            continue
        row, units_of_row = rows[label], row_units(label, parameters, inputs)
        peak = predict_peak_bytes(variant, gpus, units_of_row, row["activations"], precision=SAME_DTYPES[precision])
        assert [row[k] for k in ("parameters", "gradients", "optimizer_state")] == [
            peak[k] for k in ("parameters", "gradients", "optimizer_state")
        ], label
        assert row["gathered"] == peak["gathered"], label
        in_flight = {"ddp": peak["buckets"], "zero1": 0}.get(variant, peak["in_flight"])
        assert row["buckets"] == in_flight, label
        kept_apart = 0 if variant == "zero1" else peak["gradients"]  # ZeRO-1's flat gradients are in its kept state
        assert row["total"] == peak["start_of_backward"] + kept_apart, label
    full_shard = rows["FSDP FULL_SHARD (ZeRO-3)"]
    assert full_shard["buckets"] > 0 and full_shard["buckets"] == full_shard["gathered"]  # one dtype: a unit each


@pytest.mark.parametrize("fraction", [0.01, 0.25])
def test_a_frozen_base_holds_its_weights_and_sends_its_trainable_gradients(fraction):
    """Frozen values keep only their weights: gradients, optimizer state and DDP's bucket copy shrink to the trainable
    fraction, the parameters do not. DDP all-reduces only the trainable gradients; FSDP still gathers every parameter
    twice and reduce-scatters the fraction: :func:`distlab.predict.traffic.expected_bytes_per_step` with
    ``trainable``, to the byte, and the page computes the same."""
    p, n = 8_000_000, 4
    whole = {row["strategy"]: row for row in rows_for(p, n, 80.0, "fp32", "adam", shard_units=8)}
    inputs = {"parameters": p, "gpus": n, "memory_gib": 80.0, "precision": "fp32", "shard_units": 8}
    frozen_rows = rows_for(**inputs, trainable_fraction=fraction)
    frozen = {row["strategy"]: row for row in frozen_rows}
    for label, row in frozen.items():
        assert row["parameters"] == whole[label]["parameters"], label
        assert row["gradients"] == int(whole[label]["gradients"] * fraction), label
        assert row["optimizer_state"] == int(whole[label]["optimizer_state"] * fraction), label
    trainable = int(p * fraction)
    assert frozen["DDP, torch's default buckets"]["buckets"] == 4 * trainable
    assert frozen["DDP, torch's default buckets"]["sent"] == expected_bytes_per_step("ddp", p, n, trainable=trainable)
    assert frozen["FSDP FULL_SHARD (ZeRO-3)"]["sent"] == expected_bytes_per_step("fsdp", p, n, trainable=trainable)
    assert frozen["FSDP SHARD_GRAD_OP"]["sent"] == expected_bytes_per_step("fsdp-no-reshard", p, n, trainable=trainable)
    assert run_calculator_js([inputs | {"trainable_fraction": fraction}])["rows"][0] == frozen_rows


@pytest.mark.parametrize(
    "precision, crossing",
    [("torch", 2 / 3), ("course", 1.0), ("fp32", 2.0), ("zero-paper", 2.0)],
)
def test_fsdp_sends_less_than_ddp_only_above_the_crossing(precision, crossing):
    """DDP sends 2f values of its gradient dtype, FULL_SHARD 2 gathers in param_dtype and f in reduce_dtype:
    equal at :func:`distlab.predict.traffic.frozen_crossing`. Under torch's defaults (16-bit gathers and reduce,
    DDP's fp32 all-reduce) that is f = 2/3; in one dtype f = 2, so over any frozen base FSDP sends more."""
    setup = PRECISIONS[precision]
    ddp_bytes = BYTES_PER_VALUE["adam", setup.state][1]
    assert frozen_crossing(2, setup.fsdp_gather, setup.fsdp_reduce, ddp_bytes) == pytest.approx(crossing)

    def ratio(fraction):
        rows = rows_for(8_000_000, 4, 80.0, precision, shard_units=8, trainable_fraction=fraction)
        return rows[list(STRATEGIES).index("FSDP FULL_SHARD (ZeRO-3)")]["sent_vs_ddp"]

    if crossing < 1:
        assert ratio(crossing * 0.99) > 1 > ratio(min(1.0, crossing * 1.01))
    assert ratio(0.01) > 25  # a 1 % adapter: FSDP sends tens of times DDP's bytes
