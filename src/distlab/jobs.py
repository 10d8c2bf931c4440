"""The process runner: how distlab starts processes, stops them and says why they failed.

Two kinds of job. A torchrun job (a lab's or a chapter's launch, a benchmark, the GPU report) is a subprocess in
a session of its own: :func:`run_job` runs it to the end or stops it whole, ranks included, and
:func:`failure_reason` says in one line why it failed. Ranks started from this process (the grader's, and the
tests' fresh ranks and rank pool in ``distlab.testing``) are forked from one server process that imported torch
once (:func:`rank_context`), and meet at a store this process hosts (:func:`hosted_rendezvous`);
:func:`become_rank` is how each of them starts.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def _stat_fields(pid: int | str) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: the state first, then the parent's pid (OSError if gone)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(_stat_fields(entry.name)[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        todo.extend(kids := children.get(todo.pop(), []))
        found.extend(kids)
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_for_state(pids: list[int], states: str, within_s: float) -> None:
    """Wait until each of ``pids`` is in one of ``states`` (/proc's letters) or gone."""
    deadline = time.monotonic() + within_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                state = _stat_fields(pid)[0]
            except (OSError, IndexError):
                break  # gone, or no /proc: nothing to wait for
            if state in states:
                break
            time.sleep(0.005)


def _stop_all(pids: list[int]) -> None:
    """SIGSTOP each of ``pids`` and wait until the kernel has stopped it."""
    for pid in pids:
        _signal(pid, signal.SIGSTOP)
    _wait_for_state(pids, "TtZX", within_s=2.0)


def _frozen_family(pid: int) -> list[int]:
    """Every process below ``pid``, each stopped (SIGSTOP) before the next look: a process caught while it
    forks a child into a session of its own cannot leave that child out of the list. SIGCONT resumes them."""
    _stop_all([pid])
    family: list[int] = []
    while fresh := [child for child in _descendants(pid) if child not in family]:
        _stop_all(fresh)
        family += fresh
    return family


def stop_job(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a job started in a session of its own, and everything it started. torchrun starts each rank in
    a session of its own and stops them on SIGTERM; whatever is still alive after ``grace_s`` (a hung rank,
    a launcher that died first) is killed, the ranks included, so no job outlives its caller."""
    family = _frozen_family(process.pid)  # before the launcher exits and its ranks are orphaned
    try:
        os.killpg(process.pid, signal.SIGTERM)  # torchrun stops its ranks on SIGTERM, once running again
        for pid in [process.pid, *family]:
            _signal(pid, signal.SIGCONT)
        process.wait(grace_s)
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
        pass
    remaining = [process.pid, *family, *_descendants(process.pid)]
    for pid in remaining:
        _signal(pid, signal.SIGKILL)
    process.wait()
    _wait_for_state(remaining, "ZX", within_s=5.0)  # SIGKILL is sent at once, but a process takes a moment to end


def run_job(
    command: list[str], timeout: float, env: dict | None = None, cwd=None, on_line=None
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)``, except that a job past
    its timeout (or interrupted) is stopped whole, ranks included, before ``TimeoutExpired`` is raised. Given
    ``on_line``, the job's output (its stderr in its stdout) goes to ``on_line`` line by line as it runs (a
    notebook shows a job's progress live), and the result's ``stdout`` holds all of it."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT if on_line else subprocess.PIPE}
    process = subprocess.Popen(command, **streams, text=True, env=env, cwd=cwd, start_new_session=True)
    try:
        if on_line is None:
            stdout, stderr = process.communicate(timeout=timeout)
        else:
            stdout, stderr = _streamed(process, timeout, on_line), None
    except BaseException:
        stop_job(process)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _streamed(process: subprocess.Popen, timeout: float, on_line) -> str:
    """Each line of the job's output to ``on_line`` as it comes. A job that hangs never closes its output, so a
    watchdog stops it at ``timeout``, and ``TimeoutExpired`` says so."""
    timed_out = threading.Event()
    watchdog = threading.Timer(timeout, lambda: (timed_out.set(), stop_job(process)))
    watchdog.start()
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            on_line(line)
        process.wait()
    finally:
        watchdog.cancel()
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(process.args, timeout, output="".join(lines))
    return "".join(lines)


def torchrun_command(nproc: int, target: str, *args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    """``torchrun --standalone`` on a ``.py`` script or a module name; ``launcher`` adds torchrun's own
    options (``--max-restarts=1``)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *launcher, f"--nproc_per_node={nproc}"]
    command += [target] if target.endswith(".py") else ["-m", target]
    return command + [str(a) for a in args]


def launcher_environment(threads_per_rank: int) -> dict[str, str]:
    """This process's environment for a fresh torchrun job: a launcher inside
    a launched process must not inherit the outer job's rank variables."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1"}
    for var in LAUNCHER_VARIABLES:
        env.pop(var, None)
    return env


def failure_reason(output: str) -> str:
    """Why the torchrun job that wrote ``output`` failed, in one line (a lab that runs a job itself says it)."""
    return reason_from_lines(output.splitlines(keepends=True))


def reason_from_lines(lines: list[str]) -> str:
    """Why a job failed, in one line, in the job's own words, never torchrun's report (its traceback, its
    ``error_file: <N/A>``, its banner): a rank ended by a signal (torchrun's root cause); else the line its ranks
    wrote about why (``distlab: error ...`` or ``distlab: rank ...``); else the exception a rank died of (the
    root-cause rank's, as ``rank N: RuntimeError: ...``); else a script's refusal of its command line
    (``...: error: ...``); else the job's last lines before torchrun's report."""
    killed = _killed_rank(lines)
    if killed:
        return killed
    ours = [line.strip() for line in lines if line.startswith(("distlab: error", "distlab: rank"))]
    if ours:
        return ours[0]
    said = _ranks_output(lines)
    root, _ = _root_cause(lines)
    raised = [(m.group(1), m.group(2)) for m in map(EXCEPTION_LINE.match, said) if m]
    if raised:
        rank, line = next(((r, line) for r, line in raised if r == root), raised[0])
        rank = rank if rank is not None else root
        return _shorten((f"rank {rank}: " if rank is not None else "") + line)
    refused = [line for line in said if ": error: " in line]
    if refused:
        return _shorten(refused[-1])
    return _shorten(" | ".join(said[-6:])) or "no output"


EXCEPTION_LINE = re.compile(
    r"^(?:\[rank(\d+)\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)(?::\s.*)?)$"
)
"""The last line of a Python traceback (``RuntimeError: ...``, ``torch.OutOfMemoryError: ...``), as a rank
writes it: torch prefixes each line of a rank's traceback with ``[rankN]:`` once its process group exists."""
LONGEST_REASON = 400


def _shorten(line: str) -> str:
    return line if len(line) <= LONGEST_REASON else line[: LONGEST_REASON - 3] + "..."


def _root_cause(lines: list[str]) -> tuple[str | None, int | None]:
    """The rank torchrun names as its root cause (the first to fail), and its exit code; None where there is no
    such report."""
    report = "".join(lines).rsplit("Root Cause (first observed failure):", 1)
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", report[-1], re.M) if len(report) == 2 else None
    code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", report[-1], re.M) if rank else None
    return (rank.group(1) if rank else None), (int(code.group(1)) if code else None)


def _killed_rank(lines: list[str]) -> str | None:
    """The rank torchrun names as the root cause, when a signal ended it: which rank and which signal,
    and for SIGKILL, which the kernel's out-of-memory killer sends without a word, what to lower."""
    rank, code = _root_cause(lines)
    if code is None or code >= 0:
        return None
    number = -code
    name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
    if number == signal.SIGKILL:
        return (
            f"rank {rank} was killed by SIGKILL, most likely by the operating system for using too much "
            "host memory: lower --batch-size (and --eval-batch-size), or shard the model (--strategy zero3 or fsdp)"
        )
    words = _ranks_output(lines)[-1:]
    return f"rank {rank} was killed by {name}" + (f"; the job's last words: {words[0]}" if words else "")


def _torchrun_traceback(lines: list[str], i: int) -> bool:
    """Whether the traceback that starts at ``lines[i]`` is torchrun's own (its frames pass through torchrun:
    ``torchrun``, or ``torch/distributed/run.py`` under ``python -m torch.distributed.run``), not a rank's."""
    if not lines[i].startswith("Traceback"):
        return False
    for line in lines[i + 1 :]:
        if not line.startswith((" ", "\t")):
            return False
        if "torchrun" in line or "distributed/run.py" in line:
            return True
    return False


def _torchrun_report(lines: list[str], i: int) -> bool:
    """Whether torchrun's failure report (a rule of ``=``, then ``<target> FAILED``) starts at ``lines[i]``."""
    return lines[i].startswith("=====") and i + 1 < len(lines) and lines[i + 1].rstrip().endswith(" FAILED")


def _ranks_output(lines: list[str]) -> list[str]:
    """The job's non-empty lines before torchrun's own report of a failure (its log lines, its traceback, its
    summary), stripped."""
    kept = []
    for i, line in enumerate(lines):
        if _torchrun_traceback(lines, i) or _torchrun_report(lines, i):
            break
        if line.strip() and not re.match(r"[IWE]\d{4} \d\d:", line) and not is_torchrun_noise(line):
            kept.append(line.strip())
    return kept


def is_torchrun_noise(line: str) -> bool:
    """torchrun's banner about OMP_NUM_THREADS, and the profiler's (Kineto's) lines as it starts and stops and as
    it looks for a GPU on a machine without one, say nothing a reader needs."""
    return (
        "OMP_NUM_THREADS" in line
        or line.rstrip().endswith("*****************************************")
        or "site-packages/torch/distributed/run.py" in line
        or bool(KINETO_NOISE.match(line))
    )


KINETO_NOISE = re.compile(
    r"^(USDT|INFO|WARNING|ERROR):\S+ [\d:]+ \d+:\d+ (\w+ActivityProfiler\w*\.cpp:\d+\] profiler_(start|stop)"
    r"|DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed)"
)


RANK_START_METHOD = "forkserver" if sys.platform == "linux" else "spawn"
"""How ranks started from this process start. On Linux each rank is forked from a server process that imported
torch and distlab once (a spawned rank spends seconds importing them again); not from this process, whose
autograd threads a forked child cannot use. macOS and Windows spawn: fork is unsafe or absent there."""
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch._dynamo",  # FSDP's first fully_shard imports it (seconds): the server imports it once for every rank
]
"""What the one server imports before it forks any rank: torch, the seconds every rank would spend. The distlab
modules its ranks run are named by the caller, in the room that may import them (:func:`rank_context`)."""


def rank_context(*modules: str):
    """The multiprocessing context every rank started from this process comes from. Its one server imports
    :data:`PRELOAD` and ``modules``, the distlab modules the caller's ranks run (the grader names its rank side,
    the tests' harness ``distlab.train`` and itself). The server starts once per process, with the list of the
    caller that starts it: a later caller's own modules are imported by each of its ranks after the fork, tens of
    milliseconds once the library is loaded, never a different result."""
    context = mp.get_context(RANK_START_METHOD)
    if RANK_START_METHOD == "forkserver":
        context.set_forkserver_preload([*PRELOAD, *modules])  # read once, when the server starts
    return context


def free_port() -> int:
    """A port no socket holds now, for a launcher that binds it itself (torchrun's rendezvous endpoint). Ranks
    started here meet at :func:`hosted_rendezvous` instead: a port chosen here and bound later by rank 0 can be
    taken in between."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def hosted_rendezvous() -> Iterator[dict[str, str]]:
    """The environment that ranks this process starts meet with: a store (``TCPStore``) that this process
    hosts, on a port the kernel gives it, held until the ranks are done; every rank is its client, as under
    torchrun, whose agent hosts the store the same way (``TORCHELASTIC_USE_AGENT_STORE``).

    Why not a free port that rank 0 binds: the port is free only when it is chosen. Another socket can take it
    before rank 0 binds it, a rank's own attempt to connect to it included (the kernel may give that attempt
    the very port as its own, and it connects to itself), and then no rank starts."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store  # the server stops with its last reference


def become_rank(rank: int, world_size: int, rendezvous: dict[str, str]) -> None:
    """What every rank started from this process does first: take its place in the job's environment (as
    torchrun's ranks find it), one thread (on 2 cores several ranks must not fight over threads), and a
    fresh random seed, as a new process has, not the server's RNG state on every rank."""
    os.environ.update(rendezvous, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if RANK_START_METHOD == "forkserver":
        torch.seed()
        # Everything the server imported moves to the collector's permanent generation (a list splice, no walk):
        # the collection in each rank's teardown (runtime._release_group) then walks only what the rank made,
        # not torch's ~320,000 objects again (0.3 s a rank, half of a graded check). Nothing the rank makes is
        # frozen, so its group's cycles are freed as before.
        gc.freeze()
