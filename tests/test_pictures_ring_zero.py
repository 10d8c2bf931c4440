"""The ring and ZeRO chapters' pictures draw what the code really sends: the ring's strip (P3) and the bridge to
sharding (P5) against traces of the library's ring and of the page's readable ring on 3 gloo ranks; the bytes per
rank (P4) against traces at 2, 3 and 4 ranks and the committed bench records; the flat buffer's shards (P7) against
a traced reduce-scatter and all-gather; the ZeRO bars (P6) against the committed measured bytes; one step's
collectives (P8) against the step bench's counted traffic and a real step's collectives in the order it called them.
"""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.comm import collectives as hand_written
from distlab.comm.collectives import Traffic, ring_all_reduce, ring_reduce_scatter, segment_bounds
from distlab.comm.traffic import TrafficCounter
from distlab.exercises import run_on_ranks
from distlab.exercises.solutions.ring import ring_all_reduce as readable_ring_all_reduce
from distlab.models import build_model
from distlab.parallel import TorchDDP, Zero1, Zero2, Zero3
from distlab.parallel.flat_param import all_gather_flat, reduce_scatter_flat
from distlab.plots import (
    plot_bytes_per_rank,
    plot_ring_steps,
    plot_shard_steps,
    plot_sharding_bridge,
    plot_state_bars,
    plot_step_collectives,
    step_call_order,
)
from distlab.plots.collectives import shard_frames
from distlab.plots.memory import STATE
from distlab.plots.ring_animation import after_reduce_scatter, ring_steps
from distlab.predict.costmodel import RING_FACTOR, collective_calls
from distlab.predict.memory import expected_state_bytes, shard_unit_shapes
from distlab.results import committed_results, read_result
from distlab.testing import run_ranks

RING_LENGTHS = (7, 8)  # on 3 ranks: segments of 3, 2, 2 and of 3, 3, 2 values, which together tell every segment
BENCH_BYTES = 4096  # the committed all-reduce sweeps' smallest message
SHARD_NUMEL = 5  # the ZeRO page's flat buffer: 5 values, padded to 3 shards of 2


def rings_and_shards() -> dict:
    """On each rank, separated by barriers: the library's ring and the page's readable ring on each length; the
    library's reduce-scatter alone on rank-coded data; the three hand-written all-reduces of one bench message
    with their own counts; the ZeRO page's reduce-scatter then all-gather of a padded flat buffer."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in RING_LENGTHS:
        ring_all_reduce(torch.ones(numel))
        dist.barrier()
        readable_ring_all_reduce(torch.ones(numel))
        dist.barrier()
    coded = torch.full((3 * n,), float(2**rank))  # a sum of 2**r over the ranks r whose data it holds
    ring_reduce_scatter(coded)
    dist.barrier()
    counted = all_reduces_counted()
    size = -(-SHARD_NUMEL // n)
    flat = torch.zeros(size * n)
    flat[:SHARD_NUMEL] = torch.arange(SHARD_NUMEL) + 10.0 * rank
    with TrafficCounter(n) as shards:
        shard = reduce_scatter_flat(flat, size)
        gathered = all_gather_flat(shard, size * n)
    summed = flat.clone()
    dist.all_reduce(summed)
    return {"coded": coded, "counted": counted, "shard": shard, "gathered": gathered, "summed": summed,
            "flat": flat, "shard_traffic": shards.summary()}  # fmt: skip


def all_reduces_counted() -> dict:
    """The three hand-written all-reduces of one bench message, separated by barriers, with their own counts."""
    counted = {}
    for name, all_reduce in hand_written.ALL_REDUCES.items():
        traffic = Traffic()
        all_reduce(torch.ones(BENCH_BYTES // 4), traffic=traffic)
        counted[name] = traffic.bytes_sent
        dist.barrier()
    return counted


@pytest.fixture(scope="module")
def three_ranks():
    return run_on_ranks(rings_and_shards, ranks=3, timeout_s=60)


def _parts(calls: list[dict]) -> list[list[dict]]:
    """A rank's calls, cut at each barrier."""
    parts, current = [], []
    for call in calls:
        if call["op"] == "barrier":
            parts.append(current)
            current = []
        else:
            current.append(call)
    return parts + [current]


def _segment(bytes_by_length: tuple[int, int]) -> int:
    """Which of 3 segments a message was, from its bytes on the two lengths (segments 3,2,2 and 3,3,2 values)."""
    sizes = {numel: [4 * (b - a) for a, b in segment_bounds(numel, 3)] for numel in RING_LENGTHS}
    found = [s for s in range(3) if all(sizes[numel][s] == b for numel, b in zip(RING_LENGTHS, bytes_by_length))]
    assert len(found) == 1, bytes_by_length
    return found[0]


