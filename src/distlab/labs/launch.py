"""Run a torchrun job from a notebook or a chapter and collect its results.

``mp.spawn`` cannot pickle functions defined in a notebook, so notebooks
write a script (or name a module) and run it under torchrun in a
subprocess. A distlab entry point's command line is parsed here first, with
the configuration its ``main`` parses (``main.config``), so a bad flag is one line
before any rank starts. Output streams live, so progress shows while it
runs; on failure the error is the job's own line (a ``distlab:`` line, or
the exception a rank died of), not torchrun's traceback or its report.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..cli import flag_names, parse, parse_or_refuse
from ..config import TrainConfig
from ..errors import DistlabError
from ..jobs import (  # the process runner; the chapters and labs reach it here, beside torchrun
    failure_reason,
    is_torchrun_noise,
    launcher_environment,
    reason_from_lines,
    run_job,
    stop_job,
    torchrun_command,
)
from ..measure.hardware import set_nccl_transport, survey
from ..results import read_result
from ..runtime import Placement, place

__all__ = [
    "JobOutput", "Run", "check_command_line", "entry_config", "failure_reason", "launcher_environment",
    "placement_args", "run_job", "run_many", "stop_job", "takes_placement", "torchrun", "torchrun_command",
    "torchrun_many", "train", "train_many",
]  # fmt: skip

K = TypeVar("K")
T = TypeVar("T")


@dataclass
class JobOutput:
    returncode: int
    output: str


def entry_config(target: str) -> type | None:
    """The configuration class ``-m target`` parses its command line with: its ``main``'s ``config``, set by
    :func:`~distlab.cli.entry_point` (a package's, in its ``__main__``). None for a ``.py`` script, and for a
    module outside distlab, which is not imported here (its top level may be the job itself). A distlab module
    that does not exist is refused in one line."""
    if target.endswith(".py") or not (target == "distlab" or target.startswith("distlab.")):
        return None
    try:
        module = importlib.import_module(target)
        if not hasattr(module, "main") and hasattr(module, "__path__"):  # python -m runs a package's __main__
            module = importlib.import_module(f"{target}.__main__")
    except ModuleNotFoundError as err:  # the module asked for, not one it imports (that is its own failure)
        if err.name == f"{target}.__main__":
            raise DistlabError(f"{target} is a package that cannot run: name one of its modules after -m") from None
        if err.name and (target == err.name or target.startswith(err.name + ".")):
            raise DistlabError(f"no module {err.name}: check the name after -m") from None
        raise
    return getattr(getattr(module, "main", None), "config", None)


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
    starts: a bad flag or value is one :class:`DistlabError` line. None for a script (``.py``), a module whose
    ``main`` names no configuration, or a request for ``--help`` (which the job prints)."""
    config = entry_config(target)
    args = [str(a) for a in args]
    if config is None or {"-h", "--help"} & set(args):
        return None
    return parse_or_refuse(config, args, target)


def torchrun(
    target: str,
    *args: str,
    nproc: int = 2,
    placement: Placement | None = None,
    echo: bool = True,
    timeout_s: float = 1800,
    threads_per_rank: int | None = None,
    launcher: tuple[str, ...] = (),
    config=None,
) -> JobOutput:
    """``torchrun --standalone --nproc_per_node=N`` on a script path or ``-m module``.

    ``target`` is a ``.py`` path or a module name (``distlab.train``); a distlab module's
    arguments are parsed with its ``main.config`` first (:func:`check_command_line`).
    Where the ranks run is decided here, once: ``placement``, or :func:`~distlab.runtime.place` for ``nproc``
    ranks when ``args`` do not say (``--device``/``--backend``: the caller decided). An entry point that takes
    those flags is told the decision, so no rank decides again; N is the placement's ranks.
    ``threads_per_rank`` defaults to the cores divided among the ranks, so a
    one-rank run and a four-rank run use the same machine. ``config``: the configuration the caller already parsed
    from ``args`` (as :func:`train` does), which is not parsed again.
    """
    args = tuple(str(a) for a in args)
    told = bool({"--device", "--backend"} & set(args))
    if placement is None and not told:
        placement = place(nproc)
    if placement is not None:
        nproc = placement.ranks
        if not told and takes_placement(entry_config(target)):
            args = (*args, *placement.args)
    if config is None:
        check_command_line(target, *args)  # a bad flag fails here, before any rank starts
    threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    command = torchrun_command(nproc, target, *args, launcher=launcher)
    env = launcher_environment(threads_per_rank)
    if _runs_nccl(placement, args):  # GPUs without peer access (a T4 pair): NCCL must be told before it starts
        set_nccl_transport(survey(topology=False), environ=env)

    def shown(line: str) -> None:
        if echo and not is_torchrun_noise(line):
            print(_without_folders(line), end="", flush=True)

    try:  # streamed until the job ends; stopped whole, ranks included, past its time or on Ctrl-C
        job = run_job(command, timeout_s, env, on_line=shown)
    except subprocess.TimeoutExpired:
        raise DistlabError(f"torchrun {target} ran past {timeout_s:.0f} s and was stopped") from None
    if job.returncode != 0:
        reason = reason_from_lines(job.stdout.splitlines(keepends=True))
        raise DistlabError(f"torchrun {target} failed with exit code {job.returncode}: {reason}")
    return JobOutput(job.returncode, job.stdout)


def _runs_nccl(placement: Placement | None, args: tuple[str, ...]) -> bool:
    """Whether the job's ranks talk through NCCL: its placement says so, or its command line does (a caller that
    decided passes ``--backend nccl``, or ``--device cuda`` with the backend left to NCCL's default)."""
    if placement is not None:
        return placement.backend == "nccl"
    flags = dict(zip(args, args[1:]))
    return flags.get("--backend") == "nccl" or (flags.get("--device") == "cuda" and flags.get("--backend") != "gloo")


def _without_folders(line: str) -> str:
    """A job's ``wrote <path>`` line with the file's name only: where a notebook keeps its
    scratch files says nothing to a reader (and puts machine paths on the page)."""
    if line.startswith("wrote "):
        return f"wrote {Path(line[len('wrote ') :].strip()).name}\n"
    return line


def train(
    *args: str,
    nproc: int = 2,
    out: str | os.PathLike = "results",
    echo: bool = True,
    threads_per_rank: int | None = None,
) -> dict:
    """Run ``distlab.train`` under torchrun and return the result it wrote."""
    args = [str(a) for a in args]
    # A bad flag fails here, before any rank starts; torchrun is given the parsed config and does not parse again.
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
        placement=placement,
        echo=echo,
        threads_per_rank=threads_per_rank,
        config=cfg,
    )
    return read_result(Path(out) / f"{run_name}.json")


