"""Start and end a process group, and know who we are in it.

One context manager, :func:`distributed`, is the only place in distlab that
calls ``init_process_group``. It reads torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); without it
(a plain ``python`` run or a notebook cell) it makes a one-rank group in
memory, so every code path can call collectives the same way.

Where a job runs is decided once, by :func:`place`, in the process that launches the ranks (a notebook, the
GPU report, the exercise grader, ``labs.launch``): how many ranks, on which device, with which backend. The
ranks get the answer as ``--device``/``--backend`` and never decide again. The backend follows the device:
NCCL for CUDA, gloo otherwise; a CUDA group also carries a gloo leg (``cpu:gloo,cuda:nccl``, as torchtitan
builds it), so a CPU tensor in a collective is legal on every run. A group that is already initialised is
reused and left alone on exit.
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
from typing import Any, Literal

import torch
import torch.distributed as dist

from .errors import DistlabError, FailureReports, collective_failure
from .measure import hardware

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
    """``nccl`` or ``gloo``: what carries the training's collectives (on CUDA with NCCL, the group also has a gloo
    leg for CPU tensors, :data:`CPU_LEG`)."""
    placement: Placement | None = None
    """The job's placement this rank was started with (:func:`distributed` sets it): what it shares with the
    other ranks on its machine is read here, never from the machine again. None for a Runtime built by hand."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def collective_device(self) -> torch.device:
        """Where a tensor made for a collective goes: the GPU on NCCL, the host on gloo (gloo moves host memory)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def reduce(self, values, op: Literal["sum", "max", "min", "mean"] = "sum") -> list[float]:
        """``values`` (numbers) combined over every rank, elementwise: torchtitan's ``dist_max``/``dist_mean``. The
        tensor is made here, on :attr:`collective_device`, so no caller builds one on the wrong device."""
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.collective_device)
        if self.world_size > 1:
            reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                         "min": dist.ReduceOp.MIN}[op]  # fmt: skip
            dist.all_reduce(tensor, op=reduce_op)
        if op == "mean":
            tensor /= self.world_size
        return tensor.tolist()

    def log(self, *args, **kwargs) -> None:
        """Print on rank 0 only, flushed so progress shows under torchrun."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def describe(self) -> str:
        return f"{self.world_size} rank(s), backend {self.backend}, device {self.device.type}"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def launched_world_size() -> int:
    """The number of ranks the launcher started (torchrun's ``WORLD_SIZE``; 1 without a launcher): known on every
    rank before any group exists, so a job of the wrong size can be refused before its ranks connect."""
    return _env_int("WORLD_SIZE", 1)


CPU_LEG = "cpu:gloo,cuda:nccl"
"""What a CUDA group with NCCL is created with: NCCL for CUDA tensors, gloo for CPU ones (a step time, a flag,
a count). NCCL alone refuses a CPU tensor ("No backend type associated with device type cpu")."""
CPU_RANKS = 2
"""Ranks a job runs without a GPU when the caller does not say: the fewest that show anything distributed."""


def gpu_count() -> int:
    """The CUDA GPUs this process can use. :func:`place` is the only code that reads it to decide anything."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Placement:
    """Where a job runs, decided once by :func:`place` and passed to its ranks as values."""

    ranks: int
    device: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    gpus: int
    """GPUs on the machine (not all of them need be used)."""
    reason: str
    """One line for a learner: what runs where, and what differs from one rank per GPU."""

    @property
    def args(self) -> tuple[str, ...]:
        """What a rank's command line gets, so that it never decides again."""
        return ("--device", self.device, "--backend", self.backend)

    @property
    def shares_gpus(self) -> bool:
        return self.device == "cuda" and self.ranks > self.gpus

    def gpu_of(self, local_rank: int) -> int | None:
        """The GPU ``local_rank`` computes on (ranks beyond the GPU count share them, gloo only); None on the CPU."""
        return local_rank % self.gpus if self.device == "cuda" else None


ShortOfGpus = Literal["share", "cpu", "shrink", "refuse"]


