"""Run a torchrun job from a notebook or a chapter and collect its results.

``mp.spawn`` cannot pickle functions defined in a notebook, so notebooks
write a script (or name a module) and run it under torchrun in a
subprocess. Output streams live, so progress shows while it runs; on
failure the error is the job's own ``distlab:`` lines, not torchrun's
traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..cli import parse
from ..config import TrainConfig
from ..errors import DistlabError
from ..results import read_result
from ..runtime import place


@dataclass
class JobOutput:
    returncode: int
    output: str


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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


def run_job(command: list[str], timeout: float, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)``, except that a job past
    its timeout (or interrupted) is stopped whole, ranks included, before ``TimeoutExpired`` is raised."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:
        stop_job(process)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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


def torchrun(
    target: str,
    *args: str,
    nproc: int = 2,
    echo: bool = True,
    timeout_s: float = 1800,
    threads_per_rank: int | None = None,
    launcher: tuple[str, ...] = (),
) -> JobOutput:
    """``torchrun --standalone --nproc_per_node=nproc`` on a script path or ``-m module``.

    ``target`` is a ``.py`` path or a module name (``distlab.train``).
    ``threads_per_rank`` defaults to the cores divided among the ranks, so a
    one-rank run and a four-rank run use the same machine.
    """
    threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    command = torchrun_command(nproc, target, *args, launcher=launcher)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=launcher_environment(threads_per_rank),
        start_new_session=True,
    )
    # The output streams until the job ends; a job that hangs never closes it, so a watchdog stops it.
    timed_out = threading.Event()
    watchdog = threading.Timer(timeout_s, lambda: (timed_out.set(), stop_job(process)))
    watchdog.start()
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if echo and not _torchrun_noise(line):
                print(_without_folders(line), end="", flush=True)
        process.wait()
    except BaseException:  # Ctrl-C, or an interrupted kernel: the ranks must not run on without it
        stop_job(process)
        raise
    finally:
        watchdog.cancel()
    if timed_out.is_set():
        raise DistlabError(f"torchrun {target} ran past {timeout_s:.0f} s and was stopped")
    output = "".join(lines)
    if process.returncode != 0:
        raise DistlabError(f"torchrun {target} failed with exit code {process.returncode}: {_failure_reason(lines)}")
    return JobOutput(process.returncode, output)


def failure_reason(output: str) -> str:
    """Why the torchrun job that wrote ``output`` failed, in one line (a lab that runs a job itself says it)."""
    return _failure_reason(output.splitlines(keepends=True))


def _failure_reason(lines: list[str]) -> str:
    """Why a job failed, in one line: a rank ended by a signal (torchrun's root cause), else the line its
    ranks wrote about why (``distlab: error ...`` or ``distlab: rank ...``); without either (a crash), the
    job's last lines that are not torchrun's own report."""
    killed = _killed_rank(lines)
    if killed:
        return killed
    ours = [line.strip() for line in lines if line.startswith(("distlab: error", "distlab: rank"))]
    if ours:
        return ours[0]
    last = [line.strip() for line in lines if line.strip() and not _torchrun_noise(line)][-6:]
    return " | ".join(last) or "no output"


def _killed_rank(lines: list[str]) -> str | None:
    """The rank torchrun names as the root cause, when a signal ended it: which rank and which signal,
    and for SIGKILL, which the kernel's out-of-memory killer sends without a word, what to lower."""
    report = "".join(lines).rsplit("Root Cause (first observed failure):", 1)
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", report[-1], re.M) if len(report) == 2 else None
    code = re.search(r"^\s*exitcode\s*:\s*(-\d+)", report[-1], re.M) if rank else None
    if not code:
        return None
    number = -int(code.group(1))
    name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
    if number == signal.SIGKILL:
        return (
            f"rank {rank.group(1)} was killed by SIGKILL, most likely by the operating system for using too much "
            "host memory: lower --batch-size (and --eval-batch-size), or shard the model (--strategy zero3 or fsdp)"
        )
    words = _ranks_output(lines)[-1:]
    return f"rank {rank.group(1)} was killed by {name}" + (f"; the job's last words: {words[0]}" if words else "")


def _ranks_output(lines: list[str]) -> list[str]:
    """The job's non-empty lines before torchrun's own report of a failure (its log lines, its traceback)."""
    kept = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback") and any(
            "torchrun" in later or "distributed/run.py" in later for later in lines[i + 1 : i + 3]
        ):
            break
        if line.strip() and not re.match(r"[IWE]\d{4} \d\d:", line) and not _torchrun_noise(line):
            kept.append(line.strip())
    return kept


def _without_folders(line: str) -> str:
    """A job's ``wrote <path>`` line with the file's name only: where a notebook keeps its
    scratch files says nothing to a reader (and puts machine paths on the page)."""
    if line.startswith("wrote "):
        return f"wrote {Path(line[len('wrote ') :].strip()).name}\n"
    return line


def _torchrun_noise(line: str) -> bool:
    """torchrun's banner about OMP_NUM_THREADS says nothing a reader needs."""
    return (
        "OMP_NUM_THREADS" in line
        or line.rstrip().endswith("*****************************************")
        or "site-packages/torch/distributed/run.py" in line
    )


def train(
    *args: str,
    nproc: int = 2,
    out: str | os.PathLike = "results",
    echo: bool = True,
    threads_per_rank: int | None = None,
) -> dict:
    """Run ``distlab.train`` under torchrun and return the result it wrote."""
    args = [str(a) for a in args]
    # A bad flag fails here, before any rank starts.
    cfg = parse(TrainConfig, [*args, "--out", str(out)], "distlab.train")
    placement = place(nproc, cfg.parallel.device, cfg.parallel.backend)  # decided here; the ranks are told
    run_name = cfg.run_name(placement.ranks, placement.device)
    torchrun(
        "distlab.train",
        *args,
        *placement.args,
        "--out",
        str(out),
        "--run-name",
        run_name,
        nproc=nproc,
        echo=echo,
        threads_per_rank=threads_per_rank,
    )
    return read_result(Path(out) / f"{run_name}.json")
