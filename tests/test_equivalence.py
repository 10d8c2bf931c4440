"""Every strategy trains the same model: DDP equals one process on the
concatenated batch, FSDP2 (both reshard settings) equals DDP, with and
without gradient accumulation. Real gloo ranks, the library's own loop."""

from __future__ import annotations

import time
import traceback
import warnings

import pytest
import torch

from distlab.config import TrainConfig
from distlab.models import relative_update_error as _relative_update_error
from distlab.parallel import STRATEGIES, full_state_dict
from distlab.testing import CNN_PARAMETERS, assert_same_state, run_ranks
from distlab.train import train

# SGD keeps float reassociation (different reduction order across ranks)
# at rounding level (distlab.models.ATOL/RTOL); Adam's division by sqrt(v)
# would amplify it in near-zero gradients.
STEPS = 5


def _config(**overrides) -> TrainConfig:
    base = dict(
        model="cnn",
        dataset="synthetic",
        device="cpu",
        synthetic_size=640,
        batch_size=8,
        max_steps=STEPS,
        epochs=1,
        optimizer="sgd",
        lr=0.05,
        num_workers=0,
        log_every=-1,
        eval_batch_size=64,
    )
    return TrainConfig.from_flags(**{**base, **overrides})


def train_and_report(runtime, cfg: TrainConfig):
    result = train(cfg, runtime)
    return {"state": full_state_dict(result.model), "history": result.history}


def train_groups(runtime, groups: dict[str, dict[str, TrainConfig]], count_fsdp_shards: bool = False) -> dict:
    """Every configuration of every group, trained one after another in this rank's process, float32 groups
    first (``float64`` makes every tensor the run makes float64: data, weights, flat buffers, collectives).
    A configuration that fails is reported by name, so it cannot hide the others."""
    out = {}
    for dtype, configs in sorted(groups.items(), key=lambda item: item[0] == "float64"):
        torch.set_default_dtype(getattr(torch, dtype))
        for name, cfg in configs.items():
            try:
                out[name] = train_and_report(runtime, cfg)
            except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
                where = traceback.extract_tb(err.__traceback__)[-1]
                out[name] = f"{type(err).__name__}: {err} (at {where.filename}:{where.lineno})"
                out.setdefault("failures", []).append((time.monotonic(), runtime.rank, name, out[name]))
    if count_fsdp_shards:
        out["local_parameters"] = local_parameter_count(runtime)
    return out


def local_parameter_count(runtime):
    from distlab.models import build_model
    from distlab.parallel import FSDP2

    model = FSDP2().wrap(build_model("cnn"), runtime)
    return {
        "local": sum(p.to_local().numel() for p in model.parameters()),
        "total": sum(p.numel() for p in model.parameters()),
    }


# What a rank sees when its peer process is gone or stalled, not what a wrong computation raises.
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Timed out")


def train_on_ranks(world_size: int, tmp_path, groups: dict, count_fsdp_shards: bool = False) -> list[dict]:
    """:func:`train_groups` on ``world_size`` ranks. Every rank's result carries every rank's failures in the
    order they happened: a rank whose peer failed first sees only a broken connection, and the first failure
    is the one to read. A group whose only failures are lost peers (gloo over loopback, a process stalled on
    a shared 2-core machine) runs once more, with a warning that names what the first attempt saw; any other
    failure, or a lost peer twice, reaches the tests."""
    for attempt in (1, 2):
        ranks = run_ranks(train_groups, world_size, tmp_path / f"attempt{attempt}", groups, count_fsdp_shards)
        failures = sorted(failure for runs in ranks for failure in runs.pop("failures", []))
        lines = [f"rank {rank}, {name}: {message}" for _, rank, name, message in failures]
        if not failures or attempt == 2 or not all(any(s in line for s in LOST_PEER) for line in lines):
            break
        warnings.warn(
            f"{world_size} ranks lost a peer; running the group again. It saw:\n" + "\n".join(lines), stacklevel=2
        )
    for runs in ranks:
        runs["every_rank_failure"] = lines
    return ranks