def _traced_hops(runs, which: int) -> list[dict]:
    """Per hop, the sends of every rank, decoded from the traces of one ring (0: library, 1: readable) on both
    lengths: ``{rank: (segment, peer)}``; each rank's receives checked on the way: from rank r-1, of the bytes
    r-1 sent."""
    hops = []
    for run in runs:
        parts = _parts(run.calls)
        per_length = [parts[2 * i + which] for i in range(len(RING_LENGTHS))]
        sends = [[c for c in part if c["op"] == "isend"] for part in per_length]
        for hop, calls in enumerate(zip(*sends)):
            assert len({c["peer"] for c in calls}) == 1
            while len(hops) <= hop:
                hops.append({})
            hops[hop][run.rank] = (_segment(tuple(c["bytes"] for c in calls)), calls[0]["peer"])
    for run in runs:
        parts = _parts(run.calls)
        per_length = [parts[2 * i + which] for i in range(len(RING_LENGTHS))]
        left = (run.rank - 1) % 3
        for i, part in enumerate(per_length):
            received = [c for c in part if c["op"] == "irecv"]
            assert [c["peer"] for c in received] == [left] * len(hops)
            sizes = [4 * (b - a) for a, b in segment_bounds(RING_LENGTHS[i], 3)]
            assert [c["bytes"] for c in received] == [sizes[hops[h][left][0]] for h in range(len(hops))]
    return hops


def _outlined(ax, n: int) -> set[tuple[int, int]]:
    """(rank, column) of every red outline ``plot_holdings`` drew."""
    return {
        (n - 1 - round(p.get_y()), round(p.get_x()))
        for p in ax.patches
        if type(p).__name__ == "Rectangle" and not p.get_fill()
    }


def _labels(ax, n: int, width: int) -> list[list[str]]:
    cells = [[None] * width for _ in range(n)]
    for text in ax.texts:
        x, y = text.get_position()
        cells[n - 1 - round(y - 0.43)][round(x - 0.46)] = text.get_text()
    return cells


def test_the_ring_strip_draws_the_hops_the_library_and_the_page_ring_send(three_ranks):
    strip = ring_steps(3)
    hops = [frame for frame in strip if frame.sends]
    axes = plot_ring_steps(3)
    assert len(axes) == 6 and len(hops) == 4  # start, 2 reduce-scatter hops, 2 all-gather hops, done
    for which in (0, 1):  # the library's pipelined ring; the page's one-segment-a-hop ring
        traced = _traced_hops(three_ranks, which)
        assert len(traced) == len(hops)
        for frame, ax, sent in zip(hops, axes[1:-1], traced):
            assert {(r, seg) for r, seg in frame.sends} == {(r, seg) for r, (seg, _) in sent.items()}
            assert _outlined(ax, 3) == {(r, seg) for r, (seg, _) in sent.items()}
            assert all(peer == (r + 1) % 3 for r, (_, peer) in sent.items())
    assert not _outlined(axes[0], 3) and not _outlined(axes[-1], 3)
    assert _labels(axes[-1], 3, 3) == [["0+1+2"] * 3] * 3
    plt.close("all")


def test_the_bridge_stops_where_the_library_reduce_scatter_stops(three_ranks):
    axes = plot_sharding_bridge(3)
    for run in three_ranks:
        coded = torch.tensor(run.returned["coded"])
        for seg, (a, b) in enumerate(segment_bounds(coded.numel(), 3)):
            ranks = {r for r in range(3) if int(coded[a]) >> r & 1}
            assert torch.all(coded[a:b] == coded[a])
            assert after_reduce_scatter(3).held[run.rank][seg] == ranks
            assert _labels(axes[0], 3, 3)[run.rank][seg] == "+".join(map(str, sorted(ranks)))
        assert _labels(axes[0], 3, 3)[run.rank][(run.rank + 1) % 3] == "0+1+2"  # ZeRO's shard: segment r+1
    strip = plot_ring_steps(3)
    for bridge_ax, strip_ax in zip(axes[1:-1], strip[3:5]):  # the all-gather hops, checked against the trace above
        assert _outlined(bridge_ax, 3) == _outlined(strip_ax, 3) and _outlined(bridge_ax, 3)
    assert "stop here: ZeRO's gradient shard" in axes[0].get_title().replace("\n", " ")
    assert all("ZeRO-3's gather" in ax.get_title() for ax in axes[1:-1])
    plt.close("all")


def _bench_record(n: int, counted: dict, environment: dict) -> dict:
    rows = [{"impl": impl, "bytes": BENCH_BYTES, "bytes_sent_per_rank": sent} for impl, sent in counted.items()]
    return {"metrics": rows, "environment": environment | {"world_size": n}}


