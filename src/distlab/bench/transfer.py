"""Host-to-device copies, measured: pageable against pinned memory,
``non_blocking`` and what it really does, copy/compute overlap, and the
DataLoader end to end.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.transfer --sizes 4KB:1GB --out results

Every rank measures its own GPU, **one rank after the other**: the others
wait at a barrier, so no two ranks share the host's memory bandwidth or the
PCIe root while one is timed. The host-side costs (:mod:`distlab.bench.host`)
are measured once, by rank 0, before any GPU work. The DataLoader comparison
trains with DDP, so there all ranks run together. Rank 0 writes one result
file holding every rank's measurements. Everything here needs CUDA: on a
machine without a GPU each entry point stops with one sentence saying so.

Timing conventions: CUDA events bracket the copy on its stream (the time the
DMA engine took); ``host_blocked_s`` is how long the Python call itself
blocked, which is what ``non_blocking=True`` changes. Warm-ups first, then
the median and quartiles of the repetitions; variants compared end to end
take turns (round-robin), so a machine that warms up or slows down affects
them alike.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..cli import ResultConfig, entry_point, finish_run, option
from ..errors import run_main
from ..predict.streams import MODES
from ..runtime import Runtime, distributed, gather_per_rank
from . import host
from .harness import parse_sizes, require_cuda, summarize_times, take_turns
from .loader import loader_end_to_end


def bandwidth_row(size: int, direction: str, mode: str, copy_times: list[float], host_times: list[float]) -> dict:
    """One result row: medians, quartiles, and GB/s from the median copy time."""
    copy, host = summarize_times(copy_times), summarize_times(host_times)
    return {
        "bytes": size,
        "direction": direction,
        "mode": mode,
        **copy,
        "host_blocked_s": host["time_s"],
        "GBps": size / copy["time_s"] / 1e9,
        "repeats": len(copy_times),
    }


def _host_buffer(size: int, pinned: bool) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=pinned).fill_(1)


def copy_bandwidth(
    sizes: list[int], warmup: int = 2, repeats: int = 10, directions=("h2d", "d2h"), modes=MODES
) -> list[dict]:
    """Copy bandwidth for every size, direction and mode, on the current GPU."""
    device = require_cuda("the copy-bandwidth benchmark")
    rows = []
    for size in sizes:
        gpu = torch.empty(size, dtype=torch.uint8, device=device)
        hosts = {pinned: _host_buffer(size, pinned) for pinned in (False, True)}
        for direction in directions:
            for mode in modes:
                host, non_blocking = hosts[mode.startswith("pinned")], mode.endswith("non_blocking")
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                copy_times, host_times = [], []
                for rep in range(warmup + repeats):
                    torch.cuda.synchronize(device)
                    called = time.perf_counter()
                    start.record()
                    if direction == "h2d":
                        gpu.copy_(host, non_blocking=non_blocking)
                    else:
                        host.copy_(gpu, non_blocking=non_blocking)
                    end.record()
                    returned = time.perf_counter()
                    end.synchronize()
                    if rep >= warmup:
                        copy_times.append(start.elapsed_time(end) / 1e3)
                        host_times.append(returned - called)
                rows.append(bandwidth_row(size, direction, mode, copy_times, host_times))
        del gpu, hosts
    return rows


def empty_host_cache() -> bool:
    """Give the caching host allocator's free pinned blocks back to the driver, so the next
    ``pin_memory()`` allocates fresh page-locked memory; False where this torch cannot."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return False
    empty()
    return True


def pinning_cost(sizes: list[int], repeats: int = 5) -> list[dict]:
    """What ``tensor.pin_memory()`` costs, first call apart from the cached path.

    ``pin_memory()`` allocates through PyTorch's caching host allocator. The
    *first call* for a size finds no free pinned block: the driver allocates
    and page-locks new memory, then the data is copied in. Freed blocks go
    back to the cache, so later calls of the same size only copy (the
    *cached* path). The cache is emptied before every first call where torch
    allows it; elsewhere each size's first call is timed once, sizes in
    increasing order so no cached block is large enough to serve it. A
    pageable ``clone()`` of the same tensor is the copy alone, for comparison.
    """
    require_cuda("measuring the cost of pinning")
    torch.empty(1, pin_memory=True)  # the CUDA context and the allocator exist before anything is timed
    emptiable = empty_host_cache()
    rows = []
    for size in sorted(sizes):
        source = _host_buffer(size, pinned=False)
        first, cached, clone = [], [], []
        for _ in range(repeats if emptiable else 1):
            empty_host_cache()
            started = time.perf_counter()
            pinned = source.pin_memory()
            first.append(time.perf_counter() - started)
            del pinned
        for _ in range(repeats):
            started = time.perf_counter()
            pinned = source.pin_memory()  # the block freed just before is reused
            cached.append(time.perf_counter() - started)
            del pinned
            started = time.perf_counter()
            copied = source.clone()
            clone.append(time.perf_counter() - started)
            del copied
        rows.append(
            {
                "bytes": size,
                "first_pin_memory_s": summarize_times(first)["time_s"],
                "first_calls": len(first),
                "cache_emptied": emptiable,
                "cached_pin_memory": summarize_times(cached),
                "cached_pin_memory_s": summarize_times(cached)["time_s"],
                "pageable_clone_s": summarize_times(clone)["time_s"],
            }
        )
        del source
    empty_host_cache()
    return rows


