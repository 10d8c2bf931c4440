"""Scenarios of the stream model (:mod:`.streams`): the training loop's input pipelines, one copy and its path
chunk by chunk, the D2H hazard, the predictions the chapter draws from them (speed-ups, predicted bandwidth), and
its verdicts on the claims it tests (:func:`claim_range`, :func:`staging_claim`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .streams import DEFAULT, Call, Inputs, StreamModel, Timeline

# -- scenarios ---------------------------------------------------------------------------------------------------


def training_loop(
    inputs: Inputs,
    *,
    batch_bytes: int,
    compute_s: float,
    steps: int = 4,
    load_s: float = 0.0,
    pinned: bool = False,
    non_blocking: bool = False,
    side_stream: bool = False,
    pin_in_loop: bool = False,
    sync_each_step: bool = False,
    title: str = "",
) -> Timeline:
    """``for x in loader: x = x.to(cuda, non_blocking=...); step(x)`` for ``steps`` batches.

    ``load_s``: the main thread's time to get a batch from the loader;
    ``pin_in_loop``: the batch is pinned on the main thread (``num_workers=0``,
    or an explicit ``.pin_memory()``), a host copy at the staging rate;
    ``sync_each_step``: the loop reads the loss every step (``loss.item()``);
    ``side_stream``: each batch is copied on a second stream one step ahead
    (double-buffered: a buffer is refilled once the step that read it is done)."""
    m = StreamModel(inputs)
    pin_s = batch_bytes / (inputs.stage_rate(batch_bytes) * 1e9)

    def fetch(k: int, stream: str) -> Call:
        m.host_work("next(loader)", load_s, step=k)
        if pin_in_loop:
            m.host_work("pin_memory()", pin_s, step=k)
        if side_stream and k >= 2:
            m.wait_event(stream, f"computed {k - 2}")
        return m.copy_h2d(
            f"copy {k}", batch_bytes, pinned=pinned or pin_in_loop, non_blocking=non_blocking, stream=stream, step=k
        )

    calls = {}
    if side_stream:
        calls["copy 0"] = fetch(0, "copy")
        m.record("copied 0", "copy")
    for k in range(steps):
        if side_stream:
            m.wait_event(DEFAULT, f"copied {k}")
        else:
            calls[f"copy {k}"] = fetch(k, DEFAULT)
        calls[f"step {k}"] = m.kernel(f"step {k}", compute_s, step=k)
        m.record(f"computed {k}")
        if side_stream and k + 1 < steps:
            calls[f"copy {k + 1}"] = fetch(k + 1, "copy")
            m.record(f"copied {k + 1}", "copy")
        if sync_each_step:
            m.stream_synchronize(DEFAULT, "loss.item()", step=k)
    m.synchronize()
    return m.timeline(title or "training loop", calls)


def notes_loop(inputs: Inputs, *, optimized: bool, **loop) -> Timeline:
    """The reference notes' two loops: unpinned blocking copies, or ``pin_memory=True`` with
    ``non_blocking=True``; both read ``loss.item()`` every step, as the notes' script does."""
    title = (
        "pin_memory + non_blocking, loss.item() each step" if optimized else "pageable, blocking, loss.item() each step"
    )
    return training_loop(inputs, pinned=optimized, non_blocking=optimized, sync_each_step=True, title=title, **loop)


def same_stream_non_blocking(inputs: Inputs, **loop) -> Timeline:
    """Pinned batches copied with ``non_blocking=True`` on the compute's own stream, no per-step sync."""
    return training_loop(inputs, pinned=True, non_blocking=True, title="pinned + non_blocking, one stream", **loop)


def side_stream_prefetch(inputs: Inputs, *, pinned: bool = True, **loop) -> Timeline:
    """Batch k+1 copied on a side stream while step k computes, from pinned or pageable memory."""
    title = f"{'pinned' if pinned else 'pageable'} + non_blocking, copies on a side stream"
    return training_loop(inputs, pinned=pinned, non_blocking=True, side_stream=True, title=title, **loop)


def pageable_non_blocking(inputs: Inputs, *, small_bytes: int, large_bytes: int, compute_s: float) -> Timeline:
    """A kernel is running; then a small and a large pageable copy with ``non_blocking=True``.
    The small one fits the staging buffers and returns at once; the large one waits for the kernel."""
    m = StreamModel(inputs)
    calls = {"kernel": m.kernel("kernel", compute_s)}
    calls["small"] = m.copy_h2d("small copy", small_bytes, pinned=False, non_blocking=True)
    calls["large"] = m.copy_h2d("large copy", large_bytes, pinned=False, non_blocking=True)
    m.synchronize()
    return m.timeline("pageable + non_blocking: staged, then returns", calls)


