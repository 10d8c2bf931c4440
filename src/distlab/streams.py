"""A model of CUDA's stream semantics, small enough to read and run on a CPU.

It is a *model*: a deterministic discrete-event simulation of the rules
CUDA documents, with durations computed from a few inputs. It predicts; it
does not measure. Nothing here imports torch or needs a GPU.

What it simulates:

- **Lanes** that do work: the host thread (one Python thread issuing calls),
  one or two copy engines (one per direction when there are two), and one
  compute engine (a kernel is assumed to fill the GPU, so kernels from
  different streams take turns).
- **Streams**: FIFO queues. An operation starts when its stream's previous
  operation has finished, the host has issued it, and its engine is free
  (the earliest gap long enough; engines serve whichever stream is ready).
- **Events**: ``record`` marks the point a stream has reached; ``wait_event``
  makes a stream's later work wait for it; ``event_synchronize``,
  ``stream_synchronize`` and ``synchronize`` make the host wait.
- **Copies**: from pinned memory the copy engine reads the source directly,
  and the call returns after the host's call overhead (``non_blocking``) or
  once the copy is done (blocking: PyTorch's ``cudaMemcpyAsync`` followed by
  ``cudaStreamSynchronize``).
- **Pageable sources**, the model's choice among what CUDA allows: CUDA's
  "API synchronization behavior" page says such a copy "might be
  synchronous with respect to host" and the driver "may synchronize with the
  stream and stage the copy into pinned memory". The model stages: the host
  thread copies the source, chunk by chunk, into a small pool of pinned
  staging buffers (``staging_chunks`` x ``chunk_bytes``) at the host's
  measured copy rate, and the copy engine sends each staged chunk in stream
  order. A staging buffer is reused only once its chunk has been sent, so a
  copy larger than the pool makes the host wait for the stream; a smaller one
  returns as soon as it is staged. It does not synchronize with the stream
  before staging. Copies *to* pageable memory are staged the other way and
  return only when the data has arrived.
- **Buffers**: a copy or kernel can write a named buffer; :meth:`StreamModel.read`
  says which version the host sees at that moment (the D2H hazard).

Inputs are :class:`Inputs`; each says where it comes from (measured on a
CPU, cited from a spec sheet, or assumed by the model). Scenarios are
functions returning a :class:`Timeline` (intervals per lane) that
:func:`distlab.plots.plot_stream_timeline` draws.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

HOST, COMPUTE = "host", "compute"
DEFAULT = "default"
"""The stream work goes to unless told otherwise (PyTorch's current stream)."""

# Per-lane, per-direction rate of each PCIe generation after line encoding, GB/s (PCI-SIG base specifications:
# 2.5, 5, 8, 16, 32 GT/s per lane; 8b/10b encoding for generations 1-2, 128b/130b from generation 3).
PCIE_LANE_GBPS = {
    1: 2.5 * 8 / 10 / 8,
    2: 5 * 8 / 10 / 8,
    3: 8 * 128 / 130 / 8,
    4: 16 * 128 / 130 / 8,
    5: 32 * 128 / 130 / 8,
}

# Host interface of data-centre GPUs, from each GPU's NVIDIA datasheet ("System interface" / "Interconnect").
GPU_HOST_LINK = {
    "T4": (3, 16),
    "P100": (3, 16),
    "V100": (3, 16),
    "A10": (4, 16),
    "A100": (4, 16),
    "L4": (4, 16),
    "H100": (5, 16),
    "H200": (5, 16),
}


def pcie_GBps(generation: int, width: int = 16) -> float:
    """Theoretical per-direction bandwidth of a PCIe link, GB/s (15.75 for PCIe 3.0 x16)."""
    return PCIE_LANE_GBPS[generation] * width


def link_for_gpu(name: str) -> tuple[int, int] | None:
    """(PCIe generation, lanes) of a GPU whose name contains a model in :data:`GPU_HOST_LINK`, else None."""
    words = name.upper().replace("-", " ").split()
    for model, link in GPU_HOST_LINK.items():
        if model in words:
            return link
    return None


@dataclass(frozen=True)
class Inputs:
    """What the model needs to know; ``sources`` says where each figure comes from."""

    link_GBps: float
    """Per-direction host-device rate of the copy engine (a spec sheet's link rate, or a measured pinned copy)."""
    stage_GBps: float
    """Host copy rate into a staging buffer (measured on a CPU by :mod:`distlab.bench.host`)."""
    api_s: float = 0.0
    """Host time of one call that queues work (a CPU's dispatch time is a lower bound)."""
    chunk_bytes: int = 2 << 20
    """Size of one staging buffer (an assumption: the driver's is undocumented)."""
    staging_chunks: int = 2
    """Number of staging buffers (an assumption: double buffering)."""
    copy_engines: int = 2
    """1: H2D and D2H copies share one engine; 2: one engine per direction."""
    copy_latency_s: float = 0.0
    """Fixed time of one copy on its engine, besides the bytes (0 unless fitted to a measurement)."""
    sources: dict = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        """One line naming every input and its source, for figure captions."""
        staging = f"staging copy {self.stage_GBps:.2f} GB/s ({self.sources.get('stage_GBps', 'given')})"
        parts = [
            f"link {self.link_GBps:.2f} GB/s ({self.sources.get('link_GBps', 'given')})",
            staging if not math.isnan(self.stage_GBps) else "no staging rate (pageable copies not predicted)",
            f"call {self.api_s * 1e6:.1f} us ({self.sources.get('api_s', 'given')})",
            f"staging {self.staging_chunks} x {self.chunk_bytes >> 20} MiB (assumed)",
            f"{self.copy_engines} copy engine{'s' if self.copy_engines > 1 else ''}",
        ]
        if self.copy_latency_s:
            parts.append(f"copy latency {self.copy_latency_s * 1e6:.1f} us ({self.sources.get('copy_latency_s', '')})")
        return "; ".join(parts)


@dataclass(frozen=True)
class Interval:
    """One piece of work on one lane, in seconds from the start of the scenario."""

    lane: str
    label: str
    start: float
    end: float
    kind: str
    """``api`` (a call), ``work`` (the host's own work), ``stage`` (a host staging copy),
    ``wait`` (the host blocked), ``copy`` (a DMA transfer), ``kernel``."""
    stream: str | None = None
    step: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    def overlaps(self, other: Interval) -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class Call:
    """What one call did: when the host entered and left it, and the device work it queued."""

    issued: float
    returned: float
    device: tuple[Interval, ...] = ()

    @property
    def host_blocked_s(self) -> float:
        return self.returned - self.issued

    @property
    def start(self) -> float:
        return min(i.start for i in self.device)

    @property
    def end(self) -> float:
        return max(i.end for i in self.device)


@dataclass(frozen=True)
class Read:
    """The host read ``buffer`` at ``time`` and saw version ``saw``; ``latest`` was the last one queued."""

    buffer: str
    time: float
    saw: str
    latest: str

    @property
    def stale(self) -> bool:
        return self.saw != self.latest


@dataclass
class Timeline:
    """A scenario's result: every interval on every lane, the host's reads, and named calls."""

    title: str
    inputs: Inputs
    intervals: list[Interval]
    reads: list[Read] = field(default_factory=list)
    calls: dict[str, Call] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return max(i.end for i in self.intervals)

    @property
    def lanes(self) -> list[str]:
        order = {HOST: 0, "copy": 1, "copy H2D": 1, "copy D2H": 2, COMPUTE: 3}
        return sorted({i.lane for i in self.intervals}, key=lambda lane: order.get(lane, 9))

    def on(self, lane: str, kind: str | None = None) -> list[Interval]:
        return [i for i in self.intervals if i.lane == lane and (kind is None or i.kind == kind)]

    def step(self, step: int, lane: str | None = None, kind: str | None = None) -> list[Interval]:
        return [
            i
            for i in self.intervals
            if i.step == step and (lane is None or i.lane == lane) and (kind is None or i.kind == kind)
        ]

    def steady_step_s(self, skip: int = 2) -> float:
        """Seconds per step in steady state: the spacing of the compute ends after ``skip`` steps."""
        ends = sorted(i.end for i in self.on(COMPUTE, "kernel"))
        if len(ends) < skip + 2:
            raise ValueError("too few steps for a steady state")
        return (ends[-1] - ends[skip]) / (len(ends) - 1 - skip)


class StreamModel:
    """The simulator: call its methods in the order a program would call CUDA."""

    def __init__(self, inputs: Inputs):
        self.inputs = inputs
        self.now = 0.0  # the host thread's clock
        self.intervals: list[Interval] = []
        self.reads: list[Read] = []
        self._busy: dict[str, list[tuple[float, float]]] = {}
        self._tail: dict[str, float] = {}  # when the work queued so far on a stream is done
        self._events: dict[str, float] = {}
        self._writes: dict[str, list[tuple[float, str]]] = {}
        self._staging_free = [0.0] * inputs.staging_chunks  # when each staging buffer may be reused
        self._next_slot = 0

    # -- lanes -------------------------------------------------------------------------------------------------

    def copy_lane(self, direction: str) -> str:
        if self.inputs.copy_engines >= 2:
            return {"h2d": "copy H2D", "d2h": "copy D2H"}[direction]
        return "copy"

    def _append(self, interval: Interval) -> Interval:
        """Add an interval to the timeline, joined to the lane's previous one if it simply continues it."""
        key = lambda i: (i.lane, i.label, i.kind, i.stream, i.step)
        for index in range(len(self.intervals) - 1, max(-1, len(self.intervals) - 9), -1):
            last = self.intervals[index]
            if last.lane == interval.lane:
                if key(last) == key(interval) and math.isclose(last.end, interval.start, abs_tol=1e-12):
                    self.intervals[index] = replace(last, end=interval.end)  # one bar, not one per chunk
                    return interval
                break
        if interval.end > interval.start:
            self.intervals.append(interval)
        return interval

    def _host(self, label: str, seconds: float, kind: str, step: int | None) -> None:
        self._append(Interval(HOST, label, self.now, self.now + seconds, kind, step=step))
        self.now += seconds

    def _wait_until(self, time: float, label: str, step: int | None) -> None:
        if time > self.now + 1e-12:  # a rounding error is not a wait
            self._host(label, time - self.now, "wait", step)
        self.now = max(self.now, time)

    def _earliest(self, lane: str, ready: float, seconds: float) -> float:
        """The first time from ``ready`` at which ``lane`` is free for ``seconds``."""
        busy = self._busy.setdefault(lane, [])
        i = bisect.bisect_right(busy, (ready, math.inf))
        start = max(ready, busy[i - 1][1]) if i else ready
        while i < len(busy) and busy[i][0] < start + seconds:
            start = max(start, busy[i][1])
            i += 1
        return start

    def _device(
        self, lane: str, label: str, seconds: float, stream: str, kind: str, step: int | None, after: float = 0.0
    ) -> Interval:
        """Queue work on ``stream``: it starts once issued (and not before ``after``), once the
        stream's earlier work is done, in the first gap its engine has."""
        ready = max(self.now, self._tail.get(stream, 0.0), after)
        start = self._earliest(lane, ready, seconds)
        bisect.insort(self._busy[lane], (start, start + seconds))
        self._tail[stream] = start + seconds
        return self._append(Interval(lane, label, start, start + seconds, kind, stream, step))

    def _write(self, buffer: str | None, version: str, time: float) -> None:
        if buffer:
            self._writes.setdefault(buffer, []).append((time, version))

    # -- what a program calls ------------------------------------------------------------------------------------

    def host_work(self, label: str, seconds: float, step: int | None = None) -> Call:
        """The host thread's own work (fetching a batch, a ``pin_memory()`` copy, Python)."""
        issued = self.now
        self._host(label, seconds, "work", step)
        return Call(issued, self.now)

    def kernel(
        self, label: str, seconds: float, stream: str = DEFAULT, step: int | None = None, writes: str | None = None
    ) -> Call:
        """Launch work on the compute engine; the host pays one call and goes on."""
        issued = self.now
        self._host(f"launch {label}", self.inputs.api_s, "api", step)
        work = self._device(COMPUTE, label, seconds, stream, "kernel", step)
        self._write(writes, label, work.end)
        return Call(issued, self.now, (work,))

    def copy_h2d(self, label: str, nbytes: int, *, pinned: bool, non_blocking: bool, stream=DEFAULT, step=None) -> Call:
        """``device_tensor.copy_(host_tensor, non_blocking=...)`` from pinned or pageable memory."""
        m = self.inputs
        issued, lane = self.now, self.copy_lane("h2d")
        self._host(f"call {label}", m.api_s, "api", step)
        if pinned:
            work = [self._device(lane, label, m.copy_latency_s + nbytes / (m.link_GBps * 1e9), stream, "copy", step)]
        else:
            work = []
            for index, offset in enumerate(range(0, max(nbytes, 1), m.chunk_bytes)):
                chunk = min(m.chunk_bytes, nbytes - offset)
                slot = self._next_slot
                self._next_slot = (slot + 1) % m.staging_chunks
                self._wait_until(self._staging_free[slot], "wait for a staging buffer", step)
                self._host(f"stage {label}", chunk / (m.stage_GBps * 1e9), "stage", step)
                seconds = (m.copy_latency_s if index == 0 else 0.0) + chunk / (m.link_GBps * 1e9)
                work.append(self._device(lane, label, seconds, stream, "copy", step))
                self._staging_free[slot] = work[-1].end
        if not non_blocking:
            self._wait_until(self._tail[stream], "cudaStreamSynchronize", step)
        return Call(issued, self.now, tuple(work))

    def copy_d2h(
        self, label: str, nbytes: int, *, pinned: bool, non_blocking: bool, stream=DEFAULT, step=None, into=None
    ) -> Call:
        """``host_tensor.copy_(device_tensor, non_blocking=...)``; ``into`` names the host buffer written."""
        m = self.inputs
        issued, lane = self.now, self.copy_lane("d2h")
        self._host(f"call {label}", m.api_s, "api", step)
        if pinned:
            work = [self._device(lane, label, m.copy_latency_s + nbytes / (m.link_GBps * 1e9), stream, "copy", step)]
            self._write(into, label, work[0].end)
            if not non_blocking:
                self._wait_until(self._tail[stream], "cudaStreamSynchronize", step)
            return Call(issued, self.now, tuple(work))
        work = []  # to pageable memory: through the staging buffers, and the host copies each chunk out
        for index, offset in enumerate(range(0, max(nbytes, 1), m.chunk_bytes)):
            chunk = min(m.chunk_bytes, nbytes - offset)
            slot = self._next_slot
            self._next_slot = (slot + 1) % m.staging_chunks
            seconds = (m.copy_latency_s if index == 0 else 0.0) + chunk / (m.link_GBps * 1e9)
            work.append(self._device(lane, label, seconds, stream, "copy", step, after=self._staging_free[slot]))
            self._wait_until(work[-1].end, "wait for the copy", step)
            self._host(f"unstage {label}", chunk / (m.stage_GBps * 1e9), "stage", step)
            self._staging_free[slot] = self.now
        self._write(into, label, self.now)
        return Call(issued, self.now, tuple(work))

    def record(self, event: str, stream: str = DEFAULT) -> None:
        """``event.record(stream)``: the event completes when the work queued on ``stream`` so far has."""
        self._host(f"record {event}", self.inputs.api_s, "api", None)
        self._events[event] = max(self.now, self._tail.get(stream, 0.0))

    def wait_event(self, stream: str, event: str) -> None:
        """``stream.wait_event(event)``: later work on ``stream`` waits for ``event``; the host does not."""
        if event not in self._events:
            raise ValueError(f"event {event!r} was never recorded")
        self._host(f"wait_event {event}", self.inputs.api_s, "api", None)
        self._tail[stream] = max(self._tail.get(stream, 0.0), self._events[event])

    def event_synchronize(self, event: str, label: str = "") -> None:
        self._wait_until(self._events[event], label or f"{event}.synchronize()", None)

    def stream_synchronize(self, stream: str = DEFAULT, label: str = "", step: int | None = None) -> None:
        self._wait_until(self._tail.get(stream, 0.0), label or "stream.synchronize()", step)

    def synchronize(self, label: str = "torch.cuda.synchronize()", step: int | None = None) -> None:
        """The host waits for the work of every stream."""
        self._wait_until(max(self._tail.values(), default=0.0), label, step)

    def read(self, buffer: str) -> Read:
        """The host reads a host buffer now: it sees the last write that has *completed*."""
        writes = self._writes.get(buffer, [])
        done = [version for time, version in writes if time <= self.now]
        seen = Read(buffer, self.now, done[-1] if done else "initial", writes[-1][1] if writes else "initial")
        self.reads.append(seen)
        self._host(f"read {buffer}", self.inputs.api_s, "work", None)
        return seen

    def timeline(self, title: str, calls: dict[str, Call] | None = None) -> Timeline:
        return Timeline(title, self.inputs, sorted(self.intervals, key=lambda i: i.start), self.reads, calls or {})


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
    pin_s = batch_bytes / (inputs.stage_GBps * 1e9)

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


def predicted_bandwidth(inputs: Inputs, sizes: Sequence[int], direction: str = "h2d") -> list[dict]:
    """Rows shaped like ``copy_bandwidth``'s, predicted: GB/s from the time between the call and the
    copy's end (what CUDA events around the call measure), and how long the call blocked the host."""
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
            elapsed = call.end - call.issued
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


def inputs_from_host_result(
    record: dict, link_GBps: float, link_source: str, chunk_bytes: int = 2 << 20, **overrides
) -> Inputs:
    """Model inputs from a :mod:`distlab.bench.host` result (the staging rate and the call time
    measured on that CPU) and a link rate with its source."""
    from .results import hardware_label  # the label only; nothing here needs torch otherwise

    metrics = record["metrics"]
    rows = metrics["staging_copy"]
    row = next((r for r in rows if r["chunk_bytes"] == chunk_bytes), max(rows, key=lambda r: r["chunk_bytes"]))
    where = hardware_label(record["environment"]).removesuffix(" (no backend)")
    values = dict(
        link_GBps=link_GBps,
        stage_GBps=row["GBps"],
        api_s=metrics["dispatch"]["time_s"],
        chunk_bytes=row["chunk_bytes"],
        sources={
            "link_GBps": link_source,
            "stage_GBps": f"measured: {row['chunk_bytes'] >> 20} MiB chunks, {where}",
            "api_s": f"measured: one tiny torch call, {where}",
        },
    )
    values.update(overrides)
    return Inputs(**values)


def inputs_from_transfer_result(record: dict, rank: int = 0) -> Inputs | None:
    """Model inputs from a GPU result of :mod:`distlab.bench.transfer`, all measured on that
    machine: the link rate (the largest pinned copy), the fixed cost of a copy (the smallest pinned
    copy, less its bytes at that rate), the call overhead (how long a ``non_blocking`` pinned copy
    blocked the host) and, when the result holds the host's figures, the staging rate. The
    pageable rows are *not* inputs: they are what the model predicts. None without the rows."""
    measured = record["metrics"]["ranks"][rank]
    rows = [r for r in measured.get("bandwidth", []) if r["direction"] == "h2d"]
    pinned = sorted((r for r in rows if r["mode"] == "pinned"), key=lambda r: r["bytes"])
    quick = sorted((r for r in rows if r["mode"] == "pinned+non_blocking"), key=lambda r: r["bytes"])
    if not pinned or not quick:
        return None
    link, api_s = pinned[-1]["GBps"], quick[0]["host_blocked_s"]
    # events bracket the call, so a copy's time holds the call's own overhead too
    latency = max(0.0, pinned[0]["time_s"] - pinned[0]["bytes"] / (link * 1e9) - api_s)
    host_side = record["metrics"].get("host")
    stage = None
    if host_side:
        staged_rows = host_side["staging_copy"]
        stage = next((r for r in staged_rows if r["chunk_bytes"] == 2 << 20), staged_rows[-1])["GBps"]
    size = lambda n: f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
    return Inputs(
        link_GBps=link,
        stage_GBps=stage or math.nan,
        api_s=api_s,
        copy_latency_s=latency,
        sources={
            "link_GBps": f"measured: pinned copy of {size(pinned[-1]['bytes'])}",
            "stage_GBps": "measured on that host" if stage else "not in this result",
            "api_s": f"measured: a non_blocking pinned copy of {size(quick[0]['bytes'])}",
            "copy_latency_s": f"measured: pinned copy of {size(pinned[0]['bytes'])}",
        },
    )


def predict_transfer_result(record: dict, rank: int = 0) -> dict | None:
    """What the model predicts for each experiment in a GPU result, from inputs measured in that
    same result (:func:`inputs_from_transfer_result`), next to what was measured."""
    inputs = inputs_from_transfer_result(record, rank)
    if inputs is None:
        return None
    measured = record["metrics"]["ranks"][rank]
    sizes = sorted({r["bytes"] for r in measured["bandwidth"]})
    staged = not math.isnan(inputs.stage_GBps)
    out: dict = {"inputs": inputs, "bandwidth": predicted_bandwidth(inputs, sizes) if staged else []}
    if not staged:  # without the host's staging rate only the pinned rows can be predicted
        out["bandwidth"] = [
            r for r in predicted_bandwidth(replace(inputs, stage_GBps=1.0), sizes) if r["mode"].startswith("pinned")
        ]
    overlap = measured.get("overlap")
    if overlap:
        serial = overlap["timeline"]["serial"]

        def median(lane: str) -> float:
            durations = sorted(i["dur_ms"] for i in serial if i["lane"] == lane)
            return durations[len(durations) // 2] / 1e3

        copy_s, compute_s = median("copy"), median("compute")
        model = replace(inputs, link_GBps=overlap["batch_bytes"] / copy_s / 1e9, copy_latency_s=0.0)
        timelines = {
            key: overlap_experiment(
                model,
                batches=overlap["batches"],
                batch_bytes=overlap["batch_bytes"],
                compute_s=compute_s,
                overlapped=key,
            )
            for key in (False, True)
        }
        out["overlap"] = {
            "copy_s": copy_s,
            "compute_s": compute_s,
            "serial": timelines[False],
            "overlapped": timelines[True],
            "predicted_speedup": timelines[False].end / timelines[True].end,
            "measured_speedup": overlap["serial_s"] / overlap["overlapped_s"],
        }
    hazard = measured.get("non_blocking_hazard")
    if hazard:
        early, _ = d2h_read_hazard(inputs, nbytes=hazard["numel"] * 4, compute_s=1e-3).reads
        out["hazard"] = {"predicted_stale": early.stale, "measured_stale": hazard["early_read_was_wrong"]}
    loader = {row["variant"]: row for row in record["metrics"].get("loader") or []}
    if staged and "device-resident" in loader:
        batch = loader["device-resident"]["config"]["training"]["batch_size"]
        batch_bytes = batch * (28 * 28 * 4 + 8)  # float32 MNIST-shaped images and int64 labels
        world = record["environment"].get("world_size", 1)
        compute_s = batch * world / loader["device-resident"]["samples_per_s"]  # a step with no copy at all
        kwargs = dict(batch_bytes=batch_bytes, compute_s=compute_s)
        base = step_time(inputs, "pageable", **kwargs)
        out["loader"] = {
            "compute_s": compute_s,
            "batch_bytes": batch_bytes,
            "predicted": {name: base / step_time(inputs, name, **kwargs) for name in VARIANTS},
        }
    return out


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