def pinned_loader_cost(
    batches: int = 30, batch_size: int = 128, image_shape=(3, 224, 224), num_workers: int = 2, repeats: int = 3
) -> dict:
    """Seconds per batch to iterate a DataLoader with ``pin_memory`` off and on,
    copying nothing to the GPU: what the pinning thread itself costs (or hides).
    One untimed pass of each first, then the two take turns ``repeats`` times."""
    require_cuda("measuring a pinned DataLoader")
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randint(0, 255, (batch_size * batches, *image_shape), dtype=torch.uint8))

    def run(name: str) -> float:
        pin = name == "pinned"
        loader = DataLoader(data, batch_size=batch_size, num_workers=num_workers, pin_memory=pin)
        started = time.perf_counter()
        for (batch,) in loader:
            assert batch.is_pinned() == pin
        return (time.perf_counter() - started) / batches

    seconds = take_turns(["pageable", "pinned"], run, repeats=repeats, warmup=1)
    return {
        "batch_bytes": batch_size * int(torch.tensor(image_shape).prod()),
        "seconds_per_batch": {name: summarize_times(times)["time_s"] for name, times in seconds.items()},
        "repeats": repeats,
    }


def non_blocking_read_hazard(numel: int = 1 << 26) -> dict:
    """Copy a GPU result to the host with ``non_blocking=True`` and read it on
    the CPU *before* synchronizing: the copy is queued behind the kernel that
    produces the data, so the host sees what was in the buffer before."""
    device = require_cuda("the non_blocking read hazard demonstration")
    source = torch.ones(numel, device=device)
    landing = torch.zeros(numel, pin_memory=True)
    torch.cuda.synchronize(device)
    result = source
    for _ in range(20):  # keep the GPU busy so the copy is still queued when the host reads
        result = result * 1.0
    landing.copy_(result, non_blocking=True)
    read_early = landing.sum().item()  # the bug: no synchronize between copy and read
    torch.cuda.synchronize(device)
    read_after = landing.sum().item()
    return {
        "numel": numel,
        "expected_sum": float(numel),
        "sum_read_before_synchronize": read_early,
        "sum_read_after_synchronize": read_after,
        "early_read_was_wrong": read_early != float(numel),
        "late_read_was_right": read_after == float(numel),
    }