def d2h_read_hazard(inputs: Inputs, *, nbytes: int, compute_s: float, pinned: bool = True) -> Timeline:
    """A kernel produces a result, the host copies it back with ``non_blocking=True`` and reads it
    before and after synchronizing. Into pinned memory the first read sees the old contents."""
    m = StreamModel(inputs)
    calls = {"kernel": m.kernel("compute result", compute_s, writes="result on GPU")}
    calls["copy"] = m.copy_d2h("copy to host", nbytes, pinned=pinned, non_blocking=True, into="host buffer")
    m.read("host buffer")
    m.synchronize()
    m.read("host buffer")
    return m.timeline(f"D2H into {'pinned' if pinned else 'pageable'} memory, non_blocking, read twice", calls)


def overlap_experiment(
    inputs: Inputs, *, batches: int, batch_bytes: int, compute_s: float, overlapped: bool
) -> Timeline:
    """:func:`distlab.bench.transfer.overlap_experiment`'s schedule, in the model: pinned batches
    copied with ``non_blocking``, on the compute stream or on a side stream, two device buffers."""
    m = StreamModel(inputs)
    stream = "copy" if overlapped else DEFAULT
    calls = {}
    for k in range(batches):
        if k >= 2:
            m.wait_event(stream, f"computed {k - 2}")  # the buffer being overwritten must be free
        calls[f"copy {k}"] = m.copy_h2d(f"copy {k}", batch_bytes, pinned=True, non_blocking=True, stream=stream, step=k)
        m.record(f"copied {k}", stream)
        m.wait_event(DEFAULT, f"copied {k}")
        calls[f"compute {k}"] = m.kernel(f"compute {k}", compute_s, step=k)
        m.record(f"computed {k}")
    m.synchronize()
    return m.timeline("overlapped" if overlapped else "serial", calls)


def single_copy(inputs: Inputs, nbytes: int, *, pinned: bool, non_blocking: bool, direction: str = "h2d") -> Call:
    """One copy on an idle GPU, as :func:`distlab.bench.transfer.copy_bandwidth` times it."""
    m = StreamModel(inputs)
    copy = m.copy_h2d if direction == "h2d" else m.copy_d2h
    return copy("copy", nbytes, pinned=pinned, non_blocking=non_blocking)


@dataclass(frozen=True)
class CopyPath:
    """One host-to-device copy on an idle GPU, chunk by chunk: when the host thread staged each chunk into a pinned
    buffer (None from pinned memory: nothing is staged) and when the copy engine sent it, in seconds."""

    pinned: bool
    non_blocking: bool
    nbytes: int
    chunk_bytes: int
    chunks: tuple[int, ...]
    """The bytes of each piece the picture follows: the staging chunks, or, from pinned memory, the same cut of
    a source that one DMA sends whole."""
    staged: tuple[tuple[float, float] | None, ...]
    sent: tuple[tuple[float, float], ...]
    slots: tuple[int | None, ...]
    """The staging buffer each chunk went through (None from pinned memory)."""
    call: Call
    timeline: Timeline


def copy_path(inputs: Inputs, nbytes: int, *, pinned: bool, non_blocking: bool) -> CopyPath:
    """:func:`single_copy` with its path: from pageable memory the model's staging intervals on the host lane, cut
    into the chunks they staged (each takes ``chunk / stage_rate``; a wait falls only between chunks), and the
    engine's interval per chunk (the call's own device work); from pinned memory one DMA for the whole source."""
    m = StreamModel(inputs)
    call = m.copy_h2d("copy", nbytes, pinned=pinned, non_blocking=non_blocking)
    timeline = m.timeline(
        f"{'pinned' if pinned else 'pageable'}{', non_blocking' if non_blocking else ', blocking'}", {"copy": call}
    )
    step = inputs.chunk_bytes
    chunks = tuple(min(step, nbytes - offset) for offset in range(0, max(nbytes, 1), step))
    if pinned:
        (dma,) = call.device
        return CopyPath(
            pinned,
            non_blocking,
            nbytes,
            step,
            chunks,
            (None,) * len(chunks),
            ((dma.start, dma.end),) * len(chunks),
            (None,) * len(chunks),
            call,
            timeline,
        )
    rate = inputs.stage_rate(nbytes) * 1e9
    bars = [(i.start, i.end) for i in timeline.on("host", "stage")]
    staged, bar, at = [], 0, bars[0][0]
    for size in chunks:
        if at >= bars[bar][1] - 1e-12:  # this bar is used up: the next chunk starts the next one, after a wait
            bar += 1
            at = bars[bar][0]
        staged.append((at, at + size / rate))
        at += size / rate
    slots = tuple(k % inputs.staging_chunks for k in range(len(chunks)))
    sent = tuple((i.start, i.end) for i in call.device)
    return CopyPath(pinned, non_blocking, nbytes, step, chunks, tuple(staged), sent, slots, call, timeline)