def _state(runs: dict, name: str) -> dict:
    run = runs[name]
    if isinstance(run, str):
        every = "\n".join(runs.get("every_rank_failure", []))
        raise AssertionError(f"{name} failed on its rank: {run}\nevery rank's failures, in order:\n{every}")
    return run["state"]


# Adam, two micro-steps and a clipping norm that bites make every ZeRO stage's bookkeeping count: the sharded
# optimizer, the reduce-scattered gradients, the norm. Run in float64: Adam divides each gradient by its own
# magnitude, so where a gradient is within float32 rounding of zero, 4 ranks' sums and one process's (added in
# other orders) step the weight differently (measured: 24 of conv1's 800 weights up to 3.5e-5 apart on an AMD
# EPYC with torch 2.15, within 5e-6 on the Xeon where this test was written). In float64 that rounding is 1e-16;
# a bookkeeping mistake still moves weights by about the learning rate.
ZERO_ON_4 = dict(optimizer="adam", lr=1e-3, max_grad_norm=0.05)
# A norm small enough that every step clips: each rank must scale by the norm over all ranks' gradients (or
# shards), not by its own part of it.
CLIPPED = dict(max_grad_norm=0.05, optimizer="adam", lr=1e-3)
ACCUMULATING = ["ddp", "naive_ddp", "bucketed_ddp", "zero1", "zero2"]
CLIPPING = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
FSDP_SHARDING = {"full_shard": True, "shard_grad_op": False}

