"""The host side of a host-to-device copy, measured on the CPU alone.

    python -m distlab.bench.host --sizes 4MB,64MB --out results

No GPU is needed, and no torchrun: one process measures, and writes one
result file. Everything here is what the CPU pays before a DMA engine reads
a byte.

- :func:`page_lock_cost`: the operating system's page-locking call, ``mlock``,
  on a page-aligned buffer. The *first call* locks a fresh buffer, so it
  also faults in (allocates and zeroes) every page; the *steady state*
  re-locks a buffer whose pages are already resident, which is the lock
  alone. Touching a fresh buffer without locking it is timed too, to tell
  the page faults from the lock.
- :func:`staging_copy_bandwidth`: the extra host copy a pageable source
  pays: ``memcpy`` from a large buffer into a small staging buffer, one
  chunk after another, on one thread.
- :func:`memory_copy_bandwidth`: plain ``memcpy`` between two large buffers
  on one thread: the machine's memory copy rate, for comparison.
- :func:`dispatch_time`: the CPU time of one tiny torch call, a lower bound
  for what the host spends issuing any operation.

Buffers come from ``mmap`` through libc (page-aligned, never touched by
Python's allocator) and are copied with libc's ``memmove``, so no numpy is
needed. Each figure is the median and quartiles of several repetitions.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..cli import ResultConfig, entry_point, finish_run, option
from ..errors import run_main
from .harness import human_bytes, parse_sizes, summarize_times

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_HAS_MLOCK = hasattr(_LIBC, "mlock") and hasattr(_LIBC, "munlock")
if _HAS_MLOCK:
    _LIBC.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _LIBC.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


class HostBuffer:
    """``size`` bytes of anonymous, page-aligned memory from ``mmap``; untouched
    (no page allocated yet) until something writes to it or locks it."""

    def __init__(self, size: int):
        self.size = size
        address = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if address in (None, MAP_FAILED):
            raise MemoryError(f"mmap of {human_bytes(size)} failed: {os.strerror(ctypes.get_errno())}")
        self.address = address

    def touch(self) -> None:
        """Write every byte, so every page is faulted in."""
        ctypes.memset(self.address, 1, self.size)

    def lock(self) -> int:
        """``mlock`` the whole buffer; 0 on success, else the errno."""
        return 0 if _LIBC.mlock(self.address, self.size) == 0 else ctypes.get_errno()

    def unlock(self) -> None:
        _LIBC.munlock(self.address, self.size)

    def close(self) -> None:
        if self.address is not None:
            _LIBC.munmap(self.address, self.size)
            self.address = None

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _has_ipc_lock() -> bool:
    """Whether this process holds CAP_IPC_LOCK (Linux: bit 14 of CapEff); elsewhere, whether it runs as root."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def memlock_limit() -> dict:
    """RLIMIT_MEMLOCK (``ulimit -l``): how much memory this process may lock.
    A process with CAP_IPC_LOCK (root, usually) is not bound by it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    as_bytes = lambda v: None if v == resource.RLIM_INFINITY else v
    return {"soft_bytes": as_bytes(soft), "hard_bytes": as_bytes(hard), "cap_ipc_lock": _has_ipc_lock()}


def transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode (``[madvise]`` etc.): it changes how many faults a buffer takes."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return None


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _row(size: int, times: list[float]) -> dict:
    stats = summarize_times(times)
    return {**stats, "GBps": size / stats["time_s"] / 1e9, "repeats": len(times)}


def page_lock_cost(size: int, repeats: int = 5) -> dict:
    """What page-locking ``size`` bytes costs the CPU, first call and steady state.

    - ``first_touch``: write a fresh buffer (page faults only, nothing locked);
    - ``first_lock``: ``mlock`` a fresh buffer (page faults + the lock): what
      allocating new pinned memory pays on the host;
    - ``steady_lock``: ``mlock`` again a buffer whose pages are resident (the lock alone);
    - ``unlock``: ``munlock`` of a resident, locked buffer.

    If this process may not lock ``size`` bytes (RLIMIT_MEMLOCK without
    CAP_IPC_LOCK, or no ``mlock`` on this OS), the lock rows are left out and
    ``mlock_note`` says why in one line; the first-touch row is still measured.
    """
    result: dict = {"bytes": size, "page_bytes": mmap.PAGESIZE, "mlock_permitted": _HAS_MLOCK, "mlock_note": ""}
    touch, first, steady, unlock = [], [], [], []
    for _ in range(repeats):
        with HostBuffer(size) as fresh:
            touch.append(_timed(fresh.touch))
    result["first_touch"] = _row(size, touch)
    if not _HAS_MLOCK:
        result["mlock_note"] = "this C library has no mlock, so page-locking cannot be timed on this system"
        return result
    for _ in range(repeats):
        with HostBuffer(size) as fresh:
            started = time.perf_counter()
            failed = fresh.lock()
            first.append(time.perf_counter() - started)
            if failed:
                limit = memlock_limit()["soft_bytes"]
                result["mlock_permitted"] = False
                result["mlock_note"] = (
                    f"mlock of {human_bytes(size)} was refused ({errno.errorcode.get(failed, failed)}): this process "
                    f"may lock {'no limit' if limit is None else human_bytes(limit)} (ulimit -l) without CAP_IPC_LOCK"
                )
                return result
            fresh.unlock()
    with HostBuffer(size) as resident:
        resident.touch()
        for _ in range(repeats):
            started = time.perf_counter()
            resident.lock()
            steady.append(time.perf_counter() - started)
            unlock.append(_timed(resident.unlock))
    result.update(first_lock=_row(size, first), steady_lock=_row(size, steady), unlock=_row(size, unlock))
    return result


def lockable_size(size: int) -> int:
    """``size``, or the largest multiple of 1 MiB this process may lock if that is less."""
    limit = memlock_limit()
    if limit["cap_ipc_lock"] or limit["soft_bytes"] is None:
        return size
    return min(size, max(mmap.PAGESIZE, (limit["soft_bytes"] // 2) >> 20 << 20))  # headroom for what is locked already


def staging_copy_bandwidth(total_bytes: int, chunk_sizes: list[int], repeats: int = 5) -> list[dict]:
    """``memcpy`` of ``total_bytes`` from a resident pageable buffer into one
    staging buffer, chunk after chunk, on this thread: the copy a driver makes
    before a DMA engine may read pageable data. One row per staging-buffer
    size; the sizes take turns in every repetition."""
    with HostBuffer(total_bytes) as source, HostBuffer(max(chunk_sizes)) as staging:
        source.touch()
        staging.touch()

        def stage(chunk: int) -> None:
            for offset in range(0, total_bytes, chunk):
                ctypes.memmove(staging.address, source.address + offset, min(chunk, total_bytes - offset))

        times: dict[int, list[float]] = {chunk: [] for chunk in chunk_sizes}
        for repetition in range(1 + repeats):  # the first round warms up
            for chunk in chunk_sizes:
                seconds = _timed(lambda: stage(chunk))
                if repetition:
                    times[chunk].append(seconds)
    return [{"bytes": total_bytes, "chunk_bytes": chunk, **_row(total_bytes, times[chunk])} for chunk in chunk_sizes]


def memory_copy_bandwidth(size: int, repeats: int = 5) -> dict:
    """``memcpy`` between two resident ``size``-byte buffers on this thread (bytes copied per second)."""
    with HostBuffer(size) as source, HostBuffer(size) as destination:
        source.touch()
        destination.touch()
        copy = lambda: ctypes.memmove(destination.address, source.address, size)
        copy()
        times = [_timed(copy) for _ in range(repeats)]
    return {"bytes": size, **_row(size, times)}


def dispatch_time(calls: int = 2000) -> dict:
    """Seconds of CPU per call of a one-element in-place torch add: what issuing
    one operation costs the host before any device is involved (a CUDA launch
    adds the driver's own work on top)."""
    import torch

    x = torch.zeros(1)
    for _ in range(100):
        x.add_(1)
    times = [_timed(lambda: x.add_(1)) for _ in range(calls)]
    return {"calls": calls, **summarize_times(times)}


def measure_host(sizes: list[int], chunk_bytes: list[int], repeats: int = 5, staging_total: int = 64 << 20) -> dict:
    """Every host-side figure the stream model and the chapter use, on this CPU."""
    lock_sizes = sorted({lockable_size(size) for size in sizes})  # capped where ulimit -l binds this process
    capped = [size for size in sizes if size not in lock_sizes]
    note = ""
    if capped:
        limit = human_bytes(memlock_limit()["soft_bytes"])
        note = (
            f"page-locking timed on {', '.join(map(human_bytes, lock_sizes))} instead of "
            f"{', '.join(map(human_bytes, capped))}: ulimit -l lets this process lock {limit} (no CAP_IPC_LOCK)"
        )
    return {
        "memlock_limit": memlock_limit(),
        "page_lock_sizes_requested": list(sizes),
        "page_lock_note": note,
        "transparent_huge_pages": transparent_huge_pages(),
        "page_lock": [page_lock_cost(size, repeats) for size in lock_sizes],
        "staging_copy": staging_copy_bandwidth(staging_total, chunk_bytes, repeats),
        "memory_copy": memory_copy_bandwidth(staging_total, repeats),
        "dispatch": dispatch_time(),
    }


def staging_GBps(metrics: dict, chunk_bytes: int | None = None) -> float:
    """The staging-copy rate a host result measured for ``chunk_bytes`` (or its
    largest chunk): the stream model's ``stage_GBps`` input."""
    rows = metrics["staging_copy"]
    row = next((r for r in rows if r["chunk_bytes"] == chunk_bytes), max(rows, key=lambda r: r["chunk_bytes"]))
    return row["GBps"]


@dataclass
class HostBenchConfig(ResultConfig):
    """Measure on the CPU what the host side of a GPU copy costs (page-locking, staging copies) and write a result."""

    sizes: str = option("4MB,64MB,256MB", "buffer sizes for the page-locking cost (comma list or a 4x range)")
    chunks: str = option("256KB,2MB,8MB", "staging-buffer sizes for the chunked staging copy")
    staging_total: str = option("64MB", "bytes copied through the staging buffer (and by the plain memcpy)")
    repeats: int = option(5, "timed repetitions of every measurement")


@entry_point(HostBenchConfig)
def main(cfg: HostBenchConfig) -> None:
    metrics = measure_host(
        parse_sizes(cfg.sizes), parse_sizes(cfg.chunks), cfg.repeats, staging_total=parse_sizes(cfg.staging_total)[0]
    )
    refused = next((row["mlock_note"] for row in metrics["page_lock"] if row["mlock_note"]), "")
    if metrics["page_lock_note"] or refused:  # one line: why page-locking was measured smaller, or not at all
        print(f"distlab.bench.host: {metrics['page_lock_note'] or refused}")
    finish_run(None, cfg.output.out, cfg.output.name or "host", "host", asdict(cfg), metrics)


if __name__ == "__main__":
    run_main(main)
