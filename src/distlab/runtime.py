"""Start and end a process group, and know who we are in it.

One context manager, :func:`distributed`, is the only place in distlab that
calls ``init_process_group``. It reads torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); without it
(a plain ``python`` run or a notebook cell) it makes a one-rank group in
memory, so every code path can call collectives the same way.

The backend follows the device: NCCL for CUDA, gloo otherwise. A group that
is already initialised is reused and left alone on exit.
"""

from __future__ import annotations

import gc
import importlib
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import DistlabError, FailureReports, collective_failure

LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The reduced-precision dtypes a command line can name; anything else means fp32."""


@dataclass(frozen=True)
class Runtime:
    """Where this process stands in the job."""

    rank: int
    """Global rank, 0 .. world_size-1."""
    local_rank: int
    """Rank on this machine; picks the GPU."""
    world_size: int
    """Number of ranks in the job."""
    device: torch.device
    """Device this rank computes on."""
    backend: str
    """``nccl`` or ``gloo``."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, *args, **kwargs) -> None:
        """Print on rank 0 only, flushed so progress shows under torchrun."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def describe(self) -> str:
        return f"{self.world_size} rank(s), backend {self.backend}, device {self.device.type}"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def resolve_device(device: str, local_rank: int, backend: str = "auto") -> torch.device:
    """Turn ``auto|cpu|cuda`` into this rank's device, or say why not."""
    if device not in ("auto", "cpu", "cuda"):
        raise DistlabError(f"unknown device {device!r}: use auto, cpu or cuda")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistlabError(
            "--device cuda was asked for but this machine has no usable CUDA GPU; run with --device cpu (gloo) instead"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        if backend == "gloo":
            # gloo lets several ranks share one GPU (NCCL refuses it).
            return torch.device("cuda", local_rank % count)
        raise DistlabError(
            f"local rank {local_rank} needs GPU {local_rank} but only {count} GPU(s) are visible: "
            f"use --nproc_per_node={count}, or --backend gloo to share GPUs, or --device cpu",
            every_rank=True,
        )
    return torch.device("cuda", local_rank)


def pick_backend(device: torch.device, backend: str = "auto") -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise DistlabError(f"unknown backend {backend!r}: use auto, gloo or nccl")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise DistlabError("the nccl backend needs CUDA tensors: use --backend gloo with --device cpu")
    return backend


GROUP_AS_DEFAULT_ARGUMENT = ("torch.distributed.nn", "torch.distributed.fsdp.sharded_grad_scaler")
"""torch modules whose functions take ``group=dist.group.WORLD`` as a default argument, which Python evaluates
once, when the module is imported: imported after ``init_process_group`` (DDP's first use imports
``torch.distributed.nn``, through ``torch._dynamo``; distlab's FSDP imports the sharded GradScaler), they hold
the default group for the life of the process, past ``destroy_process_group``. :func:`distributed` imports them
before it creates the group, while ``group.WORLD`` is still None."""


def _release_group(collect: bool = True) -> None:
    """Destroy the process group so that it is really gone: nothing may still hold it. A gloo group that outlives
    ``destroy_process_group`` keeps its worker threads; it is then destroyed where that is unsafe: by a C++
    owner (DDP's Reducer) with the GIL held, while a worker thread waits for the GIL to free a tensor (a
    deadlock), or at interpreter shutdown, where a worker thread that asks for the GIL is ended by
    ``pthread_exit`` inside a destructor: ``terminate called without an active exception`` (SIGABRT).
    FSDP's modules and hooks form reference cycles, which only a collection frees: here (a tenth of a second)
    unless the body failed, whose rank must first say why (:func:`run_main` collects once it has)."""
    if collect:
        gc.collect()
    dist.destroy_process_group()


@contextmanager
def distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> Iterator[Runtime]:
    """Run the body inside a process group; tear it down however the body ends.

    ``timeout_s`` bounds every collective, so a rank whose peer died raises an
    error instead of waiting forever. The body must not keep what holds the group (a DDP or FSDP model) past
    its end: call a function inside the ``with`` and keep only its plain results (:func:`_release_group`).
    """
    launched = "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)

    target = resolve_device(device, local_rank, backend)
    chosen = pick_backend(target, backend)
    if target.type == "cuda":
        torch.cuda.set_device(target)

    owns_group = not dist.is_initialized()
    reports = None
    if owns_group:
        for module in GROUP_AS_DEFAULT_ARGUMENT:
            importlib.import_module(module)
        kwargs = dict(backend=chosen, timeout=timedelta(seconds=timeout_s))
        if chosen == "nccl":
            kwargs["device_id"] = target
        if launched:
            # torchrun keeps one store across restarts: each attempt takes keys of its own, or a restarted
            # rank can read a dead attempt's address (gloo) or unique id (NCCL) before its peer rewrites it.
            store, rank, world_size = next(dist.rendezvous("env://", timeout=kwargs["timeout"]))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt{attempt}/", store)
            dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)
            reports = FailureReports(store, rank, world_size, timeout_s)
        else:
            # One rank, no launcher: an in-memory store needs no port.
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        chosen = dist.get_backend()
        rank, world_size = dist.get_rank(), dist.get_world_size()

    runtime = Runtime(rank=rank, local_rank=local_rank, world_size=world_size, device=target, backend=chosen)
    failed = True
    try:
        yield runtime
        failed = False
    except BaseException as err:
        if reports is not None and collective_failure(err):
            err.distlab_reports = reports
        if owns_group:
            # The traceback keeps the failed body's frames, and with them its model, which holds the group:
            # their locals go before the group does (the traceback still names every line).
            traceback.clear_frames(err.__traceback__)
        raise
    else:
        if reports is not None and rank == 0:
            reports.finished()
    finally:
        if owns_group and dist.is_initialized():
            _release_group(collect=not failed)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_per_rank(value: Any, runtime: Runtime) -> list[Any] | None:
    """Every rank's ``value`` (any picklable object), in rank order, on rank 0;
    ``None`` elsewhere. Results store it as ``metrics["ranks"]``."""
    if runtime.world_size == 1:
        return [value]
    gathered: list[Any] | None = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered
