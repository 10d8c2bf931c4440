"""The tests' harness: real gloo ranks on the CPU (started the way :mod:`distlab.jobs` starts every rank: fresh
ones for one call, :func:`run_ranks`, or a :class:`RankPool` of them for many), an entry point run in-process on a
pool, torchrun as a subprocess, the toy models every wrapper must train alike, and what the tests compare with.
Only tests import it (``tests/test_layout.py``): what the library, the demos and the pages share with the tests
lives in the library (the tolerances and :class:`~distlab.models.ToyWithFrozen` in :mod:`distlab.models`, the
tiny MNIST in :mod:`distlab.data`).

Functions run on ranks must be importable (module-level), because they are pickled to the ranks.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from .jobs import (
    RANK_START_METHOD,
    become_rank,
    hosted_rendezvous,
    launcher_environment,
    rank_context,
    run_job,
    torchrun_command,
)
from .models import ATOL, RTOL, MnistCNN, ToyWithFrozen, reset_module

CNN_PARAMETERS = 405_898
"""Parameters of the reference notes' MNIST CNN (:class:`distlab.models.MnistCNN`)."""


def run_torchrun(nproc: int, target: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a torchrun job to completion, one thread per rank, capturing its output."""
    return run_job(torchrun_command(nproc, target, *args), timeout=timeout, env=launcher_environment(1))


PRELOAD = ("distlab.train", "distlab.testing")
"""What the rank server imports for the tests' ranks, besides torch (:func:`distlab.jobs.rank_context`): the
library a test's ranks train with, and this harness, whose functions every rank runs first."""


def _rank_entry(rank: int, world_size: int, rendezvous: dict[str, str], fn, args, out_dir: str) -> None:
    become_rank(rank, world_size, rendezvous)
    from .runtime import distributed

    with distributed("cpu", timeout_s=120) as runtime:
        value = fn(runtime, *args)  # what fn built (a DDP or FSDP model holds the group) is gone when it returns
    torch.save(value, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(fn, world_size: int, tmp_path: Path, *args) -> list:
    """Run ``fn(runtime, *args)`` on ``world_size`` fresh gloo ranks (a group of their own, ended when ``fn``
    returns) and return each rank's return value, in rank order. Assert in the caller, not on the ranks: a
    failure inside a rank surfaces only as an opaque spawn error. :class:`RankPool` runs many such calls on
    ranks started once."""
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    out_dir = Path(tempfile.mkdtemp(prefix=f"ranks-{fn.__name__}-{world_size}-", dir=tmp_path))
    rank_context(*PRELOAD)  # sets the server's preload before mp.start_processes starts it
    with hosted_rendezvous() as rendezvous:
        mp.start_processes(
            _rank_entry,
            args=(world_size, rendezvous, fn, args, str(out_dir)),
            nprocs=world_size,
            join=True,
            start_method=RANK_START_METHOD,
        )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


GROUP_GRACE_S = 60.0
"""How much longer than a :class:`RankPool` call's bound its ranks' collectives wait: the pool stops a call that
hangs, and a rank whose caller is gone still ends."""
PEERS_GRACE_S = 2.0
"""How long a :class:`RankPool` call waits for the other ranks once one has raised or ended: a peer that waits for
it in a collective never answers, and the call fails now, not at its timeout."""


class RankFailed(RuntimeError):
    """A call on a :class:`RankPool` that raised on a rank, timed out, lost a rank or left behind what cannot be
    undone; the pool is gone."""


def call_seed(call: int, rank: int) -> int:
    """The seed of torch's and Python's generators on ``rank`` for a pool's ``call``-th call (from 1): the same
    in every run of the same calls, so that a failure that depends on a draw happens again."""
    return 1000 * call + rank


def _packed(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpacked(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _process_state() -> tuple:
    """What a call may change in its rank's process that the pool puts back after it: cheap and safe to restore."""
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    return dict(os.environ), os.getcwd(), torch.is_grad_enabled(), threads, deterministic, random.getstate()


def _restore(state: tuple) -> None:
    environment, cwd, grad_enabled, threads, (deterministic, warn_only), random_state = state
    if dict(os.environ) != environment:
        os.environ.clear()
        os.environ.update(environment)
    os.chdir(cwd)
    torch.set_grad_enabled(grad_enabled)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    random.setstate(random_state)
    torch.set_default_dtype(torch.float32)


def _lasting_state() -> tuple[set[int], dict[str, dict[str, int]]]:
    """What the pool cannot put back after a call: its process groups, and each attribute of distlab's loaded
    modules (by id: a monkeypatch rebinds one)."""
    modules = {n: m for n, m in list(sys.modules.items()) if n.split(".")[0] == "distlab" and m is not None}
    groups = dist.distributed_c10d._world.pg_map  # every group this process is in (torch has no public list)
    return set(map(id, groups)), {
        name: {key: id(value) for key, value in vars(module).items()} for name, module in modules.items()
    }


def _left_behind(before: tuple, after: tuple) -> list[str]:
    (groups, modules), (groups_now, modules_now) = before, after
    left = [f"{len(groups_now - groups)} new process group(s)"] if groups_now - groups else []
    left += ["ended the pool's process group"] if groups - groups_now else []
    for name, attributes in modules.items():
        now = modules_now.get(name, {})
        left += [f"{name}.{key} rebound" for key, value in attributes.items() if now.get(key) != value]
    return left


def _call_afresh(rank: int, runtime, fn, args, seed: int) -> tuple[str, object]:
    """``fn(runtime, *args)`` as on a fresh rank: its seed, float32 by default, the state :func:`_process_state`
    names put back after it, and a call that leaves behind what cannot be put back refused in words."""
    state, lasting = _process_state(), _lasting_state()
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        answer = ("value", fn(runtime, *args))
    except BaseException as err:  # noqa: BLE001 - sent to the caller, which raises it there
        return "raised", f"rank {rank}: {''.join(traceback.format_exception(err)).rstrip()}"
    finally:
        _restore(state)
    left = _left_behind(lasting, _lasting_state())
    if left:
        return "raised", (
            f"rank {rank}: {fn.__name__} left behind what the pool cannot undo ({'; '.join(left)}): undo it before "
            "the call returns, or use run_ranks (fresh ranks) for a test that changes process-wide state"
        )
    return answer


def _pool_rank(rank: int, world_size: int, rendezvous: dict[str, str], connection, timeout_s: float) -> None:
    """One rank of a :class:`RankPool`: join the group once, then run each call sent (:func:`_call_afresh`) until
    told to stop. The library's ``distributed()`` finds the group and leaves it alone."""
    become_rank(rank, world_size, rendezvous)
    from .runtime import distributed

    # the caller bounds each call (timeout_s); a collective waits longer, so a call that hangs is named as one
    with distributed("cpu", timeout_s=timeout_s + GROUP_GRACE_S) as runtime:
        connection.send_bytes(b"ready")
        while (message := connection.recv_bytes()) != b"stop":
            fn, args, call = _unpacked(message)
            connection.send_bytes(_packed(_call_afresh(rank, runtime, fn, args, call_seed(call, rank))))


class RankPool:
    """``world_size`` gloo ranks started once and joined in one group, on which many calls run:
    ``pool.run(fn, *args)`` runs ``fn(runtime, *args)`` on every rank and returns each rank's value, as
    :func:`run_ranks` does, without starting processes and a group for each call (PyTorch's own
    ``MultiProcContinuousTest`` keeps its processes the same way).

    Each call starts alike (:func:`_call_afresh`; its seeds :func:`call_seed`). A call that raises on any rank,
    does not end within ``timeout_s``, loses a rank or leaves behind what cannot be undone stops every rank and
    raises :class:`RankFailed` with each rank's own words: the group may be mid-collective, so the next call
    starts a fresh pool. Tests that are about a group's lifetime, failures or timeouts use :func:`run_ranks`."""

    def __init__(self, world_size: int, timeout_s: float = 120.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        self.calls = 0  # every call so far, across restarts: it numbers the seeds
        self._ranks: list = []
        self._connections: list = []
        self._store = ExitStack()  # the rendezvous store, held while the ranks live

    def _start(self) -> None:
        context = rank_context(*PRELOAD)
        rendezvous = self._store.enter_context(hosted_rendezvous())
        for rank in range(self.world_size):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_pool_rank, args=(rank, self.world_size, rendezvous, theirs, self.timeout_s), daemon=True
            )
            process.start()
            theirs.close()
            self._ranks.append(process)
            self._connections.append(mine)
        self._collect("start", lambda data: ("value", data))

    def _answer(self, rank: int, read) -> tuple[str, object]:
        """What ``rank``, found ready, said: its answer, or that it ended."""
        if self._connections[rank].poll():
            try:
                return read(self._connections[rank].recv_bytes())
            except (EOFError, OSError):  # it ended while answering, or before
                pass
        self._ranks[rank].join(5)
        return "ended", f"rank {rank}: ended (exit code {self._ranks[rank].exitcode})"

    def _collect(self, what: str, read) -> list:
        """Each rank's value, in rank order. Every rank is waited on at once: once one raises or ends, the others
        get :data:`PEERS_GRACE_S` more, then the pool stops and :class:`RankFailed` says what each rank did."""
        answers: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(answers) < self.world_size and (left := deadline - time.monotonic()) > 0:
            waiting = [rank for rank in range(self.world_size) if rank not in answers]
            ready = set(wait([x for r in waiting for x in (self._connections[r], self._ranks[r].sentinel)], left))
            for rank in waiting:
                if {self._connections[rank], self._ranks[rank].sentinel} & ready:
                    answers[rank] = self._answer(rank, read)
                    if answers[rank][0] != "value":
                        deadline = min(deadline, time.monotonic() + PEERS_GRACE_S)
        unanswered = [rank for rank in range(self.world_size) if answers.get(rank, ("",))[0] != "value"]
        if not unanswered:
            return [answers[rank][1] for rank in range(self.world_size)]
        self.close(wait=False)
        failed = any(kind != "value" for kind, _ in answers.values())
        silent = "still in the call (waiting for a peer?)" if failed else f"gave no answer within {self.timeout_s:g} s"
        words = [answers[rank][1] if rank in answers else f"rank {rank}: {silent}" for rank in unanswered]
        seeds = f" (call {self.calls}: seed {call_seed(self.calls, 0)} + rank)" if what != "start" else ""
        raise RankFailed(f"{what} failed{seeds}:\n" + "\n".join(words))

    def run(self, fn, *args) -> list:
        """``fn(runtime, *args)`` on every rank (``fn`` importable, as for :func:`run_ranks`); each rank's value."""
        if not self._ranks:
            self._start()
        self.calls += 1
        message = _packed((fn, args, self.calls))
        for connection in self._connections:
            connection.send_bytes(message)
        return self._collect(fn.__name__, _unpacked)

    def close(self, wait: bool = True) -> None:
        """Stop every rank and the store: each leaves its group when asked, and one that does not within 10 s is
        killed. After a failed call (``wait=False``) the group may be mid-collective: every rank is killed at once."""
        for connection in self._connections:
            try:
                connection.send_bytes(b"stop")
            except OSError:
                pass
        for process in self._ranks:
            process.join(10 if wait else 0)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self._connections:
            connection.close()
        self._store.close()
        self._ranks, self._connections = [], []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _entry_point(runtime, module: str, argv: list[str]) -> None:
    importlib.import_module(module).main(argv)


def run_entry(pool: RankPool, module: str, *argv) -> None:
    """``python -m module *argv`` as torchrun runs it, but in-process on the ranks of ``pool``: the entry point's
    ``main(argv)``, whose ``distributed()`` finds the pool's group and leaves it alone. For a test of what the
    entry point computes; what it does as a process (its exit code, its one line on stderr) is tested with
    :func:`run_torchrun`."""
    pool.run(_entry_point, module, [str(arg) for arg in argv])


def written_file(notebook: Path, filename: str) -> str:
    """What a lab notebook writes to ``filename`` with ``%%writefile``: the one cell that does, without the magic."""
    cells = ["".join(c["source"]) for c in json.loads(Path(notebook).read_text())["cells"] if c["cell_type"] == "code"]
    written = [source for source in cells if source.startswith(f"%%writefile {filename}\n")]
    assert len(written) == 1, f"{Path(notebook).name} must write {filename} in exactly one cell"
    return written[0].split("\n", 1)[1]


def assert_same_state(actual: dict, expected: dict, atol: float = ATOL, rtol: float = RTOL, label: str = "") -> None:
    """Two state dicts hold the same keys and, within tolerance, the same tensors."""
    assert actual.keys() == expected.keys(), f"{label}: keys differ: {sorted(set(actual) ^ set(expected))}"
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], atol=atol, rtol=rtol, msg=lambda m, key=key: f"{label} {key}: {m}"
        )


class ToyTied(nn.Module):
    """Input and output layers sharing one weight (as a GPT's embedding and
    head do): its gradient is the sum of both uses, reduced once."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))

    def shard_units(self) -> list[nn.Module]:
        return [self.mid]  # the tied pair stays in the root unit, so its weight is gathered once

    def init_module(self, module: nn.Module) -> None:
        reset_module(module)


class ToyWithUnusedLayer(nn.Module):
    """A layer that never takes part in the loss: its parameters get no gradient,
    which a data-parallel wrapper must name instead of waiting for them forever."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


TOY_MODELS = {
    "cnn": (lambda: MnistCNN(), (1, 28, 28), 10),
    "frozen": (lambda: ToyWithFrozen(), (11,), 5),
    "tied": (lambda: ToyTied(), (6,), 6),
}
"""Name -> (constructor, input shape, classes): the models every implementation must train alike."""
