"""Bytes each rank sends per optimizer step, counted from the collectives it
really calls, equal the derivation for every strategy: DDP, ZeRO-1 and ZeRO-2
2Ψ(n-1)/n, ZeRO-3 3Ψ(n-1)/n."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.comm.traffic import TrafficCounter
from distlab.models import build_model
from distlab.parallel import BucketedDDPStrategy, NaiveDDPStrategy, TorchDDP, Zero1, Zero2, Zero3
from distlab.parallel.base import MixedPrecision
from distlab.predict.costmodel import RING_FACTOR, collective_calls
from distlab.predict.memory import parameter_shapes, shard_unit_shapes
from distlab.predict.traffic import expected_bytes_per_step

VARIANTS = {
    "ddp": TorchDDP(),
    "naive_ddp": NaiveDDPStrategy(),
    "bucketed_ddp": BucketedDDPStrategy(),
    "zero1": Zero1(collectives="torch"),
    "zero2": Zero2(collectives="torch"),
    "zero2_ring": Zero2(collectives="ring"),
    "zero3": Zero3(collectives="torch"),
    "zero3_ring": Zero3(collectives="ring"),  # the same bytes, sent as the ring's point-to-point messages
}
LOW = {  # gathered in bf16; gradients reduced in fp32 (the default), or in bf16
    "zero3_bf16": Zero3(collectives="torch", precision=MixedPrecision(torch.bfloat16, torch.float32)),
    "zero3_bf16_reduce": Zero3(collectives="torch", precision=MixedPrecision(torch.bfloat16)),
}


def second_step_counted(runtime, strategies, model_name, batch, optimizer=torch.optim.Adam) -> dict:
    """Per strategy, what each collective sent in the second step of ``model_name`` (the first may set things up:
    torch DDP rebuilds its buckets after it)."""
    sent = {}
    for name, strategy in strategies.items():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = strategy.wrap(build_model(model_name), runtime)
        stepper = strategy.make_optimizer(model, lambda params: optimizer(params, lr=1e-3))
        tokens = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(runtime.rank))
        for _ in range(2):
            with TrafficCounter(runtime.world_size) as counted:
                F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
                stepper.step()
                stepper.zero_grad(set_to_none=True)
        sent[name] = counted.summary()
    return sent


def one_step_counted(runtime):
    return second_step_counted(runtime, VARIANTS | LOW, "gpt-tiny", batch=2)


def _padded(parameters: int, n: int) -> int:
    return -(-parameters // n) * n


def _expected(strategy: str, n: int) -> float:
    """The derivation, for the values each strategy's collectives move: its flat buffers are
    padded to a multiple of n (one for zero1/zero2, one per shard unit for zero3, whose
    root unit, last in the list, is gathered once); DDP's buckets are not padded."""
    model = build_model("gpt-tiny")
    if strategy.startswith("zero3"):
        units = [_padded(sum(shape.numel() for shape in unit), n) for unit in shard_unit_shapes(model)]
        return expected_bytes_per_step("zero3", sum(units), n, gathered_once=units[-1])
    parameters = sum(p.numel() for p in model.parameters())  # the tied head counts once
    return expected_bytes_per_step(strategy, _padded(parameters, n) if strategy.startswith("zero") else parameters, n)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_sent_per_step_equal_the_derivation(request, world_size):
    ranks = request.getfixturevalue(f"ranks{world_size}").run(one_step_counted)
    for sent in ranks:
        for name in VARIANTS:
            # torch DDP also broadcasts a few bytes of bookkeeping in every forward: counted, not gradients
            bookkeeping = sent[name].pop("broadcast", {"bytes_sent": 0})["bytes_sent"]
            assert bookkeeping < 1024, (name, bookkeeping)
            total = sum(entry["bytes_sent"] for entry in sent[name].values())
            expected = _expected(VARIANTS[name].predicted_by, world_size)
            assert total == pytest.approx(expected, rel=1e-9), (name, sent[name])
    zero1, zero2, zero3 = ranks[0]["zero1"], ranks[0]["zero2"], ranks[0]["zero3"]
    assert set(zero1) == set(zero2) == set(zero3) == {"reduce_scatter", "all_gather"}
    assert zero1 == zero2  # the same collectives: only when they run differs
    # a 2-byte dtype halves what it moves: the gathers in bf16, and the reduce-scatter when it is bf16 too
    for name, gather, scatter in (("zero3_bf16", 0.5, 1.0), ("zero3_bf16_reduce", 0.5, 0.5)):
        low = ranks[0][name]
        assert low["all_gather"]["bytes_sent"] == gather * zero3["all_gather"]["bytes_sent"], name
        assert low["reduce_scatter"]["bytes_sent"] == scatter * zero3["reduce_scatter"]["bytes_sent"], name
    # ZeRO-3 gathers every unit twice (forward, backward) but the root once, and reduce-scatters each once
    assert (
        zero3["reduce_scatter"]["bytes_sent"]
        < zero3["all_gather"]["bytes_sent"]
        < 2 * zero3["reduce_scatter"]["bytes_sent"]
    )


def calls_on_gpt_mini(runtime):
    """torch DDP at its default buckets and the course's ZeRO-2 (torch's collectives), one counted step of gpt-mini."""
    strategies = {"ddp": TorchDDP(), "zero2": Zero2(collectives="torch")}
    return second_step_counted(runtime, strategies, "gpt-mini", batch=1, optimizer=torch.optim.SGD)


def test_the_cost_model_lists_the_buckets_torch_ddp_and_zero2_really_reduce(ranks2):
    # gpt-mini's gradients fill several buckets: torch DDP's 1 MiB first one, then 25 MB ones closed once
    # they reach the cap; ZeRO-2's 5 MB buckets, each reduce-scattered and all-gathered
    model = build_model("gpt-mini", device="meta")
    units, order = shard_unit_shapes(model), parameter_shapes(model)
    counted = ranks2.run(calls_on_gpt_mini)[0]
    for name in ("ddp", "zero2"):
        calls = collective_calls(name, units, 2, "nccl", order=order)
        expected = Counter(collective for collective, _, _ in calls)
        traffic = {collective: entry for collective, entry in counted[name].items() if collective != "broadcast"}
        got = Counter({collective: entry["calls"] for collective, entry in traffic.items()})
        assert got == expected, (name, got, expected)
        sent = sum(RING_FACTOR[collective](2) * size for collective, _, size in calls)
        assert sum(entry["bytes_sent"] for entry in traffic.values()) == pytest.approx(sent), name
    assert expected["reduce_scatter"] > 1 and counted["ddp"]["all_reduce"]["calls"] > 2


def count_each_collective(runtime):
    n = runtime.world_size
    with TrafficCounter(n) as counted:
        dist.all_reduce(torch.ones(120))
        out = torch.empty(120)
        dist.all_gather_into_tensor(out, torch.ones(120 // n))
        dist.reduce_scatter_tensor(torch.empty(120 // n), torch.ones(120))
        dist.broadcast(torch.ones(30), src=0)
    return counted.summary()


def test_each_collective_is_counted_at_the_ring_volume(ranks3):
    for summary in ranks3.run(count_each_collective):
        assert summary["all_reduce"]["bytes_sent"] == pytest.approx(2 * 2 / 3 * 480)
        assert summary["all_gather"]["bytes_sent"] == pytest.approx(2 / 3 * 480)
        assert summary["reduce_scatter"]["bytes_sent"] == pytest.approx(2 / 3 * 480)
        assert summary["broadcast"]["bytes_sent"] == pytest.approx(120)
