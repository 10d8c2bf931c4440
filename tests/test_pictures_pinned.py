"""The pinned-memory chapter's picture, drawn from what the course's code does and checked against it (the stream
model's intervals for a copy's path)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from distlab import plots  # noqa: E402
from distlab.predict import stream_scenarios  # noqa: E402
from distlab.predict.streams import HOST, Inputs  # noqa: E402

MiB = 1 << 20
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
