"""Run a torchrun job from a notebook or a chapter and collect its results.

``mp.spawn`` cannot pickle functions defined in a notebook, so notebooks
write a script (or name a module) and run it under torchrun in a
subprocess. A distlab entry point's command line is parsed here first, with
the configuration its module names (``CONFIG``), so a bad flag is one line
before any rank starts. Output streams live, so progress shows while it
runs; on failure the error is the job's own line (a ``distlab:`` line, or
the exception a rank died of), not torchrun's traceback or its report.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..cli import flag_names, parse, parse_or_refuse
from ..config import TrainConfig
from ..errors import DistlabError
from ..results import read_result
from ..runtime import Placement, place


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


def entry_config(target: str) -> type | None:
    """The configuration class ``-m target`` parses its command line with: the module's ``CONFIG`` (a package's,
    in its ``__main__``). None for a ``.py`` script, and for a module outside distlab, which is not imported here
    (its top level may be the job itself). A distlab module that does not exist is refused in one line."""
    if target.endswith(".py") or not (target == "distlab" or target.startswith("distlab.")):
        return None
    try:
        module = importlib.import_module(target)
        if not hasattr(module, "CONFIG") and hasattr(module, "__path__"):  # python -m runs a package's __main__
            module = importlib.import_module(f"{target}.__main__")
    except ModuleNotFoundError as err:  # the module asked for, not one it imports (that is its own failure)
        if err.name == f"{target}.__main__":
            raise DistlabError(f"{target} is a package that cannot run: name one of its modules after -m") from None
        if err.name and (target == err.name or target.startswith(err.name + ".")):
            raise DistlabError(f"no module {err.name}: check the name after -m") from None
        raise
    return getattr(module, "CONFIG", None)


def takes_placement(config: type | None) -> bool:
    """Whether a configuration's command line takes ``--device`` and ``--backend`` (a
    :class:`~distlab.cli.DeviceOptions` section, or a training run's parallel section)."""
    return config is not None and {"device", "backend"} <= flag_names(config)


def placement_args(target: str, placement: Placement) -> tuple[str, ...]:
    """What tells ``target``'s ranks where they run (``--device D --backend B``), or nothing for an entry point
    that takes no such flags (``distlab.bench.host`` measures the host; ``distlab.bench.transfer`` is CUDA-only)."""
    return placement.args if takes_placement(entry_config(target)) else ()


def check_command_line(target: str, *args: str):
    """The configuration ``target``'s ranks will parse from ``args``, parsed and validated here, before any rank
    starts: a bad flag or value is one :class:`DistlabError` line. None for a script (``.py``), a module with
    no ``CONFIG``, or a request for ``--help`` (which the job prints)."""
    config = entry_config(target)
    args = [str(a) for a in args]
    if config is None or {"-h", "--help"} & set(args):
        return None
    return parse_or_refuse(config, args, target)


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

    ``target`` is a ``.py`` path or a module name (``distlab.train``); a distlab module's
    arguments are parsed with its ``CONFIG`` first (:func:`check_command_line`).
    ``threads_per_rank`` defaults to the cores divided among the ranks, so a
    one-rank run and a four-rank run use the same machine.
    """
    check_command_line(target, *args)  # a bad flag fails here, before any rank starts
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
