"""The pinned-memory and FSDP2 chapters' pictures: each drawn from what the course's code does, and checked
against it (the stream model's intervals for a copy's path; the real trace of fully_shard on gloo ranks for an
FSDP unit's gathers and reduce-scatters)."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.predict import stream_scenarios  # noqa: E402
from distlab.predict.streams import HOST, Inputs  # noqa: E402

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
SLOW_HOST = Inputs(link_GBps=15.75, stage_GBps=8.0, api_s=5e-6)  # staging slower than the link: the host sets the pace
FAST_HOST = Inputs(link_GBps=15.75, stage_GBps=30.0, api_s=5e-6)  # faster: the host waits for a buffer between chunks


@pytest.mark.parametrize("inputs", [SLOW_HOST, FAST_HOST], ids=["slow-staging", "fast-staging"])
def test_a_pageable_copy_is_staged_chunk_by_chunk_through_two_buffers_and_holds_the_host(inputs):
    path = stream_scenarios.copy_path(inputs, 9 * MiB, pinned=False, non_blocking=False)
    assert path.chunks == (2 * MiB,) * 4 + (1 * MiB,) and sum(path.chunks) == 9 * MiB
    assert path.sent == tuple((i.start, i.end) for i in path.call.device)  # the model's own DMA per chunk
    assert path.slots == (0, 1, 0, 1, 0)
    rate = inputs.stage_rate(path.nbytes) * 1e9
    for (s0, s1), (d0, _), size in zip(path.staged, path.sent, path.chunks):
        assert s1 - s0 == pytest.approx(size / rate) and s1 <= d0 + 1e-12  # staged before it is sent
    staging = sum(i.duration for i in path.timeline.on(HOST, "stage"))
    assert sum(s1 - s0 for s0, s1 in path.staged) == pytest.approx(staging)  # every staging interval accounted for
    assert path.call.returned >= path.sent[-1][1]  # blocking: the host is held until the last chunk lands


def test_a_pinned_non_blocking_copy_is_one_dma_and_the_call_returns_at_once():
    path = stream_scenarios.copy_path(SLOW_HOST, 8 * MiB, pinned=True, non_blocking=True)
    (dma,) = path.call.device
    assert set(path.sent) == {(dma.start, dma.end)} and set(path.staged) == {None}
    assert path.call.host_blocked_s == pytest.approx(SLOW_HOST.api_s) and SLOW_HOST.api_s < dma.duration
    assert not path.timeline.on(HOST, "stage") and not path.timeline.on(HOST, "wait")


@pytest.mark.parametrize("inputs", [SLOW_HOST, FAST_HOST], ids=["slow-staging", "fast-staging"])
@pytest.mark.parametrize("pinned", [False, True])
def test_the_copy_path_picture_shows_what_the_model_runs_at_every_moment(inputs, pinned):
    """At each moment the picture's arrows are the copies the model runs then: a staging copy when the host lane
    is staging, a DMA per chunk the copy engine is sending; GPU memory holds exactly the chunks that have landed."""
    path = stream_scenarios.copy_path(inputs, 8 * MiB, pinned=pinned, non_blocking=pinned)
    stages = path.timeline.on(HOST, "stage")
    for k in range(1, 400):
        t = path.timeline.end * k / 400
        rows, held, sends = plots.copy_path_holdings(path, t)
        gpu = len(rows) - 1
        assert rows[gpu] == "GPU memory" and rows[0] == ("pinned RAM" if pinned else "pageable RAM")
        staging = [s for s in sends if s[2] == 1 and not pinned]
        dmas = [s for s in sends if s[2] == gpu]
        assert len(staging) == sum(i.start <= t < i.end for i in stages), t
        assert len(dmas) == sum(i.start <= t < i.end for i in path.call.device) * (len(path.chunks) if pinned else 1)
        landed = {k for k, (_, end) in enumerate(path.sent) if end <= t}
        assert {k for k, cell in enumerate(held[gpu]) if cell} == landed
        assert held[0] == [f"c{k}" for k in range(len(path.chunks))]  # a copy leaves its source as it was


def test_the_copy_path_figure_is_labelled_a_prediction_and_draws_both_paths():
    axes = plots.plot_copy_paths(SLOW_HOST, 8 * MiB, caption=SLOW_HOST.describe())
    fig = axes[0][0].figure
    assert "predicted by the stream model" in fig._suptitle.get_text()
    assert "pageable" in axes[0][0].get_title() and "pinned" in axes[1][0].get_title()
    for (left, right), pinned in zip(axes, (False, True)):
        path = stream_scenarios.copy_path(SLOW_HOST, 8 * MiB, pinned=pinned, non_blocking=pinned)
        t = right.lines[-1].get_xdata()[0] / 1e3  # the moment drawn on the left, marked on the timeline
        _, _, sends = plots.copy_path_holdings(path, t)
        outlined = [p for p in left.patches if isinstance(p, Rectangle) and not p.get_fill()]
        assert len(outlined) == len(sends) > 0
        assert f"{path.call.host_blocked_s * 1e3:.3f} ms" in right.get_title(loc="left")
    matplotlib.pyplot.close(fig)


# -- FSDP2: an FSDP unit's gathers and reduce-scatters, from the trace of the chapter's own fully_shard code -------

UNITS = [("layer 0", [(16, 16), (16,)]), ("layer 2", [(8, 16), (8,)])]  # the page's Linear(16, 16), Linear(16, 8)


def _page_function(tmp_path, name: str = "one_fsdp_step"):
    """The chapter's own function, cut from its code cell and imported from a file (so it can travel to ranks)."""
    import importlib.util

    page = (ROOT / "book" / "fsdp2_in_practice.md").read_text()
    start = page.index("import torch\nimport torch.distributed as dist\nfrom torch.distributed.device_mesh")
    source = page[start : page.index("runs = run_on_ranks(", start)]
    assert f"def {name}():" in source and "fully_shard(model, mesh=mesh)" in source
    path = tmp_path / "fsdp_page_code.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fsdp_page_code", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_the_fsdp2_picture_draws_the_collectives_fully_shard_really_ran(tmp_path):
    """The chapter's fully_shard step on 2 gloo ranks, traced: each unit all-gathered twice (forward, then again
    for backward: it was freed in between) with its whole padded bytes, one reduce-scatter per unit; the picture's
    frames outline, on every rank, the unit each traced call moved, and leave every rank its rows' gradient sum."""
    from distlab.exercises import run_on_ranks

    runs = run_on_ranks(_page_function(tmp_path), ranks=2, timeout_s=120)
    assert [run.printed for run in runs] == [[f"rank {r}: holds 204 of the model's 408 values"] for r in range(2)]
    ops = [[call["op"] for call in run.calls] for run in runs]
    assert ops[0] == ops[1]
    gathered = {"layer 0": 2 * (8 * 16 + 8) * 4, "layer 2": 2 * (4 * 16 + 4) * 4}  # every rank's rows, fp32
    gathers = [call for call in runs[0].calls if call["op"].startswith("all_gather")]
    reduces = [call for call in runs[0].calls if call["op"].startswith("reduce_scatter")]
    assert sorted(call["bytes"] for call in gathers) == sorted(2 * list(gathered.values()))
    assert len(reduces) == len(UNITS) and len(runs[0].calls) == len(gathers) + len(reduces)
    for call in reduces:  # where the trace holds a reduce-scatter's bytes, they are one rank's rows
        assert call.get("bytes") in (None, *(b // 2 for b in gathered.values()))
    frames = plots.fsdp_unit_frames(runs[0].calls, UNITS, 2)
    assert len(frames) == 1 + len(runs[0].calls)
    names = [name for name, _ in UNITS]
    for frame, call in zip(frames[1:], runs[0].calls):
        unit = frame["unit"]
        column = unit if call["op"].startswith("all_gather") else len(UNITS) + unit
        assert frame["sends"] == [(0, column, None), (1, column, None)]  # every rank, into one collective
        if call["op"].startswith("all_gather"):
            assert call["bytes"] == gathered[names[unit]] and [row[unit] for row in frame["held"]] == ["whole"] * 2
    assert [frame["unit"] for frame in frames[1:] if frame["op"].startswith("all_gather")].count(0) == 2
    assert frames[-1]["held"] == [
        ["rows\n0-7", "rows\n0-3", "0+1\nrows\n0-7", "0+1\nrows\n0-3"],
        ["rows\n8-15", "rows\n4-7", "0+1\nrows\n8-15", "0+1\nrows\n4-7"],
    ]
    for frame, call in zip(frames[1:], runs[0].calls):  # the number the tracer recorded is the one the frame names
        whole = gathered[names[frame["unit"]]]
        assert (frame["layer_bytes"], frame["piece_bytes"], frame["sent_bytes"]) == (whole, whole // 2, whole // 2)
        named = frame["layer_bytes"] if call["op"].startswith("all_gather") else frame["piece_bytes"]
        assert frame["traced_bytes"] == call.get("bytes") and call.get("bytes") in (None, named)
    fig = plots.plot_fsdp_unit_steps(runs[0].calls, UNITS, 2, caption="traced")
    outlined = [p for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(outlined) == 2 * len(runs[0].calls) and "traced" in fig._suptitle.get_text()
    matplotlib.pyplot.close(fig)


def test_an_all_gather_that_matches_no_unit_is_refused():
    with pytest.raises(ValueError, match="matches no unit"):
        plots.fsdp_unit_frames([{"op": "all_gather_single", "bytes": 100}], UNITS, 2)


# rank 0's trace of the page's step (content review 5): 2 ranks, and 3 (not on the page); layer 0 forward, layer 2
# forward, layer 2 backward, layer 0 backward (prefetched), then the two reduce-scatters, layer 2's first
TRACES = {
    2: [("all_gather_single", b) for b in (1088, 544, 544, 1088)] + [("reduce_scatter_single", b) for b in (272, 544)],
    3: [("all_gather_single", b) for b in (1224, 612, 612, 1224)] + [("reduce_scatter_single", b) for b in (204, 408)],
}


@pytest.mark.parametrize("world", [2, 3])
def test_each_fsdp2_panel_names_the_layer_and_what_a_rank_sends_of_it(world):
    """The tracer records an all-gather's whole layer but a reduce-scatter's one-rank piece; every title gives what
    a rank sends, (n-1)/n of the layer, and the layer, for both kinds, so a reduce-scatter does not read as half an
    all-gather; the frame names each number."""
    calls = [{"op": op, "bytes": size} for op, size in TRACES[world]]
    frames = plots.fsdp_unit_frames(calls, UNITS, world)
    layer = {0: TRACES[world][0][1], 1: TRACES[world][1][1]}  # the units' whole padded bytes, as gathered
    for frame, (op, traced) in zip(frames[1:], TRACES[world]):
        whole = layer[frame["unit"]]
        assert frame["layer_bytes"] == whole and frame["piece_bytes"] == whole // world
        assert frame["traced_bytes"] == (whole if op.startswith("all_gather") else whole // world) == traced
        assert frame["sent_bytes"] == (world - 1) * whole // world
        assert f"sends {(world - 1) * whole // world} B of the {whole} B layer" in frame["title"]
    no_bytes = [{"op": op} if op.startswith("reduce") else {"op": op, "bytes": b} for op, b in TRACES[world]]
    assert [f["title"] for f in plots.fsdp_unit_frames(no_bytes, UNITS, world)] == [f["title"] for f in frames]


def test_the_fsdp2_panel_where_backward_gathers_ahead_names_the_prefetch():
    """Layer 0 is gathered for its backward while layer 2's gradient still waits for its reduce-scatter: FSDP2's
    backward prefetch, said in that panel's title and no other."""
    frames = plots.fsdp_unit_frames([{"op": op, "bytes": b} for op, b in TRACES[2]], UNITS, 2)
    assert [frame["prefetch"] for frame in frames] == [False] * 4 + [True, False, False]
    assert "before layer 2's gradient is reduce-scattered: FSDP2's backward prefetch" in frames[4]["title"]
    assert [i for i, frame in enumerate(frames) if "prefetch" in frame["title"]] == [4]
    assert [frame["phase"] for frame in frames] == [None, "forward", "forward"] + ["backward"] * 4


def fsdp2_gradient_against_one_process() -> dict:
    """The page's model under fully_shard, each rank its own batch; whether each rank's gradient rows are the
    average over the ranks of one process's gradients on every rank's batch, or their sum."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    reference = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    reference.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(1 + r)) for r in range(world)]
    model(batches[rank]).square().mean().backward()
    for batch in batches:
        reference(batch).square().mean().backward()  # the sum over the ranks' losses
    found = {"average": True, "sum": True}
    for p, q in zip(model.parameters(), reference.parameters()):
        local = p.grad.to_local()
        start = rank * -(-q.shape[0] // world)
        rows = q.grad[start : start + local.shape[0]]
        found["average"] &= bool(torch.allclose(local, rows / world, atol=1e-6))
        found["sum"] &= bool(torch.allclose(local, rows, atol=1e-6))
    return found


def test_the_fsdp2_picture_says_what_fully_shard_leaves_each_rank_the_average_of_its_rows():
    """FSDP2's reduce-scatter leaves each rank the average of its rows over the ranks, not their sum (measured on 2
    gloo ranks); every reduce-scatter panel says so, and no text of the figure says "sum"."""
    from distlab.exercises import run_on_ranks

    runs = run_on_ranks(fsdp2_gradient_against_one_process, ranks=2, timeout_s=120)
    assert [run.returned for run in runs] == [{"average": True, "sum": False}] * 2
    calls = [{"op": op, "bytes": b} for op, b in TRACES[2]]
    reduced = [f for f in plots.fsdp_unit_frames(calls, UNITS, 2) if (f["op"] or "").startswith("reduce")]
    assert len(reduced) == 2 and all("each rank keeps the average over its rows" in f["title"] for f in reduced)
    fig = plots.plot_fsdp_unit_steps(calls, UNITS, 2, caption="traced")
    texts = [t.get_text() for t in fig.findobj(Text)]
    assert not [t for t in texts if re.search(r"\bsum\b", t)]
    matplotlib.pyplot.close(fig)
