"""A GPU sweep sized for the GPU it runs on, and each variant's CUDA peak taken alone (issue 34), checked on a CPU.

The sizes come from :func:`distlab.gpu_report.run.sweep_sizes`: tokens per rank whose compute, at the GPU's cited
peak times its MFU, is at least three times the step's fixed costs as the cost model has them
(:func:`distlab.predict.gpu_predictions.fixed_s`: launches, the optimizer's fixed cost, the strategy's cost per call
and per value measured on one H200, the collectives' latencies), within the GPU's memory and CUDA's 2^31-logit
limit. What cannot be reached on a CPU is the CUDA allocator itself; the ordering and freeing around it run here."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from distlab.bench import step, sweep
from distlab.bench.harness import Progress
from distlab.bench.step import Trainee
from distlab.bench.sweep import resident_bytes_per_rank
from distlab.cli import parse
from distlab.errors import DistlabError
from distlab.gpu_report import summary
from distlab.gpu_report.run import (
    SWEEP_PREDICTED_S,
    SWEEP_STEPS,
    SWEEP_TIMEOUT_S,
    SWEEP_WARMUP,
    Machine,
    plan,
    planned_seconds,
    sweep_sizes,
)
from distlab.predict import gpu_predictions
from distlab.predict.costmodel import training_flops
from distlab.predict.gpu_specs import SYSTEMS
from distlab.predict.memory import expected_state_bytes
from distlab.runtime import distributed

GIB = 2**30
ONE_H200 = Machine(1, 140 * GIB, True, ["NVIDIA H200"])
T4_PAIR = Machine(2, int(14.75 * GIB), False, ["Tesla T4"] * 2)
EIGHT_H100 = Machine(8, 80 * GIB, True, ["NVIDIA H100 80GB HBM3"] * 8)


def sweep_config(machine: Machine) -> sweep.SweepConfig:
    """The sweep part of the machine's plan, parsed as the sweep will parse it."""
    part = next(p for p in plan(machine) if p.name == "sweep")
    return parse(sweep.SweepConfig, [*part.args, "--out", "r", "--name", "sweep"])


@pytest.mark.parametrize(
    "machine, fsdp2_preset",
    [(ONE_H200, "gpt-2.7b"), (T4_PAIR, None), (EIGHT_H100, "gpt-2.7b")],
    ids=["1xH200", "2xT4", "8xH100"],
)
def test_the_plan_sizes_every_strategy_at_a_point_where_compute_is_three_times_its_fixed_costs(machine, fsdp2_preset):
    """ACCEPTANCE. Each sized point's predicted compute (the cited dense peak in the plan's precision times the cited
    MFU) is compared with each strategy's fixed overhead per step: the per-step terms (launches, the optimizer's),
    the strategy's per-call and per-value terms, and on several GPUs the collectives' latencies. DDP and ZeRO-3 are
    compute-dominated (compute at least 3x) at every shared point, and every strategy at one point at least.

    FSDP2's cost per call (about 1.1 ms on the H200) is not amortised by any preset that fits beside the other five
    strategies on an H100 or H200 (it would take more than 2^31 logits or more memory than the GPU has), so there
    the plan adds the FSDP2 point: the smallest preset at which both FSDP2 variants are, each run alone. A T4 pair
    needs none. The launch-bound size stays as the first point."""
    cfg, sized = sweep_config(machine), sweep_sizes(machine)
    system = gpu_predictions.system_for(machine.names)
    precision = "bf16" if machine.bf16 else "fp16"
    assert cfg.precision == precision and sized
    shared = [size for size in sized if not size.alone]
    points = cfg.points()
    assert points[0] == (sized[0].model, 8, "launch-bound") and cfg.seq_len == 256
    last = [(fsdp2_preset, sized[-1].batch, sweep.FSDP2_POINT)] if fsdp2_preset else []
    assert points[1:] == [(s.model, s.batch, "sized") for s in shared] + last
    assert [size.alone for size in sized] == [False] * len(shared) + [True] * len(last)
    dominated_somewhere = set()
    for (model, batch, label), size in zip(points[1:], sized):
        variants = cfg.variants_at(label)
        assert list(size.fixed_s) == variants
        tokens = batch * cfg.seq_len
        compute = training_flops(model, tokens, cfg.seq_len) / (
            system.gpu.peak_flops(precision) * system.gpu.mfu
        )  # the cited rate
        assert compute == pytest.approx(size.compute_s)
        for variant in variants:
            fixed = gpu_predictions.fixed_s(model, variant, machine.gpus, system)
            assert (compute >= 3 * fixed) == (variant in size.dominated), (model, variant, compute / fixed)
        assert {"ddp", "zero3"} & set(variants) <= set(size.dominated), (model, size.dominated)
        assert not size.alone or set(size.dominated) == set(sweep.FSDP2_VARIANTS)
        dominated_somewhere |= set(size.dominated)
        assert tokens * gpu_predictions.GPT_PRESETS[model].vocab_size <= gpu_predictions.LOGITS_LIMIT
        assert size.held_bytes <= gpu_predictions.MEMORY_FRACTION * machine.memory_bytes
    assert dominated_somewhere == set(sweep.VARIANTS)
    assert gpu_predictions.sweep_seconds(sized, SWEEP_STEPS + SWEEP_WARMUP) <= planned_seconds(sized)
    assert planned_seconds(sized) <= SWEEP_PREDICTED_S <= 0.75 * SWEEP_TIMEOUT_S