def _traced_sent(run, parts: slice) -> list[int]:
    return [sum(c["bytes"] for c in part if c["op"] == "isend") for part in _parts(run.calls)[parts]]


def test_the_bytes_per_rank_are_the_bytes_the_all_reduces_send():
    committed = {n: read_result(committed_results("ring", f"allreduce-{n}xcpu.json")) for n in (2, 4)}
    traced = {n: run_on_ranks(all_reduces_counted, ranks=n, timeout_s=60) for n in (2, 4)}
    records = {}
    for n, runs in traced.items():
        rank0, impls = runs[0], list(hand_written.ALL_REDUCES)
        assert _traced_sent(rank0, slice(0, 3)) == [rank0.returned[impl] for impl in impls]
        at_bench = {r["impl"]: r["bytes_sent_per_rank"] for r in committed[n]["metrics"] if r["bytes"] == BENCH_BYTES}
        assert [rank0.returned[impl] for impl in impls] == [at_bench[impl] for impl in impls]
        records[n] = _bench_record(n, rank0.returned, committed[n]["environment"])
    ax = plot_bytes_per_rank(records)
    heights = [p.get_height() for p in ax.patches]
    expected = [records[n]["metrics"][i]["bytes_sent_per_rank"] / BENCH_BYTES for i in range(3) for n in (2, 4)]
    assert heights == pytest.approx(expected)
    assert heights == pytest.approx([1.0, 1.5, 1.0, 3.0, 1.0, 3.0])  # ring, whole-tensor ring, reduce-broadcast
    assert "counted" in ax.get_title() and "measured on" in ax.get_title()
    plt.close("all")


def test_the_bytes_per_rank_at_three_ranks_are_the_traced_bytes(three_ranks):
    rank0, impls = three_ranks[0], list(hand_written.ALL_REDUCES)
    first = 2 * len(RING_LENGTHS) + 1  # after the rings and the reduce-scatter
    assert _traced_sent(rank0, slice(first, first + 3)) == [rank0.returned["counted"][i] for i in impls]
    in_s = [rank0.returned["counted"][i] / BENCH_BYTES for i in impls]
    assert in_s == pytest.approx([4 / 3, 2.0, 2.0], rel=1e-3)  # 1024 values cut 342, 341, 341: a little over 4/3