def place(
    ranks: int | None = None,
    device: str = "auto",
    backend: str = "auto",
    *,
    gpus: int | None = None,
    short_of_gpus: ShortOfGpus = "share",
) -> Placement:
    """How many ranks, on which device, with which backend, for a job on a machine with ``gpus`` GPUs (this
    machine's when None; tests pass 0, 1, 2, 4, 8).

    ``ranks=None`` is one rank per GPU, or :data:`CPU_RANKS` on the CPU. NCCL needs one GPU per rank; when a job
    asks for more ranks than GPUs, ``short_of_gpus`` says what happens with ``device="auto"``: ``share``, gloo
    ranks share the GPUs (rank r on GPU r mod gpus); ``cpu``, gloo ranks on the CPU; ``shrink``, one NCCL rank
    per GPU (at least two GPUs, else the CPU); ``refuse``, a DistlabError. Every refusal is one line that says
    what to pass instead, raised here, before any rank starts."""
    gpus = gpu_count() if gpus is None else gpus
    if device not in ("auto", "cpu", "cuda"):
        raise DistlabError(f"unknown device {device!r}: use auto, cpu or cuda")
    if backend not in ("auto", "gloo", "nccl"):
        raise DistlabError(f"unknown backend {backend!r}: use auto, gloo or nccl")
    if ranks is not None and ranks < 1:
        raise DistlabError(f"a job needs at least one rank, not {ranks}")
    if device == "cuda" and gpus == 0:
        raise DistlabError("--device cuda was asked for but this machine has no usable CUDA GPU: use --device cpu")
    if device == "cpu" or (device == "auto" and gpus == 0):
        if backend == "nccl":
            raise DistlabError("the nccl backend needs CUDA tensors: use --backend gloo with --device cpu")
        n = ranks or CPU_RANKS
        why = "no GPU here" if gpus == 0 else "the CPU was asked for"
        return Placement(n, "cpu", "gloo", gpus, f"{n} gloo rank(s) on the CPU ({why})")
    n = ranks or gpus
    if n <= gpus:
        chosen = "gloo" if backend == "gloo" else "nccl"
        return Placement(n, "cuda", chosen, gpus, f"{n} {chosen.upper()} rank(s), one per GPU ({gpus} GPU(s) here)")
    one_each = f"NCCL needs one GPU per rank and this machine has {gpus}"
    if short_of_gpus == "shrink" and gpus >= 2 and backend != "gloo":
        return Placement(gpus, "cuda", "nccl", gpus, f"{gpus} NCCL ranks, one per GPU, instead of {n}")
    if backend == "nccl" or (backend == "auto" and short_of_gpus == "refuse"):
        raise DistlabError(
            f"{n} ranks asked for: {one_each}; run {gpus} rank(s), or pass --backend gloo to share the GPU(s), "
            "or --device cpu"
        )
    if backend == "gloo" or short_of_gpus == "share" or device == "cuda":
        each = "it" if gpus == 1 else f"them (rank r on GPU r mod {gpus})"
        why = f"{n} gloo ranks share {gpus} GPU(s): {one_each}, so gloo shares {each}"
        return Placement(n, "cuda", "gloo", gpus, why)
    return Placement(n, "cpu", "gloo", gpus, f"{n} gloo ranks on the CPU: {one_each}")


def rank_placement(device: str, backend: str, local_world_size: int, gpus: int | None = None) -> Placement:
    """What a rank started with ``--device``/``--backend`` runs on: the launcher decided with :func:`place`, and
    the same call here gives the same answer. ``auto`` from a launcher that did not decide refuses more ranks
    than GPUs instead of guessing (the same refusal on every rank: rank 0 says it)."""
    return place(local_world_size, device, backend, gpus=gpus, short_of_gpus="refuse")


def rank_device(placement: Placement, local_rank: int) -> torch.device:
    index = placement.gpu_of(local_rank)
    return torch.device("cpu") if index is None else torch.device("cuda", index)