def predicted_bandwidth(inputs: Inputs, sizes: Sequence[int], direction: str = "h2d") -> list[dict]:
    """Rows shaped like ``copy_bandwidth``'s, predicted: GB/s from what CUDA events around the call measure,
    and how long the call blocked the host. The end event is recorded once the call returns and completes
    once the copy has: the time runs from the call to the later of the copy's end and the call's return
    (a blocking call returns ``sync_s`` after its copy ends)."""
    rows = []
    for size in sizes:
        for mode in ("pageable", "pageable+non_blocking", "pinned", "pinned+non_blocking"):
            call = single_copy(
                inputs,
                size,
                pinned=mode.startswith("pinned"),
                non_blocking=mode.endswith("non_blocking"),
                direction=direction,
            )
            elapsed = max(call.end, call.returned) - call.issued
            rows.append(
                {
                    "bytes": size,
                    "direction": direction,
                    "mode": mode,
                    "time_s": elapsed,
                    "GBps": size / elapsed / 1e9,
                    "host_blocked_s": call.host_blocked_s,
                }
            )
    return rows


# -- predictions -------------------------------------------------------------------------------------------------

VARIANTS = {
    "pageable": dict(pinned=False, non_blocking=False),
    "pageable + non_blocking": dict(pinned=False, non_blocking=True),
    "pinned": dict(pinned=True, non_blocking=False),
    "pinned + non_blocking": dict(pinned=True, non_blocking=True),
    "pinned + non_blocking + side stream": dict(pinned=True, non_blocking=True, side_stream=True),
}
"""The input pipelines the predictions compare (``pinned`` as ``DataLoader(pin_memory=True)`` with workers)."""


def step_time(inputs: Inputs, variant: str, *, batch_bytes: int, compute_s: float, steps: int = 10, **loop) -> float:
    """Predicted seconds per training step in steady state for one input pipeline."""
    options = {**VARIANTS[variant], **loop}
    return training_loop(inputs, batch_bytes=batch_bytes, compute_s=compute_s, steps=steps, **options).steady_step_s()


def speedup_curve(
    inputs: Inputs,
    ratios: Sequence[float],
    *,
    batch_bytes: int,
    baseline: str = "pageable",
    variants: Sequence[str] = tuple(VARIANTS),
    load_over_compute: float = 0.0,
    **loop,
) -> dict[str, list[float]]:
    """Predicted speed-up (baseline step time / variant step time) of each variant, for each
    ratio of a batch's copy time on the link (``batch_bytes / link``) to the step's compute time."""
    copy_s = batch_bytes / (inputs.link_GBps * 1e9)
    curves: dict[str, list[float]] = {name: [] for name in variants}
    for ratio in ratios:
        compute_s = copy_s / ratio
        kwargs = dict(batch_bytes=batch_bytes, compute_s=compute_s, load_s=load_over_compute * compute_s, **loop)
        base = step_time(inputs, baseline, **kwargs)
        for name in variants:
            curves[name].append(base / step_time(inputs, name, **kwargs))
    return curves


def transfer_speedup(inputs: Inputs, nbytes: int) -> float:
    """Predicted time of one blocking copy from pageable memory over one from pinned memory."""
    pageable = single_copy(inputs, nbytes, pinned=False, non_blocking=False)
    pinned = single_copy(inputs, nbytes, pinned=True, non_blocking=False)
    return pageable.host_blocked_s / pinned.host_blocked_s


