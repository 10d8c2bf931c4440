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
  return only when the data has arrived. The staging rate depends on where the
  source lives: a source the CPU's caches keep between copies (up to
  ``cache_bytes``) is staged at ``stage_GBps``, a larger one streams from DRAM
  at ``stage_dram_GBps``.
- **Waking up**: a host that waits for the device (``cudaStreamSynchronize``,
  an event, a blocking copy) goes on ``sync_s`` after the work it waited for
  has finished, so the next call it makes reaches the device that much later.
- **Buffers**: a copy or kernel can write a named buffer; :meth:`StreamModel.read`
  says which version the host sees at that moment (the D2H hazard).

Inputs are :class:`Inputs`; each says where it comes from (measured on a
CPU, cited from a spec sheet, or assumed by the model). Scenarios
(:mod:`.stream_scenarios`) are functions returning a :class:`Timeline` (intervals per lane) that
:func:`distlab.plots.plot_stream_timeline` draws.

Predictions of the transfer benchmark's result files are :mod:`.stream_results`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

HOST, COMPUTE = "host", "compute"
DEFAULT = "default"
"""The stream work goes to unless told otherwise (PyTorch's current stream)."""
MODES = ("pageable", "pageable+non_blocking", "pinned", "pinned+non_blocking")
"""A copy's source memory and call, as the transfer benchmark (:mod:`distlab.bench.transfer`) names them."""

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
    sync_s: float = 0.0
    """Time from the end of the device work the host waits for to the host going on: the waiting thread wakes,
    and its next call (an event record, a launch) reaches the device (0 unless fitted to a measurement)."""
    stage_dram_GBps: float | None = None
    """Host staging rate from a pageable source larger than ``cache_bytes``, which streams from DRAM (measured by
    :mod:`distlab.bench.host` as a copy between two buffers too large for the caches); None: ``stage_GBps``."""
    cache_bytes: int | None = None
    """Largest pageable source the host's caches keep from one copy to the next; None: every source is staged
    at ``stage_GBps``."""
    sources: dict = field(default_factory=dict, compare=False)

    def stage_rate(self, nbytes: int) -> float:
        """GB/s at which the host stages (or pins) a pageable source of ``nbytes``: ``stage_GBps`` while the
        source fits in the caches, ``stage_dram_GBps`` beyond ``cache_bytes``."""
        beyond = self.cache_bytes is not None and nbytes > self.cache_bytes
        return self.stage_dram_GBps if beyond and self.stage_dram_GBps else self.stage_GBps

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
        if self.stage_dram_GBps and self.cache_bytes is not None:
            parts.insert(
                2,
                f"from DRAM (sources over {self.cache_bytes >> 20} MiB, {self.sources.get('cache_bytes', 'given')}) "
                f"{self.stage_dram_GBps:.2f} GB/s ({self.sources.get('stage_dram_GBps', 'given')})",
            )
        if self.copy_latency_s:
            parts.append(f"copy latency {self.copy_latency_s * 1e6:.1f} us ({self.sources.get('copy_latency_s', '')})")
        if self.sync_s:
            parts.append(f"wake-up after a wait {self.sync_s * 1e6:.1f} us ({self.sources.get('sync_s', 'given')})")
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

    def _sync(self, time: float, label: str, step: int | None) -> None:
        """The host waits for the device until ``time``, and wakes ``sync_s`` later if it had to wait."""
        if time > self.now + 1e-12:
            time += self.inputs.sync_s
        self._wait_until(time, label, step)

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
                self._host(f"stage {label}", chunk / (m.stage_rate(nbytes) * 1e9), "stage", step)
                seconds = (m.copy_latency_s if index == 0 else 0.0) + chunk / (m.link_GBps * 1e9)
                work.append(self._device(lane, label, seconds, stream, "copy", step))
                self._staging_free[slot] = work[-1].end
        if not non_blocking:
            self._sync(self._tail[stream], "cudaStreamSynchronize", step)
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
                self._sync(self._tail[stream], "cudaStreamSynchronize", step)
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
        self._sync(self._events[event], label or f"{event}.synchronize()", None)

    def stream_synchronize(self, stream: str = DEFAULT, label: str = "", step: int | None = None) -> None:
        self._sync(self._tail.get(stream, 0.0), label or "stream.synchronize()", step)

    def synchronize(self, label: str = "torch.cuda.synchronize()", step: int | None = None) -> None:
        """The host waits for the work of every stream."""
        self._sync(max(self._tail.values(), default=0.0), label, step)

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