def group_backend(backend: str) -> str:
    """What ``init_process_group`` is given for ``backend``: NCCL gets a gloo leg for CPU tensors."""
    return CPU_LEG if backend == "nccl" else backend


START_TIMEOUT_S = 300.0
"""How long the ranks may take to meet, whatever the collectives' timeout: starting several processes on a busy
machine can take longer than a short timeout (a demo's 3 s, an exercise check's 4 s), and that is no failure of
the job's. A rank that never arrives is still reported, after this long."""


def set_group_timeout(timeout: timedelta) -> None:
    """The default group's timeout, for every collective from now on (torch 2.10 has only the private name)."""
    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    setter(timeout)


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


def set_nccl_transport_here() -> None:
    """NCCL's transport for this machine's GPUs, set in this rank's own environment before its communicator is
    made (NCCL reads it then): on GPUs without peer access (a T4 pair) ``NCCL_P2P_DISABLE=1`` and
    ``NCCL_CUMEM_HOST_ENABLE=0`` (:func:`distlab.measure.hardware.set_nccl_transport`), nothing elsewhere. Decided
    here, where every NCCL rank starts, so no launcher (a lab's ``!torchrun``, the tests' ``run_torchrun``, the
    grader's forked ranks, a learner's own ``check(..., device="cuda")``) can forget it; a value the launcher set
    is kept. Silent: the launcher, not every rank, says it (a lab's first cell, the GPU report)."""
    hardware.set_nccl_transport(hardware.survey(topology=False), os.environ)


@contextmanager
def distributed(
    device: str = "auto", backend: str = "auto", timeout_s: float = 300.0, start_timeout_s: float | None = None
) -> Iterator[Runtime]:
    """Run the body inside a process group; tear it down however the body ends.

    ``timeout_s`` bounds every collective, so a rank whose peer died raises an error instead of waiting
    forever; the ranks' meeting has a bound of its own, ``start_timeout_s``, by default the longer of
    ``timeout_s`` and :data:`START_TIMEOUT_S`. The body must not keep what holds the group (a DDP or FSDP
    model) past its end: call a function inside the ``with`` and keep only its plain results
    (:func:`_release_group`).
    """
    launched = "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", 0)
    world_size = launched_world_size()
    local_rank = _env_int("LOCAL_RANK", 0)

    placement = rank_placement(device, backend, _env_int("LOCAL_WORLD_SIZE", world_size))
    target, chosen = rank_device(placement, local_rank), placement.backend
    if target.type == "cuda":
        torch.cuda.set_device(target)

    owns_group = not dist.is_initialized()
    reports = None
    if owns_group:
        for module in GROUP_AS_DEFAULT_ARGUMENT:
            importlib.import_module(module)
        timeout = timedelta(seconds=timeout_s)
        start = timedelta(seconds=start_timeout_s or max(timeout_s, START_TIMEOUT_S))
        kwargs = dict(backend=group_backend(chosen), timeout=start)
        if chosen == "nccl":
            kwargs["device_id"] = target
            set_nccl_transport_here()
        if launched:
            # torchrun keeps one store across restarts: each attempt takes keys of its own, or a restarted
            # rank can read a dead attempt's address (gloo) or unique id (NCCL) before its peer rewrites it.
            store, rank, world_size = next(dist.rendezvous("env://", timeout=start))
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt{attempt}/", store)
            dist.init_process_group(store=store, rank=rank, world_size=world_size, **kwargs)
            store.set_timeout(timeout)
            reports = FailureReports(store, rank, world_size, timeout_s)
        else:
            # One rank, no launcher: an in-memory store needs no port.
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        set_group_timeout(timeout)  # every rank has met: from here on the collectives' own bound
    else:
        chosen = "nccl" if "nccl" in dist.get_backend() else "gloo"  # a group with a gloo leg names both
        rank, world_size = dist.get_rank(), dist.get_world_size()

    runtime = Runtime(rank, local_rank, world_size, target, chosen, placement)
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