def where_between(xs: Sequence[float], ys: Sequence[float], low: float, high: float) -> list[tuple[float, float]]:
    """The ranges of x (interpolated linearly between samples) where ``low <= y <= high``."""
    ranges: list[tuple[float, float]] = []

    def crossing(i: int, level: float) -> float:
        (x0, y0), (x1, y1) = (xs[i], ys[i]), (xs[i + 1], ys[i + 1])
        return x0 if y1 == y0 else x0 + (level - y0) * (x1 - x0) / (y1 - y0)

    inside = lambda y: low <= y <= high
    start = xs[0] if inside(ys[0]) else None
    for i in range(len(xs) - 1):
        a, b = inside(ys[i]), inside(ys[i + 1])
        if a and not b:
            ranges.append((start, crossing(i, high if ys[i + 1] > high else low)))
            start = None
        elif b and not a:
            start = crossing(i, low if ys[i] < low else high)
    if start is not None:
        ranges.append((start, xs[-1]))
    return ranges


def non_blocking_gain(
    inputs: Inputs,
    loads_over_compute: Sequence[float],
    *,
    batch_bytes: int,
    copy_over_compute: float,
    sync_each_step: bool = False,
) -> list[float]:
    """Predicted speed-up of ``non_blocking=True`` over a blocking copy, both from pinned memory on
    one stream, against the main thread's own time per step (as a multiple of the compute time)."""
    compute_s = batch_bytes / (inputs.link_GBps * 1e9) / copy_over_compute
    gains = []
    for load in loads_over_compute:
        kwargs = dict(
            batch_bytes=batch_bytes, compute_s=compute_s, load_s=load * compute_s, sync_each_step=sync_each_step
        )
        gains.append(step_time(inputs, "pinned", **kwargs) / step_time(inputs, "pinned + non_blocking", **kwargs))
    return gains


# -- the chapter's claims, decided on the model's predictions ----------------------------------------------------


@dataclass(frozen=True)
class ClaimRange:
    """Where a claimed range of speed-ups ("10-20 % faster training": ``low`` 1.10, ``high`` 1.20) holds on a
    predicted curve."""

    low: float
    high: float
    ranges: tuple[tuple[float, float], ...]
    """The x ranges (interpolated between samples) where ``low <= speed-up <= high``; empty where it never holds."""
    best: float
    """The curve's largest speed-up, which says how far off the claim is where it never holds."""

    def verdict(self) -> str:
        """The chapter's words: where the claim holds, or, where it holds nowhere, the largest predicted gain."""
        if self.ranges:
            spans = " and ".join(f"{a:.2g} to {b:.2g}" for a, b in self.ranges)
            return f"holds when one batch's copy takes **{spans} times** the step's compute"
        return f"holds for no copy/compute ratio here: the largest predicted gain is {100 * (self.best - 1):.0f} %"


def claim_range(xs: Sequence[float], speedups: Sequence[float], low: float = 1.10, high: float = 1.20) -> ClaimRange:
    """Where ``speedups`` (one per x: a curve of :func:`speedup_curve` against its copy/compute ratios) lie
    between ``low`` and ``high``."""
    return ClaimRange(low, high, tuple(where_between(xs, speedups, low, high)), max(speedups))


@dataclass(frozen=True)
class StagingClaim:
    """Whether a host stages fast enough for pinning to make one large copy ``low`` to ``high`` times faster."""

    needed_GBps: tuple[float, float]
    """The staging rates that give that gain on the link: the model's gain on a large copy is the link rate over
    the staging rate when the staging copy is the slower of the two."""
    stage_GBps: float
    verdict: str
    """``"within"`` that range, ``"faster"`` (pinning gains less) or ``"slower"`` (it gains more)."""

    def words(self) -> str:
        """The verdict as the chapter ends its sentence on this host's staging rate."""
        return {
            "within": "within that range.",
            "faster": "faster, so the gain is smaller.",
            "slower": "slower, so the gain is larger.",
        }[self.verdict]


def staging_claim(stage_GBps: float, link_GBps: float, low: float = 1.10, high: float = 1.15) -> StagingClaim:
    """ "Pinning: 10-15 % faster data transfer" (``low`` 1.10, ``high`` 1.15) against a host's staging rate."""
    slowest, fastest = link_GBps / high, link_GBps / low
    if stage_GBps > fastest:
        verdict = "faster"
    elif stage_GBps < slowest:
        verdict = "slower"
    else:
        verdict = "within"
    return StagingClaim((slowest, fastest), stage_GBps, verdict)