def run_many(calls: Mapping[K, Callable[[], T]], at_once: int = 2) -> dict[K, T]:
    """Each call (no arguments), at most ``at_once`` at a time; their results by key, in the mapping's order.
    The pages' policy for jobs they compare and never time: side by side they share the cores, so a timed job
    runs alone. Every call ends before a failure is raised (the first, in the mapping's order), so no job is left
    running behind a cell that failed."""
    with ThreadPoolExecutor(max(1, at_once)) as pool:
        started = {key: pool.submit(call) for key, call in calls.items()}
    return {key: job.result() for key, job in started.items()}


class Run:
    """One job of :func:`train_many` or :func:`torchrun_many` that needs options of its own (``nproc=1``,
    ``launcher=...``) besides its flags; a job that needs none is just its flags."""

    def __init__(self, args: Sequence, **options):
        self.args, self.options = tuple(str(a) for a in args), options


def _each(start: Callable, runs: Mapping, common: tuple, options: dict, at_once: int) -> dict:
    """``start(*common, *run's flags, **options and the run's own)`` for every run, through :func:`run_many`; a
    run's own flags come last, so they override the common ones."""

    def call(run):
        run = run if isinstance(run, Run) else Run(run)
        return lambda: start(*common, *run.args, **{**options, **run.options})

    return run_many({key: call(run) for key, run in runs.items()}, at_once)


def train_many(runs: Mapping[K, Sequence | Run], *common: str, at_once: int = 2, **options) -> dict[K, dict]:
    """:func:`train` for each run, ``at_once`` at a time (:func:`run_many`): ``common`` flags, then the run's
    own; ``options`` as :func:`train` takes them, for every run. Each run's result record, by key."""
    return _each(train, runs, common, options, at_once)


def torchrun_many(
    target: str, runs: Mapping[K, Sequence | Run], *common: str, at_once: int = 2, **options
) -> dict[K, JobOutput]:
    """:func:`torchrun` of ``target`` for each run, ``at_once`` at a time (:func:`run_many`): ``common`` flags,
    then the run's own; ``options`` as :func:`torchrun` takes them, for every run. Each job's output, by key."""
    return _each(lambda *args, **kw: torchrun(target, *args, **kw), runs, common, options, at_once)
