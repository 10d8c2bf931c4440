"""Host-to-device copies, measured: pageable against pinned memory,
``non_blocking`` and what it really does, copy/compute overlap, and the
DataLoader end to end.

    torchrun --standalone --nproc_per_node=2 -m distlab.bench.transfer --sizes 4KB:1GB --out results

Every rank measures its own GPU; rank 0 writes one result file holding
every rank's measurements. Everything here needs CUDA: on a machine without
a GPU each entry point stops with one sentence saying so.

Timing conventions: CUDA events bracket the copy on its stream (the time the
DMA engine took); ``host_blocked_s`` is how long the Python call itself
blocked, which is what ``non_blocking=True`` changes. Warm-ups first, then
the median and quartiles of the repetitions.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..cli import ResultConfig, finish_run, option, parse
from ..runtime import DistlabError, distributed, gather_per_rank, run_main
from .harness import parse_sizes, summarize_times

MODES = ("pageable", "pageable+non_blocking", "pinned", "pinned+non_blocking")


def require_cuda(what: str) -> torch.device:
    """The current CUDA device, or one sentence saying this needs a GPU."""
    if not torch.cuda.is_available():
        raise DistlabError(
            f"{what} needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False): run it "
            "on a GPU machine such as a Kaggle 'GPU T4 x2' kernel"
        )
    return torch.device("cuda", torch.cuda.current_device())


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


def pinning_cost(sizes: list[int], repeats: int = 3) -> list[dict]:
    """What pinning itself costs: ``tensor.pin_memory()`` (allocate page-locked
    memory and copy into it) against an ordinary copy of the same tensor."""
    require_cuda("measuring the cost of pinning")
    rows = []
    for size in sizes:
        source = _host_buffer(size, pinned=False)
        pin, clone = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            pinned = source.pin_memory()
            pin.append(time.perf_counter() - started)
            del pinned
            started = time.perf_counter()
            copied = source.clone()
            clone.append(time.perf_counter() - started)
            del copied
        rows.append(
            {
                "bytes": size,
                "pin_memory_s": summarize_times(pin)["time_s"],
                "pageable_clone_s": summarize_times(clone)["time_s"],
            }
        )
    return rows


def pinned_loader_cost(
    batches: int = 30, batch_size: int = 128, image_shape=(3, 224, 224), num_workers: int = 2
) -> dict:
    """Seconds per batch to iterate a DataLoader with ``pin_memory`` off and on,
    copying nothing to the GPU: what the pinning thread itself costs (or hides)."""
    require_cuda("measuring a pinned DataLoader")
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randint(0, 255, (batch_size * batches, *image_shape), dtype=torch.uint8))
    seconds = {}
    for pin in (False, True):
        loader = DataLoader(data, batch_size=batch_size, num_workers=num_workers, pin_memory=pin)
        started = time.perf_counter()
        for (batch,) in loader:
            assert batch.is_pinned() == pin
        seconds["pinned" if pin else "pageable"] = (time.perf_counter() - started) / batches
    return {"batch_bytes": batch_size * int(torch.tensor(image_shape).prod()), "seconds_per_batch": seconds}


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


def loader_end_to_end(
    runtime, epochs: int = 1, batch_size: int = 128, max_steps: int = 0, synthetic_size: int = 60000
) -> list[dict]:
    """Train the course CNN with each input pipeline, one after another on
    the same GPU(s): pin_memory and non_blocking on and off, and the
    device-resident loader. Returns samples/s per variant."""
    require_cuda("the DataLoader end-to-end comparison")
    from ..config import TrainConfig
    from ..train import train

    variants = {
        "pin_memory off, non_blocking off": dict(pin_memory=False, non_blocking=False),
        "pin_memory off, non_blocking on": dict(pin_memory=False, non_blocking=True),
        "pin_memory on, non_blocking off": dict(pin_memory=True, non_blocking=False),
        "pin_memory on, non_blocking on": dict(pin_memory=True, non_blocking=True),
        "device-resident": dict(loader="device"),
    }
    rows = []
    for name, options in variants.items():
        cfg = TrainConfig.from_flags(
            strategy="ddp",
            model="cnn",
            dataset="synthetic",
            device="cuda",
            epochs=epochs,
            batch_size=batch_size,
            max_steps=max_steps,
            synthetic_size=synthetic_size,
            num_workers=2,
            log_every=-1,
            **options,
        )
        history = train(cfg, runtime).history
        rows.append(
            {
                "variant": name,
                "samples_per_s": history[-1]["samples_per_s"],
                "epoch_time_s": history[-1]["epoch_time_s"],
                "data_wait_s": history[-1]["data_wait_s"],
                "config": cfg.to_dict(),
            }
        )
        runtime.log(f"  {name:<34} {rows[-1]['samples_per_s']:>10,.0f} samples/s")
    return rows


@dataclass
class TransferBenchConfig(ResultConfig):
    """Measure host-device copies on every rank's GPU and write one result JSON."""

    sizes: str = option("4KB:1GB", "comma list or a range in powers of 4 (4KB:1GB)")
    repeats: int = option(10, "timed copies per size and mode")
    loader_epochs: int = option(1, "epochs per input-pipeline variant (0 skips the DataLoader comparison)")


def main(argv: list[str] | None = None) -> None:
    cfg = parse(TransferBenchConfig, argv)
    sizes = parse_sizes(cfg.sizes)
    require_cuda("distlab.bench.transfer")
    with distributed("cuda") as runtime:
        runtime.log(
            f"distlab.bench.transfer: {len(sizes)} sizes on {runtime.describe()}, "
            f"{torch.cuda.get_device_name(runtime.device)}"
        )
        mine = {"rank": runtime.rank, "gpu": torch.cuda.get_device_name(runtime.device)}
        mine["bandwidth"] = copy_bandwidth(sizes, repeats=cfg.repeats)
        runtime.log("  bandwidth done")
        mine["pinning_cost"] = pinning_cost([s for s in sizes if s >= 1 << 20])
        mine["pinned_loader"] = pinned_loader_cost()
        mine["non_blocking_hazard"] = non_blocking_read_hazard()
        mine["overlap"] = overlap_experiment()
        runtime.log(
            f"  overlap: serial {mine['overlap']['serial_s'] * 1e3:.1f} ms, overlapped "
            f"{mine['overlap']['overlapped_s'] * 1e3:.1f} ms"
        )
        loader = loader_end_to_end(runtime, epochs=cfg.loader_epochs) if cfg.loader_epochs > 0 else []
        ranks = gather_per_rank(mine, runtime)
        name = cfg.output.name or f"transfer-{runtime.world_size}x{mine['gpu'].replace(' ', '-')}"
        finish_run(
            runtime,
            cfg.output.out,
            name,
            "transfer",
            {**asdict(cfg), "sizes": sizes},
            {"ranks": ranks, "loader": loader},
        )


if __name__ == "__main__":
    run_main(main)
