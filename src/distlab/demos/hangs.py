"""A hung job, read from what its ranks leave behind: Flight Recorder's dumps, a stack dump, monitored_barrier.

    torchrun --standalone --nproc_per_node=2 -m distlab.demos.hangs --case mismatch --dumps DIR --timeout-s 3
    torchrun --standalone --nproc_per_node=2 -m distlab.demos.hangs --case late --timeout-s 3

``mismatch`` and ``skip`` are the cases of :mod:`distlab.demos.failures`, with torch's Flight Recorder (on by
default in torch 2.14) read out: when a rank's collective fails, it writes its recorder's buffer to ``DIR/rank_<r>``
(:func:`distlab.measure.flight_recorder.dumped_on_failure`), and half-way to the timeout every rank writes its
Python stack to ``DIR/stack_<r>.txt`` (:func:`faulthandler.dump_traceback_later`), as a hung rank would show it
to ``py-spy dump``. ``late``: rank 1 is stuck before the barrier (a data loader that hangs), and the barrier is
``dist.monitored_barrier``, which names the rank that did not come.
"""

from __future__ import annotations

import faulthandler
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..cli import DeviceOptions, entry_point, option, section
from ..errors import DistlabError, run_main
from ..measure import flight_recorder
from ..runtime import Runtime, distributed
from . import failures


def late(runtime: Runtime, timeout_s: float) -> None:
    """Rank 1 is stuck past the timeout before the barrier; rank 0 reports which rank never arrived."""
    if runtime.rank == 1:
        time.sleep(timeout_s + 1)  # e.g. a data loader waiting on a file system that hangs
    dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))


CASES = {"mismatch": failures.mismatch, "skip": failures.skip, "late": late}


@contextmanager
def stack_dumped_after(path: Path, seconds: float) -> Iterator[None]:
    """Every thread's Python stack written to ``path`` if the code inside is still running after ``seconds``."""
    with path.open("w") as out:
        faulthandler.dump_traceback_later(seconds, file=out)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def main_thread_stack(dump: str) -> list[str]:
    """A faulthandler dump's main thread (the one that ran the module), innermost frame first, each frame as
    ``file.py:line in function`` (paths cut to the file's name)."""
    for thread in dump.split("\n\n"):
        frames = re.findall(r'File "(.+?)", line (\d+) in (\S+)', thread)
        if any(function == "<module>" for _, _, function in frames):
            return [f"{Path(path).name}:{line} in {function}" for path, line, function in frames]
    return []


@dataclass
class HangsConfig:
    """Ranks that hang on purpose, with what each leaves behind to say where."""

    case: str = option("mismatch", "which hang", choices=list(CASES))
    dumps: str = option("", "folder for each rank's Flight Recorder dump and stack dump (none if empty)")
    timeout_s: float = option(3.0, "seconds a collective may wait for its peers before the job fails")
    where: DeviceOptions = section(DeviceOptions)


@entry_point(HangsConfig)
def main(cfg: HangsConfig) -> None:
    with distributed(cfg.where.device, cfg.where.backend, cfg.timeout_s) as runtime:
        if runtime.world_size < 2:
            raise DistlabError("ranks can only hang on each other if there are several: run with torchrun")
        dist.barrier()  # every rank up before the clock of the case starts
        folder = Path(cfg.dumps) if cfg.dumps else None
        if folder:
            folder.mkdir(parents=True, exist_ok=True)
        recorded = flight_recorder.dumped_on_failure(folder, runtime.rank) if folder else nullcontext()
        stacks = (
            stack_dumped_after(folder / f"stack_{runtime.rank}.txt", cfg.timeout_s / 2) if folder else nullcontext()
        )
        with recorded, stacks:
            if cfg.case == "late":
                late(runtime, cfg.timeout_s)
            else:
                CASES[cfg.case](runtime)
        runtime.log(f"case {cfg.case}: every collective matched")


if __name__ == "__main__":
    run_main(main)