def test_the_fsdp2_point_plans_one_variant_resident_and_one_units_whole_gradients():
    """At the FSDP2 point what stays resident is one FSDP2 variant's state (no calibration copy, no other variant),
    and FSDP2 holds one unit's fp32 gradients whole at a time: the plan's held bytes say exactly that."""
    size = sweep_sizes(EIGHT_H100)[-1]
    assert size.alone and size.model == "gpt-2.7b"
    units = gpu_predictions.units_of(size.model)
    largest_unit = max(sum(math.prod(s) for s in unit) for unit in units)
    resident = max(resident_bytes_per_rank(size.model, [v], 8, calibrated=False) for v in sweep.FSDP2_VARIANTS)
    activations = gpu_predictions.ACTIVATION_MARGIN * gpu_predictions.activation_bytes(size.model, size.tokens, 256)
    assert size.held_bytes == int(resident + 4 * largest_unit + activations)
    assert resident < sum(expected_state_bytes(sweep.preset_parameters(size.model), "ddp", 1).values()) / 4


def test_an_unknown_gpu_is_sized_with_the_fallback_figures_and_a_small_one_runs_the_launch_bound_point_alone():
    unknown = Machine(1, 24 * GIB, True, ["NVIDIA GeForce RTX 4090"])
    assert gpu_predictions.system_for(unknown.names) is None
    (size,) = sweep_sizes(unknown)
    fallback = gpu_predictions.FALLBACK_GPU
    assert size.compute_s == pytest.approx(
        training_flops("gpt-mini", size.tokens, 256) / (fallback.peak_flops("bf16") * fallback.mfu)
    )
    assert "ddp" in size.dominated
    small = sweep_config(Machine(1, 6 * GIB, False, ["Some GPU"]))
    assert small.points() == [("gpt-mini", 8, "")] and not small.batch_sizes


@pytest.mark.parametrize(
    "name, system",
    [("Tesla T4", "T4x2"), ("NVIDIA A100-SXM4-40GB", "A100x2"), ("NVIDIA A100-SXM4-80GB", None),
     ("NVIDIA H100 80GB HBM3", "H100x8"), ("NVIDIA H100 PCIe", None), ("NVIDIA H200", "H200x1"),
     ("NVIDIA H200 NVL", None), ("NVIDIA GeForce RTX 4090", None)],
)  # fmt: skip
def test_the_sweep_and_the_report_find_a_gpu_by_name_with_one_rule(name, system):
    assert summary.system_for is gpu_predictions.system_for
    found = gpu_predictions.system_for([name])
    assert found is (None if system is None else SYSTEMS[system])
    assert gpu_predictions.gpu_for([name]) is (None if found is None else found.gpu)