# Every FSDP2 option of distlab.train, against torch DDP on the same batches:
# none of them changes the arithmetic, so each must match to rounding.
FSDP2_OPTIONS = {
    "explicit_prefetch": (dict(fsdp_prefetch="explicit"), {}),
    "explicit_prefetch_2": (dict(fsdp_prefetch="explicit", fsdp_prefetch_depth=2), {}),
    "cpu_offload": (dict(fsdp_cpu_offload=True), {}),
    "activation_checkpointing": (dict(activation_checkpointing=True), {}),
    "checkpointing_shard_grad_op": (dict(activation_checkpointing=True, fsdp_reshard_after_forward=False), {}),
    "gathered_across_micro_steps": (dict(accum_steps=2, fsdp_reshard_between_micro_steps=False), dict(accum_steps=2)),
    "meta_init_sharded": (dict(meta_init="on"), {}),
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """Every single-process reference, trained once in one process."""
    float32 = {
        "batch_16": _config(strategy="single", batch_size=16),
        "batch_32": _config(strategy="single", batch_size=32),
        "initial_32": _config(strategy="single", batch_size=32, max_steps=1, lr=0.0),
        "clipped_16": _config(strategy="single", batch_size=16, **CLIPPED),
    }
    float64 = {
        "zero_on_4": _config(strategy="single", batch_size=4 * 4 * 2, **ZERO_ON_4),  # 4 ranks x 2 x 4
        "batch_32_float64": _config(strategy="single", batch_size=32),
    }
    return train_on_ranks(1, tmp_path_factory.mktemp("one"), {"float32": float32, "float64": float64})[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Every 2-rank configuration, trained one after another on the same two ranks."""
    configs = {"ddp": _config(strategy="ddp"), "ddp_accum_2": _config(strategy="ddp", accum_steps=2)}
    for sharding, reshard in FSDP_SHARDING.items():
        for accum in (1, 2):
            configs[f"fsdp_{sharding}_accum_{accum}"] = _config(
                strategy="fsdp", accum_steps=accum, fsdp_reshard_after_forward=reshard
            )
    for strategy in ACCUMULATING:
        options = STRATEGIES[strategy].options
        buckets = {cap: 0.5 for cap in ("ddp_bucket_cap_mb", "zero_bucket_cap_mb") if cap in options}
        configs[f"accumulated_{strategy}"] = _config(strategy=strategy, accum_steps=2, **buckets)
    for strategy in CLIPPING:
        configs[f"clipped_{strategy}"] = _config(strategy=strategy, **CLIPPED)
    for name, (fsdp_flags, ddp_flags) in FSDP2_OPTIONS.items():
        configs[f"option_{name}"] = _config(strategy="fsdp", **fsdp_flags)
        if ddp_flags:
            configs[f"option_ddp_{name}"] = _config(strategy="ddp", **ddp_flags)
    one_step = dict(max_steps=1, batch_size=16, synthetic_size=1280)
    configs["low_ddp"] = _config(strategy="ddp", **one_step)
    configs["low_initial"] = _config(strategy="ddp", **one_step, lr=0.0)
    for name, (flags, _) in LOW_PRECISION.items():
        configs[f"low_{name}"] = _config(strategy="fsdp", **flags, **one_step)
        configs[f"low_zero3_{name}"] = _config(strategy="zero3", **flags, **one_step)
    for strategy in ("ddp", "fsdp", "zero1", "zero2", "zero3"):  # fp16 autocast and the loss scaler, 3 steps
        configs[f"fp16_{strategy}"] = _config(strategy=strategy, precision="fp16", **{**one_step, "max_steps": 3})
    return train_on_ranks(2, tmp_path_factory.mktemp("two"), {"float32": configs}, True)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> list[dict]:
    """Each low-precision policy, for FSDP2 and the course's ZeRO-3, and fp32 DDP, on 3 ranks."""
    one_step = dict(max_steps=1, batch_size=16, synthetic_size=1280)
    configs = {
        "low_ddp": _config(strategy="ddp", **one_step),
        "low_initial": _config(strategy="ddp", **one_step, lr=0.0),
    }
    for name, (flags, _) in LOW_PRECISION.items():
        configs[f"low_{name}"] = _config(strategy="fsdp", **flags, **one_step)
        configs[f"low_zero3_{name}"] = _config(strategy="zero3", **flags, **one_step)
    return train_on_ranks(3, tmp_path_factory.mktemp("three"), {"float32": configs}, True)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    float32 = {
        "ddp_batch_4": _config(strategy="ddp", batch_size=4),
        "fsdp_reshard_to_2": _config(strategy="fsdp", batch_size=4, fsdp_reshard_to=2),
        "hsdp_2x2": _config(strategy="fsdp", batch_size=4, fsdp_replicate=2),
    }
    float64 = {
        f"zero_{name}": _config(strategy=name, accum_steps=2, batch_size=4, **ZERO_ON_4)
        for name in ("zero1", "zero2", "zero3")
    }
    # in float64: on 4 ranks torch DDP's two buckets sum each value in another order than one bucket would,
    # and in float32 that rounding alone grows past the tolerance over the steps
    float64["ddp"] = _config(strategy="ddp")
    return train_on_ranks(4, tmp_path_factory.mktemp("four"), {"float32": float32, "float64": float64})


def test_ddp_equals_single_process_on_the_concatenated_batch(one_rank, two_ranks):
    for rank in two_ranks:
        assert_same_state(_state(rank, "ddp"), _state(one_rank, "batch_16"), label="2 ranks")
    # and it really trained: the weights moved away from the initial ones
    initial, trained = _state(one_rank, "initial_32"), _state(one_rank, "batch_32")
    assert any(not torch.allclose(initial[k], trained[k]) for k in trained)


@pytest.mark.slow
def test_ddp_on_4_ranks_equals_single_process_on_the_concatenated_batch(one_rank, four_ranks):
    for rank in four_ranks:
        assert_same_state(_state(rank, "ddp"), _state(one_rank, "batch_32_float64"), label="4 ranks")


@pytest.mark.parametrize("sharding", FSDP_SHARDING)
@pytest.mark.parametrize("accum_steps", [1, 2])
def test_fsdp_equals_ddp(two_ranks, sharding, accum_steps):
    ddp_name = "ddp" if accum_steps == 1 else "ddp_accum_2"
    for rank in two_ranks:
        fsdp, ddp = rank[f"fsdp_{sharding}_accum_{accum_steps}"], rank[ddp_name]
        assert_same_state(_state(rank, f"fsdp_{sharding}_accum_{accum_steps}"), _state(rank, ddp_name))
        assert fsdp["history"][0]["test_accuracy"] == pytest.approx(ddp["history"][0]["test_accuracy"], abs=1e-6)


@pytest.mark.parametrize("strategy", ACCUMULATING)
def test_accumulation_with_no_sync_equals_the_large_batch(one_rank, two_ranks, strategy):
    # 2 ranks x 2 micro-batches of 8 == one process on 32 samples per step, through the one training loop,
    # for torch DDP and the course's own. Micro-batches of one rank are consecutive in its shard, so the union
    # over ranks and micro-steps is the same 32 samples as the big batch.
    assert_same_state(_state(two_ranks[0], f"accumulated_{strategy}"), _state(one_rank, "batch_32"))


def test_fsdp_shards_are_exactly_one_over_n(two_ranks):
    # Every CNN parameter has an even first dimension, so dim-0 sharding
    # over 2 ranks needs no padding: each rank must hold exactly half.
    counts = [rank["local_parameters"] for rank in two_ranks]
    total = counts[0]["total"]
    assert total == CNN_PARAMETERS
    assert [c["local"] for c in counts] == [total // 2, total // 2]


@pytest.mark.parametrize("strategy", CLIPPING)
def test_clipping_by_the_global_norm_equals_the_large_batch(one_rank, two_ranks, strategy):
    for rank in two_ranks:
        assert_same_state(_state(rank, f"clipped_{strategy}"), _state(one_rank, "clipped_16"))
    # and the norm bit: the same run without clipping (trained here in one process, once for every strategy) ends
    # elsewhere
    from distlab.models import ATOL, RTOL
    from distlab.runtime import distributed

    if "unclipped_16" not in one_rank:
        with distributed("cpu") as runtime:
            unclipped = _config(strategy="single", batch_size=16, **{**CLIPPED, "max_grad_norm": 0})
            one_rank["unclipped_16"] = train_and_report(runtime, unclipped)
    clipped, unclipped = _state(one_rank, "clipped_16"), _state(one_rank, "unclipped_16")
    assert any(not torch.allclose(clipped[k], unclipped[k], atol=ATOL, rtol=RTOL) for k in clipped), (
        "the clipped run equals the unclipped one: no step clipped"
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_every_zero_stage_with_adam_accumulation_and_clipping_on_4_ranks(one_rank, four_ranks, stage):
    # The CNN's 405,898 parameters do not divide by 4, so every flat buffer is padded.
    reference = _state(one_rank, "zero_on_4")
    assert all(t.dtype == torch.float64 for t in reference.values() if t.is_floating_point())
    for rank, states in enumerate(four_ranks):
        assert_same_state(_state(states, f"zero_{stage}"), reference, label=f"rank {rank} {stage}")


@pytest.mark.parametrize("option", FSDP2_OPTIONS)
def test_every_fsdp2_option_trains_like_ddp(two_ranks, option):
    ddp = f"option_ddp_{option}" if FSDP2_OPTIONS[option][1] else "ddp"
    for rank, states in enumerate(two_ranks):
        assert_same_state(_state(states, f"option_{option}"), _state(states, ddp), label=f"rank {rank} {option}")


@pytest.mark.slow
def test_reshard_to_a_group_of_ranks_trains_like_ddp(four_ranks):
    # On 4 ranks, parameters stay gathered over pairs between forward and backward.
    for rank, states in enumerate(four_ranks):
        assert_same_state(_state(states, "fsdp_reshard_to_2"), _state(states, "ddp_batch_4"), label=f"rank {rank}")


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh_trains_like_ddp(four_ranks):
    # Two replicas, each sharding over two ranks: reduce-scatter in a replica, all-reduce across them.
    for rank, states in enumerate(four_ranks):
        assert_same_state(_state(states, "hsdp_2x2"), _state(states, "ddp_batch_4"), label=f"rank {rank}")


# Low-precision parameters round the forward and backward to 8 (bf16) or 11
# (fp16) significant bits, so they cannot match fp32 to rounding. One optimizer
# step isolates the gradient: with SGD from one start, the step's update is
# lr x gradient, and its relative error against fp32 DDP is the gradient's.
# On the CNN's sums of many small per-sample terms that error is a few percent
# (measured: bf16 9.0 %, fp16 2.2 %); the bound says it stays there, and the
# error must not be zero (the policy really took effect).
LOW_PRECISION = {
    "bf16_params_fp32_reduce": (dict(fsdp_param_dtype="bf16"), 0.15),
    "bf16_params_bf16_reduce": (dict(fsdp_param_dtype="bf16", fsdp_reduce_dtype="param"), 0.15),
    "fp16_params_fp32_reduce": (dict(fsdp_param_dtype="fp16"), 0.05),
}


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_low_precision_fsdp2_steps_like_fp32_ddp_within_its_rounding(two_ranks, name):
    states = two_ranks[0]
    error = _relative_update_error(
        _state(states, f"low_{name}"), _state(states, "low_ddp"), _state(states, "low_initial")
    )
    bound = LOW_PRECISION[name][1]
    assert 0 < error < bound, f"{name}: the update differs from fp32 DDP's by {error:.1%}, bound {bound:.0%}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", LOW_PRECISION)
def test_zero3_under_a_precision_policy_steps_as_fsdp2_under_it(two_ranks, three_ranks, world_size, name):
    """The same --fsdp-param-dtype/--fsdp-reduce-dtype drive the course's ZeRO-3: gathered and computed in the
    low dtype, its fp32 shards stepped. Its update is FSDP2's to within FSDP2's own distance from fp32 DDP
    (only the order of the sums differs: both round the same forward and backward), and is not DDP's."""
    states = (two_ranks if world_size == 2 else three_ranks)[0]
    initial, ddp, fsdp = _state(states, "low_initial"), _state(states, "low_ddp"), _state(states, f"low_{name}")
    zero3 = _state(states, f"low_zero3_{name}")
    fsdp_from_ddp = _relative_update_error(fsdp, ddp, initial)
    zero3_from_fsdp = _relative_update_error(zero3, fsdp, initial)
    distances = f"{name}: {zero3_from_fsdp:.2%} from FSDP2; FSDP2 {fsdp_from_ddp:.2%} from DDP"
    assert zero3_from_fsdp < fsdp_from_ddp / 2, distances
    assert _relative_update_error(zero3, ddp, initial) > 0, "the policy took no effect"


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_in_fp16_with_its_scaler_equals_its_reference(two_ranks, strategy):
    """--precision fp16 (autocast and a loss scaler whose inf check all ranks share) trains the course's ZeRO
    stages as torch trains the same thing: ZeRO-3 as FSDP2, ZeRO-1 and ZeRO-2 as DDP. Both compute in the same
    dtypes, only the order of the sums may differ."""
    reference = "fsdp" if strategy == "zero3" else "ddp"
    for rank in two_ranks:
        zero, torch_run = _state(rank, f"fp16_{strategy}"), _state(rank, f"fp16_{reference}")
        assert_same_state(zero, torch_run, label=f"{strategy} against {reference} in fp16")
        initial = _state(rank, "low_initial")
        assert any(not torch.allclose(initial[k], zero[k]) for k in zero), "no fp16 step was taken"