def _event_ms(fn, device) -> float:
    """Milliseconds one call of ``fn`` takes on the GPU (after a warm-up call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def overlap_experiment(
    batches: int = 8, batch_bytes: int = 64 << 20, matmul_size: int = 2048, matmuls: int = 0
) -> dict:
    """Copy-then-compute against copying batch k+1 on a side stream while
    batch k computes. Returns both total times and each op's interval
    (from CUDA events) for the timeline plot.

    ``matmuls=0`` sizes the compute to take about as long as one batch's
    copy on this GPU, where overlap has the most to gain (at most 2x)."""
    device = require_cuda("the copy/compute overlap experiment")
    host_batches = [_host_buffer(batch_bytes, pinned=True) for _ in range(batches)]
    device_batches = [torch.empty(batch_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    weight = torch.randn(matmul_size, matmul_size, device=device) / matmul_size**0.5  # powers stay finite
    copy_stream = torch.cuda.Stream(device)
    compute_stream = torch.cuda.current_stream(device)
    if matmuls <= 0:
        copy_ms = _event_ms(lambda: device_batches[0].copy_(host_batches[0], non_blocking=True), device)
        matmul_ms = _event_ms(lambda: weight @ weight, device)
        matmuls = max(1, round(copy_ms / matmul_ms))

    def compute(buffer: torch.Tensor) -> None:
        x = weight
        for _ in range(matmuls):
            x = x @ weight
        buffer[:1].add_(1)  # the compute reads the batch, so it must wait for its copy

    def run(overlapped: bool) -> tuple[float, list[dict]]:
        events: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        origin = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        origin.record(compute_stream)
        copied = [torch.cuda.Event() for _ in range(batches)]
        computed = [torch.cuda.Event() for _ in range(batches)]
        for k in range(batches):
            stream = copy_stream if overlapped else compute_stream
            with torch.cuda.stream(stream):
                if k >= 2:
                    stream.wait_event(computed[k - 2])  # the buffer being overwritten must be free
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                device_batches[k % 2].copy_(host_batches[k], non_blocking=True)
                end.record(stream)
                copied[k].record(stream)
                events.append(("copy", k, start, end))
            compute_stream.wait_event(copied[k])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(compute_stream)
            compute(device_batches[k % 2])
            end.record(compute_stream)
            computed[k].record(compute_stream)
            events.append(("compute", k, start, end))
        torch.cuda.synchronize(device)
        intervals = [
            {"lane": lane, "batch": k, "start_ms": origin.elapsed_time(s), "dur_ms": s.elapsed_time(e)}
            for lane, k, s, e in events
        ]
        return max(i["start_ms"] + i["dur_ms"] for i in intervals) / 1e3, intervals

    run(overlapped=True)  # warm-up: cuBLAS handles, allocator
    serial_s, serial = run(overlapped=False)
    overlapped_s, overlapped = run(overlapped=True)
    return {
        "batches": batches,
        "batch_bytes": batch_bytes,
        "matmuls_per_batch": matmuls,
        "matmul_size": matmul_size,
        "serial_s": serial_s,
        "overlapped_s": overlapped_s,
        "speedup": serial_s / overlapped_s,
        "timeline": {"serial": serial, "overlapped": overlapped},
    }


def one_rank_at_a_time(runtime: Runtime, measure: Callable[[], dict], group=None) -> dict:
    """Run ``measure()`` on each rank in turn while the others wait at a barrier,
    so a measurement never shares the host or the PCIe root with another rank's.
    ``group``: the process group to wait in (a gloo group waits on the CPU, with no
    kernel polling on the waiting ranks' GPUs)."""
    mine: dict = {}
    for turn in range(runtime.world_size):
        if turn == runtime.rank:
            mine = measure()
        if runtime.world_size > 1:
            dist.barrier(group=group)
    return mine


def pcie_link(index: int = 0) -> dict | None:
    """The PCIe generation and width the driver reports for GPU ``index`` (current and
    maximum), from ``nvidia-smi``; None where it cannot say."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        gen, gen_max, width, width_max = (int(v) for v in out.stdout.strip().split(","))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return {"gen": gen, "gen_max": gen_max, "width": width, "width_max": width_max}


@dataclass
class TransferBenchConfig(ResultConfig):
    """Measure host-device copies on every rank's GPU, one rank at a time, and write one result JSON."""

    sizes: str = option("4KB:1GB", "comma list or a range in powers of 4 (4KB:1GB)")
    repeats: int = option(10, "timed copies per size and mode")
    loader_epochs: int = option(1, "epochs per input-pipeline variant (0 skips the DataLoader comparison)")
    loader_repeats: int = option(3, "rounds of the DataLoader comparison, the variants taking turns in each")


def measure_gpu(sizes: list[int], repeats: int, device: torch.device) -> dict:
    """Everything one rank measures on its own GPU."""
    require_cuda("distlab.bench.transfer")
    index = device.index or 0
    mine = {"gpu": torch.cuda.get_device_name(device), "pcie_link": pcie_link(index)}
    mine["bandwidth"] = copy_bandwidth(sizes, repeats=repeats)
    mine["pinning_cost"] = pinning_cost([s for s in sizes if s >= 1 << 20])
    mine["pinned_loader"] = pinned_loader_cost()
    mine["non_blocking_hazard"] = non_blocking_read_hazard()
    mine["overlap"] = overlap_experiment()
    return mine


@entry_point(TransferBenchConfig)
def main(cfg: TransferBenchConfig) -> None:
    sizes = parse_sizes(cfg.sizes)
    require_cuda("distlab.bench.transfer")
    with distributed("cuda", timeout_s=3600) as runtime:  # ranks wait while the others measure
        runtime.log(
            f"distlab.bench.transfer: {len(sizes)} sizes on {runtime.describe()}, "
            f"{torch.cuda.get_device_name(runtime.device)}"
        )
        host_side = None
        if runtime.is_main:  # the host is shared: measured once, before any rank touches its GPU
            host_side = host.measure_host([64 << 20], [2 << 20])
        turns = dist.new_group(backend="gloo") if runtime.world_size > 1 else None  # waiting ranks idle on the CPU
        measure = lambda: measure_gpu(sizes, cfg.repeats, runtime.device)
        mine = {"rank": runtime.rank, **one_rank_at_a_time(runtime, measure, group=turns)}
        runtime.log(
            f"  overlap (rank 0): serial {mine['overlap']['serial_s'] * 1e3:.1f} ms, overlapped "
            f"{mine['overlap']['overlapped_s'] * 1e3:.1f} ms"
        )
        loader = (
            loader_end_to_end(runtime, epochs=cfg.loader_epochs, repeats=cfg.loader_repeats)
            if cfg.loader_epochs > 0
            else []
        )
        ranks = gather_per_rank(mine, runtime)
        name = cfg.output.name or f"transfer-{runtime.world_size}x{mine['gpu'].replace(' ', '-')}"
        finish_run(
            runtime,
            cfg.output.out,
            name,
            "transfer",
            {**asdict(cfg), "sizes": sizes},
            {"ranks": ranks, "loader": loader, "host": host_side},
        )


if __name__ == "__main__":
    run_main(main)
