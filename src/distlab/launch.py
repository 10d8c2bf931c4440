"""Run a torchrun job from a notebook or a chapter and collect its results.

``mp.spawn`` cannot pickle functions defined in a notebook, so notebooks
write a script (or name a module) and run it under torchrun in a
subprocess. Output streams live, so progress shows while it runs; on
failure the error is the job's own ``distlab:`` lines, not torchrun's
traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .cli import parse
from .config import TrainConfig
from .results import read_result
from .runtime import DistlabError, resolve_device


@dataclass
class JobOutput:
    returncode: int
    output: str


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launcher_environment(threads_per_rank)
    )
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if echo and not _torchrun_noise(line):
                print(_without_folders(line), end="", flush=True)
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise DistlabError(f"torchrun {target} ran past {timeout_s:.0f} s and was stopped") from None
    output = "".join(lines)
    if process.returncode != 0:
        raise DistlabError(f"torchrun {target} failed with exit code {process.returncode}: {_failure_reason(lines)}")
    return JobOutput(process.returncode, output)


def _failure_reason(lines: list[str]) -> str:
    """The line a failed job's ranks wrote about why (``distlab: error ...`` or ``distlab: rank ...``);
    without one (a crash), the job's last lines that are not torchrun's own report."""
    ours = [line.strip() for line in lines if line.startswith(("distlab: error", "distlab: rank"))]
    if ours:
        return ours[0]
    last = [line.strip() for line in lines if line.strip() and not _torchrun_noise(line)][-6:]
    return " | ".join(last) or "no output"


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
    device = resolve_device(cfg.parallel.device, 0, cfg.parallel.backend)
    run_name = cfg.run_name(nproc, device.type)
    torchrun(
        "distlab.train",
        *args,
        "--out",
        str(out),
        "--run-name",
        run_name,
        nproc=nproc,
        echo=echo,
        threads_per_rank=threads_per_rank,
    )
    return read_result(Path(out) / f"{run_name}.json")