def test_the_flat_buffers_shards_are_what_reduce_scatter_and_all_gather_move(three_ranks):
    n, size = 3, -(-SHARD_NUMEL // 3)
    columns, frames = shard_frames(n, SHARD_NUMEL)
    flats = [torch.tensor(run.returned["flat"]) for run in three_ranks]
    for run in three_ranks:
        collectives = [c for c in _parts(run.calls)[-1] if c["op"] != "all_reduce"]
        # torch 2.14 names them reduce_scatter_single and all_gather_single; torch 2.10 (Kaggle's) the _tensor forms
        assert [re.sub(r"_(single|tensor|into_tensor)$", "", c["op"]) for c in collectives] == [
            "reduce_scatter",
            "all_gather",
        ]
        assert [c["bytes"] for c in collectives] == [4 * size, 4 * size * n]  # the outputs: one shard, all of them
        traffic = run.returned["shard_traffic"]
        into_scatter = traffic["reduce_scatter"]["bytes_sent"] * n / (n - 1)
        into_gather = traffic["all_gather"]["bytes_sent"] * n / (n - 1) / n
        (_, _, scatter_sends), (_, kept, gather_sends), (_, done, _) = frames
        assert 4 * size * len([s for s in scatter_sends if s[0] == run.rank]) == into_scatter
        assert 4 * size * len([s for s in gather_sends if s[0] == run.rank]) == into_gather
        mine = [c for c in range(n) if kept[run.rank][c] == frozenset(range(n))]
        assert mine == [run.rank]
        expected = sum(flat[run.rank * size : (run.rank + 1) * size] for flat in flats)
        assert torch.equal(torch.tensor(run.returned["shard"]), expected)
        assert run.returned["gathered"] == run.returned["summed"]
        assert all(cell == frozenset(range(n)) for row in done for cell in row)
    assert columns[-1].endswith("+1 pad") and len(columns) == n
    axes = plot_shard_steps(n, SHARD_NUMEL)
    for ax, (_, _, sends) in zip(axes, frames):
        assert _outlined(ax, n) == {(r, c) for r, c, _ in sends}
    plt.close("all")


def test_the_zero_bars_are_the_memory_model_and_its_measured_twin():
    psi = 7_000_000_000
    axes = plot_state_bars(psi, world_sizes=(4, 8), precisions=("fp32", "mixed"))
    for ax, precision in zip(axes, ("fp32", "mixed")):
        bars = [p for p in ax.patches if type(p).__name__ == "Rectangle"]
        expected = [
            expected_state_bytes(psi, strategy, n, "adam", precision)[category] / 1e9
            for category in STATE
            for n in (4, 8)
            for strategy in ("ddp", "zero1", "zero2", "zero3")
        ]
        assert [b.get_height() for b in bars] == pytest.approx(expected)
    assert "predicted" in axes[0].figure.texts[0].get_text()
    plt.close("all")
    units = shard_unit_shapes(build_model("gpt-tiny"))
    for n in (2, 3, 4):
        record = read_result(committed_results("zero", f"memory-gpt-tiny-{n}xcpu.json"))
        parameters = record["metrics"]["parameters"]
        axes = plot_state_bars(parameters, world_sizes=(n,), precisions=("fp32",), units=units)
        bars = [p.get_height() * 1e9 for p in axes[0].patches if type(p).__name__ == "Rectangle"]
        rows = {row["strategy"]: row["memory"]["ranks"][0] for row in record["metrics"]["variants"]}
        measured = [rows[s][category] for category in STATE for s in ("ddp", "zero1", "zero2", "zero3")]
        assert bars == pytest.approx(measured, abs=1e-3)
        plt.close("all")


STEP_ROWS = {"DDP": "ddp", "ZeRO-1": "zero1", "ZeRO-2": "zero2", "ZeRO-3": "zero3", "ZeRO-3 kept": "zero3-no-reshard"}


class CallOrder(TrafficCounter):
    """A traffic counter that also keeps each collective, with the bytes it counted, in the order it was called."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.order: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = dict(self.bytes_sent)
        result = super().__torch_dispatch__(func, types, args, kwargs)
        self.order += [(name, sent - before.get(name, 0)) for name, sent in self.bytes_sent.items()
                       if sent != before.get(name, 0)]  # fmt: skip
        return result


def second_step_in_order(runtime) -> dict:
    """Per strategy, the collectives of its second step of gpt-tiny, in call order (broadcasts left out)."""
    strategies = {
        "ddp": TorchDDP(),
        "zero1": Zero1(collectives="torch"),
        "zero2": Zero2(collectives="torch"),
        "zero3": Zero3(collectives="torch"),
        "zero3-no-reshard": Zero3(reshard_after_forward=False, collectives="torch"),
    }
    found = {}
    for name, strategy in strategies.items():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = strategy.wrap(build_model("gpt-tiny"), runtime)
        stepper = strategy.make_optimizer(model, lambda params: torch.optim.Adam(params, lr=1e-3))
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(runtime.rank))
        for _ in range(2):
            with CallOrder(runtime.world_size) as counted:
                F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
                stepper.step()
                stepper.zero_grad(set_to_none=True)
        found[name] = [call for call in counted.order if call[0] != "broadcast"]
    return found


def test_one_steps_collectives_are_the_step_benchs_traffic_in_the_order_a_real_step_calls_them(tmp_path):
    units = shard_unit_shapes(build_model("gpt-tiny"))
    rows = {label: step_call_order(v, collective_calls(v, units, 2, "gloo")) for label, v in STEP_ROWS.items()}
    # the totals: the step bench's counted traffic (the committed 2-rank runs of the ZeRO page)
    counted = {
        row["strategy"]: sum(t["bytes_sent"] for name, t in row["traffic"].items() if name != "broadcast")
        for row in read_result(committed_results("zero", "memory-gpt-tiny-2xcpu.json"))["metrics"]["variants"]
    }
    keep = read_result(committed_results("zero", "memory-gpt-tiny-keep-2xcpu.json"))["metrics"]["variants"]
    counted["zero3-no-reshard"] = sum(t["bytes_sent"] for t in keep[0]["traffic"].values())
    assert keep[0]["strategy"] == "zero3"
    sent = {v: [(c, RING_FACTOR[c](2) * size) for c, _, size in rows[label]] for label, v in STEP_ROWS.items()}
    for variant, boxes in sent.items():
        assert sum(b for _, b in boxes) == pytest.approx(counted[variant]), variant
    # the boxes, one by one: a real step's collectives in the order it called them
    stepped = run_ranks(second_step_in_order, 2, tmp_path)
    for found in stepped:
        for variant, boxes in sent.items():
            assert [(c, pytest.approx(b)) for c, b in boxes] == found[variant], variant
    ax = plot_step_collectives(rows, 2)
    drawn = [p for p in ax.patches if type(p).__name__ == "Rectangle" and p.get_width() > 0 and p.get_height() == 0.7]
    widths = [b / 2**10 for boxes in sent.values() for _, b in boxes]
    assert [p.get_width() for p in drawn] == pytest.approx(widths)
    plt.close("all")