def test_batch_sizes_name_one_positive_batch_per_preset():
    cfg = parse(sweep.SweepConfig, ["--models", "gpt-mini,gpt-small", "--batch-sizes", "64,16", "--seq-len", "256"])
    assert cfg.points() == [("gpt-mini", 64, "sized"), ("gpt-small", 16, "sized")]
    plain = parse(
        sweep.SweepConfig, ["--models", "gpt-tiny,gpt-mini", "--batch-size", "3", "--launch-bound", "gpt-tiny"]
    )
    assert plain.points() == [("gpt-tiny", 3, "launch-bound"), ("gpt-tiny", 3, ""), ("gpt-mini", 3, "")]
    alone = parse(sweep.SweepConfig, ["--models", "gpt-mini", "--fsdp2-point", "gpt-tiny:3"])
    assert alone.points()[-1] == ("gpt-tiny", 3, sweep.FSDP2_POINT)
    assert alone.variants_at(sweep.FSDP2_POINT) == ["fsdp", "fsdp-no-reshard"] and len(alone.variants_at("")) == 6
    for bad in (
        ["--batch-sizes", "64"],
        ["--batch-sizes", "64,0"],
        ["--batch-sizes", "64,x"],
        ["--fsdp2-point", "gpt-tiny"],
        ["--fsdp2-point", "gpt-tiny:0"],
        ["--fsdp2-point", "gpt-nope:3"],
    ):
        with pytest.raises((DistlabError, SystemExit)):
            parse(sweep.SweepConfig, ["--models", "gpt-mini,gpt-small", *bad])
    with pytest.raises((DistlabError, SystemExit)):
        parse(sweep.SweepConfig, ["--models", "gpt-tiny", "--seq-len", "65"])  # gpt-tiny takes 64 tokens


class Built:
    def __init__(self, name: str):
        self.name, self.payload = name, torch.zeros(16)


def test_each_variant_is_measured_with_nothing_else_built_alive():
    """each_alone: built in turn, measured with only itself alive (a weak reference to every earlier one is dead),
    the baseline read before it was built, cached memory released before each and after the last."""
    built: list[weakref.ref] = []
    events: list[str] = []

    def build(name):
        events.append(f"build {name}")
        thing = Built(name)
        built.append(weakref.ref(thing))
        return thing

    def measure(thing, baseline):
        alive = [ref().name for ref in built if ref() is not None]
        events.append(f"measure {thing.name}")
        return {"alive": alive, "baseline": baseline}

    count = iter(range(100))
    results = step.each_alone(
        ["a", "b", "c"], build, measure, before=lambda: next(count), release=lambda: events.append("release")
    )
    assert results == {name: {"alive": [name], "baseline": i} for i, name in enumerate("abc")}
    assert events == ["release", "build a", "measure a", "release", "build b", "measure b", "release", "build c",
                      "measure c", "release"]  # fmt: skip
    assert all(ref() is None for ref in built)


def test_a_one_rank_sweep_point_measures_each_variants_device_peak_alone_and_reports_its_flop_rate(monkeypatch):
    """measure_preset on one CPU rank with the device's peak reader replaced (the CUDA one needs a GPU): when each
    variant is measured, it is the only trainee alive, the timed ones and the calibration copy freed; it gets one
    warm-up step first; every row and the calibration copy report their FLOP/s (no cited peak on a CPU)."""
    seen = {}

    def fake_measure(trainee, tokens, targets, runtime, warmup, resident_before):
        gc.collect()
        alive = [obj for obj in gc.get_objects() if issubclass(type(obj), Trainee)]  # type(): no property runs
        seen[trainee.strategy.__class__.__name__, id(trainee)] = (len(alive), warmup, resident_before)
        return [{"max_allocated": 1, "max_reserved": 2, "resident_before": resident_before}]

    peaks = step.DevicePeaks(fake_measure, lambda: 7, lambda: None)
    monkeypatch.setattr(sweep, "device_peaks", lambda runtime: peaks)
    cfg = parse(sweep.SweepConfig, ["--models", "gpt-tiny", "--steps", "1", "--warmup", "0", "--batch-size", "2",
                                    "--seq-len", "16", "--device", "cpu"])  # fmt: skip
    with distributed("cpu") as runtime:
        progress = Progress(runtime, sweep.preset_parameters("gpt-tiny") * 32 * (len(sweep.VARIANTS) + 1))
        entry = sweep.measure_preset("gpt-tiny", cfg, runtime, progress, batch_size=2, point="sized")
    assert len(seen) == len(sweep.VARIANTS)
    assert all(v == (1, 1, 7) for v in seen.values()), seen  # alone, after one warm-up step, the baseline read first
    assert entry["point"] == "sized" and entry["batch_size"] == 2 and entry["tokens_per_rank"] == 32
    assert entry["flops_per_step"] == training_flops("gpt-tiny", 32, 16)
    for row in entry["variants"]:
        assert row["cuda_memory"] == [{"max_allocated": 1, "max_reserved": 2, "resident_before": 7}]
        assert row["tflops"] == pytest.approx(entry["flops_per_step"] / row["time_s"] / 1e12)
        assert row["peak_share"] is None
    assert entry["local"]["compute"]["tflops"] > 0
