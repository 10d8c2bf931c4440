"""Fault tolerance: checkpoints on a cadence, resuming, failures on purpose, and what a real one cost.

:class:`FaultTolerance` is all the training loop sees of it: it resumes a run
from ``--resume`` (:mod:`distlab.checkpoint` does the reading), saves every
``--checkpoint-every`` steps and at the end, and counts what restarts cost.

``--fail-at-step S --fail-rank R`` makes rank ``R`` kill itself with SIGKILL
(no handler runs, no file is closed: what a preempted node or the kernel's
out-of-memory killer does) right after global step ``S``, or, with
``--fail-during-save``, as it starts writing step ``S``'s checkpoint. It
fires once per job: only in torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so the restarted group runs on.

:class:`RestartLog` keeps, in the checkpoint folder, the last step the job
reached (``progress/rank<r>.json``) and one record per resume (``resumes.json``):
the step resumed from and the steps lost, the ones trained again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointFolder
from .runtime import Runtime


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def kill_this_rank() -> None:
    """SIGKILL to this very process: it dies at once, as a crashed node's process does."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjection:
    """Where ``--fail-at-step``, ``--fail-rank`` and ``--fail-during-save`` kill this rank."""

    def __init__(self, at_step: int, rank: int, during_save: bool, runtime: Runtime):
        self.at_step, self.during_save = at_step, during_save
        self.armed = at_step > 0 and rank == runtime.rank and restart_count() == 0

    def after_step(self, global_step: int) -> None:
        if self.armed and not self.during_save and global_step == self.at_step:
            kill_this_rank()

    def before_writing_checkpoint(self, global_step: int) -> None:
        if self.armed and self.during_save and global_step == self.at_step:
            kill_this_rank()


class RestartLog:
    """The checkpoint folder's record of progress and resumes. Every rank notes the last
    step it finished (a rank killed mid-step cannot say more, and the others may be
    stopped before they write); rank 0 keeps the record of resumes."""

    def __init__(self, directory: str, runtime: Runtime):
        self.progress = Path(directory) / "progress" if directory else None
        self.directory = Path(directory) if directory and runtime.is_main else None
        self.rank, self.resumed_from = runtime.rank, None

    def reached(self, global_step: int) -> None:
        """Called after every optimizer step: what a failure from now on would cost is counted from here."""
        if self.progress is not None:
            _write_json(self.progress / f"rank{self.rank}.json", {"global_step": global_step})

    def begin(self, resumed_from: int | None) -> None:
        """This job starts fresh (``None``) or continues from a checkpoint taken at ``resumed_from``.
        A restarted group with no checkpoint yet starts over: every step it had reached is lost."""
        if self.directory is None:
            self.resumed_from = resumed_from
            return
        if resumed_from is None and restart_count() == 0:  # a new job: an earlier job's record is not its own
            (self.directory / "resumes.json").unlink(missing_ok=True)
            shutil.rmtree(self.progress, ignore_errors=True)
            return
        self.resumed_from = resumed_from or 0
        steps = [_read_json(path, {}).get("global_step", 0) for path in self.progress.glob("rank*.json")]
        reached = max([self.resumed_from, *steps])
        record = {
            "restart": restart_count(),
            "resumed_from_step": self.resumed_from,
            "last_step_reached": reached,
            "steps_lost": reached - self.resumed_from,
        }
        _write_json(self.directory / "resumes.json", [*self.records(), record])

    def records(self) -> list[dict[str, Any]]:
        return _read_json(self.directory / "resumes.json", []) if self.directory is not None else []

    def summary(self) -> dict[str, Any]:
        """What the result file records: torchrun's restarts, where this attempt resumed, every resume's losses."""
        return {"restarts": restart_count(), "resumed_from_step": self.resumed_from, "resumes": self.records()}


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


class FaultTolerance:
    """A run's checkpoints, resumes and injected faults, driven by the loop at three points:
    :meth:`resume` before the first step, :meth:`after_step` after each, :meth:`at_end`."""

    def __init__(self, run):
        cfg, self.run = run.cfg, run
        self.folder = CheckpointFolder(cfg.checkpoint.checkpoint_dir, run.runtime)
        self.every = cfg.checkpoint.checkpoint_every
        self.last_step = run.steps_per_epoch * cfg.training.epochs  # saved by at_end, once its epoch is recorded
        faults = cfg.faults
        self.faults = FaultInjection(faults.fail_at_step, faults.fail_rank, faults.fail_during_save, run.runtime)
        self.log = RestartLog(cfg.checkpoint.checkpoint_dir, run.runtime)
        self.saved_at: int | None = None

    def resume(self, state) -> None:
        """Load what ``--resume`` names into the run and ``state``, if anything."""
        path = self.folder.find(self.run.cfg.checkpoint.resume)
        if path is not None:
            meta = self.folder.load(path, self.run, state)
            self.saved_at = state.global_step
            self.run.runtime.log(
                f"distlab: resumed from {path} (step {state.global_step}, saved by {meta['strategy']} "
                f"on {meta['world_size']} rank(s))"
            )
        self.log.begin(state.global_step if path is not None else None)

    def after_step(self, state, epoch_progress) -> None:
        """``epoch_progress()`` gives the epoch's sums so far (a collective: only called to save)."""
        self.log.reached(state.global_step)
        if self.every and state.global_step % self.every == 0 and state.global_step < self.last_step:
            state.epoch_progress = epoch_progress()
            self.save(state)
        self.faults.after_step(state.global_step)

    def at_end(self, state) -> None:
        if self.folder.directory is not None and self.saved_at != state.global_step:
            self.save(state)

    def save(self, state) -> None:
        step = state.global_step
        self.folder.save(self.run, state, before_write=lambda: self.faults.before_writing_checkpoint(step))
        self.saved_at = step
