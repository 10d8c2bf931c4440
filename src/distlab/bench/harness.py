"""Timing conventions every benchmark shares, and the one guard of those that need a GPU.

The bandwidths a benchmark reports are nccl-tests' (``doc/PERFORMANCE.md``): algbw is the bytes of the
tensor over the time, busbw algbw times the collective's ring factor. The timing is the course's own, not
nccl-tests': nccl-tests times a loop of back-to-back calls and averages the per-call time over ranks,
while here each call is timed alone. Warm up, then repeat. Variants take turns within each repetition
(round-robin), so a machine that speeds up or slows down affects all of them alike. Ranks start each
timed call together (a barrier), and a call's time is its slowest rank's: a collective ends when its last
rank does. Report the median and the quartiles of the repetitions.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import DistlabError
from ..runtime import Runtime, gpu_count, synchronize


def require_cuda(what: str) -> torch.device:
    """The current CUDA device, or one sentence saying this needs a GPU."""
    if gpu_count() == 0:
        raise DistlabError(
            f"{what} needs a CUDA GPU and this machine has none: run it "
            "on a GPU machine such as a Kaggle 'GPU T4 x2' kernel"
        )
    return torch.device("cuda", torch.cuda.current_device())


UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?B)\s*", text.upper())
    if not match:
        raise DistlabError(f"cannot read size {text!r}: write it like 4KB, 16MB or 1GB")
    return int(match.group(1)) * UNITS[match.group(2)]


def parse_sizes(text: str) -> list[int]:
    """``4KB,1MB`` lists sizes; ``4KB:256MB`` means every power of 4 from one to the other."""
    if ":" in text:
        low, high = (parse_size(t) for t in text.split(":"))
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 4
        return sizes
    return [parse_size(t) for t in text.split(",")]


def human_bytes(n: float) -> str:
    for unit in ("GB", "MB", "KB"):
        if n >= UNITS[unit]:
            return f"{n / UNITS[unit]:g}{unit}"
    return f"{n:g}B"


def summarize_times(times: list[float]) -> dict[str, float]:
    """Median and quartiles of a list of timings, in seconds."""
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"time_s": statistics.median(times), "time_q1_s": q1, "time_q3_s": q3}


def round_robin(
    steps: dict[str, Callable[[], object]],
    runtime: Runtime,
    repeats: int,
    warmup: int = 0,
    prepare: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of every step, taking turns, each repetition's time
    the slowest rank's. ``prepare(name)`` runs untimed before each call, ``after(name)`` after it."""
    local: dict[str, list[float]] = {name: [] for name in steps}
    for rep in range(warmup + repeats):
        for name, step in steps.items():
            if prepare is not None:
                prepare(name)
            dist.barrier()
            synchronize(runtime.device)
            start = time.perf_counter()
            step()
            synchronize(runtime.device)
            if rep >= warmup:
                local[name].append(time.perf_counter() - start)
            if after is not None:
                after(name)
    # after the timing, so it disturbs none of it
    return {name: runtime.reduce(times, "max") for name, times in local.items()}


class Progress:
    """A progress bar for a long benchmark, on rank 0: one line each tenth of the way, with the time left.
    Work is counted in units the caller chooses (steps, or steps weighted by what each costs)."""

    def __init__(self, runtime: Runtime, total: float, width: int = 20):
        self.runtime, self.total, self.width = runtime, max(total, 1), width
        self.done, self.shown, self.started = 0.0, 0, time.perf_counter()

    def advance(self, *what: str, work: float = 1.0) -> None:
        self.done += work
        tenth = 10 * self.done // self.total
        if tenth <= self.shown:
            return
        self.shown = tenth
        elapsed = time.perf_counter() - self.started
        left = elapsed * (self.total - self.done) / self.done
        filled = int(self.width * self.done // self.total)
        self.runtime.log(
            f"  [{'#' * filled}{'-' * (self.width - filled)}] {int(100 * self.done // self.total):3d}% "
            f"{' '.join(what)}: {elapsed / 60:.1f} min so far, about {left / 60:.1f} min left"
        )


def take_turns(
    names: list[str], run: Callable[[str], float], repeats: int, warmup: int = 1, warmup_run=None
) -> dict[str, list[float]]:
    """Call ``run(name)`` for every name in turn, ``warmup`` untimed rounds (with
    ``warmup_run`` if given) and then ``repeats`` rounds; each name's results in order."""
    results: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        for name in names:
            if round_ < warmup:
                (warmup_run or run)(name)
            else:
                results[name].append(run(name))
    return results
