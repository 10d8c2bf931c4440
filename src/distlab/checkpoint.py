"""Checkpoints of a run, sharded, and the fault tolerance built on them: every rank writes its own part, any
number of ranks reads it back, and a run resumes from it after a failure.

A checkpoint folder holds one ``step-<N>/`` folder per save and a ``latest``
file naming the newest complete one. A save is written into
``step-<N>.partial/`` and published by one rename, and ``latest`` is replaced
(temporary file, then ``os.replace``) only after that: a job killed in the
middle of a save leaves the previous checkpoint, and ``latest`` pointing at it.

Each step folder is a ``torch.distributed.checkpoint`` (DCP) checkpoint plus a
``meta.json`` (model, strategy, world size, step, parameter count, versions).
What goes in is the strategy's own (its ``checkpoint_layout`` and ``checkpoint_state``, in
:mod:`distlab.parallel`):

* per-parameter (single, ddp, the course's DDP, fsdp): torch's
  ``get_state_dict``/``set_state_dict`` name every tensor after its parameter;
  FSDP2's are DTensors, so each rank writes only its shards;
* ZeRO-1/2 keep the model whole but the optimizer state as one flat slice per
  rank, ZeRO-3 the parameters too: each slice is saved as a DTensor piece of
  the unpadded flat vector (:meth:`.parallel.flat_param.FlatParams.shard_as_dtensor`).

DCP resharding does the rest: a checkpoint written on 2 ranks loads on 1, 3 or 4.
Where each rank stands (:class:`distlab.train.TrainState`, its RNG, the gradient
scaler) is saved under the rank's own key, because DCP keeps one copy of a value
every rank saves under the same name. Everything saved is a tensor (the run's
counters as JSON bytes), so loading unpickles nothing but DCP's own index.

Fault tolerance: checkpoints on a cadence, resuming, failures on purpose, and what a real one cost.

:class:`FaultTolerance` is all the training loop sees of it: it resumes a run
from ``--resume`` (:class:`CheckpointFolder` does the reading), saves every
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

import torch
import torch.distributed as dist

from . import __version__
from .errors import DistlabError
from .parallel import STRATEGIES
from .runtime import Runtime

LAYOUTS = {name: strategy.checkpoint_layout for name, strategy in STRATEGIES.items()}
"""How each strategy's checkpoint is laid out (its own ``checkpoint_layout``); the same layout loads."""


def json_tensor(value: Any) -> torch.Tensor:
    """``value`` as JSON bytes in a uint8 tensor: saved like any tensor, read back without pickle."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).clone()


def from_json_tensor(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.cpu().numpy()).decode())


def rank_entry(state, scaler: torch.amp.GradScaler, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's :class:`~distlab.train.TrainState` (its random generators: the CPU's, and ``device``'s on a GPU)
    and gradient scaler, saved under its own key."""
    saved = state.state_dict(device)
    rng, cuda_rng = saved.pop("rng"), saved.pop("cuda_rng")
    entry = {"run": json_tensor({**saved, "scaler": scaler.state_dict()}), "rng": rng}
    if cuda_rng:
        entry["cuda_rng"] = torch.stack(cuda_rng)
    return entry


def load_rank_entry(entry: dict[str, torch.Tensor], state, scaler: torch.amp.GradScaler, device: torch.device) -> None:
    saved = from_json_tensor(entry["run"])
    scaler_state = saved.pop("scaler")
    cuda_rng = list(entry["cuda_rng"]) if "cuda_rng" in entry else []
    state.load_state_dict({**saved, "rng": entry["rng"], "cuda_rng": cuda_rng}, device)
    if scaler_state and scaler.is_enabled():
        scaler.load_state_dict(scaler_state)


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old contents or the new, never half of them."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is saved or loaded: it imports DTensor and, through
    it, sympy, about a second of every rank's start that a run which never checkpoints need not pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _writer(path: Path, before_write):
    """DCP's file writer with a hook called before this rank writes its shards (fault injection)."""

    class Writer(_dcp().FileSystemWriter):
        def write_data(self, plan, planner):
            before_write()
            return super().write_data(plan, planner)

    return Writer(path, sync_files=True)


def describe(run, state) -> dict[str, Any]:
    """``meta.json``: what a checkpoint holds, checked before anything is loaded."""
    return {
        "model": run.cfg.model.name,
        "strategy": run.cfg.parallel.strategy,
        "layout": run.strategy.checkpoint_layout,
        "world_size": run.runtime.world_size,
        "global_step": state.global_step,
        "epoch": state.epoch,
        "step_in_epoch": state.step_in_epoch,
        "global_batch": run.global_batch,
        "parameters": run.parameters,
        "distlab": __version__,
        "torch": torch.__version__,
    }


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise DistlabError(
            f"checkpoint {path} has no readable meta.json ({type(err).__name__}): it is incomplete or damaged; "
            "resume from another step-N folder, or start fresh with --resume none"
        ) from None


def check_compatible(meta: dict[str, Any], run, path: Path) -> None:
    """Refuse, in one line naming both, a checkpoint of another model or of a layout this strategy cannot load."""
    model, strategy = run.cfg.model.name, run.cfg.parallel.strategy
    if (meta["model"], meta["parameters"]) != (model, run.parameters):
        raise DistlabError(
            f"checkpoint {path} holds a {meta['model']} model ({meta['parameters']:,} parameters) but this run "
            f"builds {model} ({run.parameters:,} parameters): resume with --model {meta['model']} and the same "
            "model options, or start fresh with --resume none or another --checkpoint-dir"
        )
    if LAYOUTS[meta["strategy"]] != LAYOUTS[strategy]:
        fits = " or ".join(name for name, layout in LAYOUTS.items() if layout == LAYOUTS[meta["strategy"]])
        raise DistlabError(
            f"checkpoint {path} was saved by --strategy {meta['strategy']} ({LAYOUTS[meta['strategy']]}), which "
            f"--strategy {strategy} ({LAYOUTS[strategy]}) cannot load: resume with --strategy {fits}, "
            "or start fresh with --resume none"
        )


class CheckpointFolder:
    """``--checkpoint-dir``: where a run saves its ``step-<N>/`` folders, and what ``--resume`` finds."""

    def __init__(self, directory: str, runtime: Runtime):
        self.directory = Path(directory) if directory else None
        self.runtime = runtime

    def find(self, resume: str) -> Path | None:
        """The step folder ``--resume`` names: for ``auto`` the latest complete one in the
        checkpoint folder (None when there is none yet), for ``none`` None, else the path
        given (a step folder, or a checkpoint folder, whose latest it means)."""
        if resume == "none":
            return None
        if resume == "auto":
            return _latest(self.directory) if self.directory else None
        path = Path(resume)
        path = _latest(path) or path if (path / "latest").is_file() else path
        if not path.is_dir():
            raise DistlabError(
                f"--resume {resume}: no checkpoint there: name a step-N folder or a --checkpoint-dir, "
                "or use --resume auto or none"
            )
        return path

    def save(self, run, state, before_write=lambda: None) -> Path:
        """Write ``step-<N>.partial/`` (every rank its part), then publish it as ``step-<N>/`` and
        point ``latest`` at it. A collective: every rank calls it at the same step."""
        final = self.directory / f"step-{state.global_step}"
        partial = final.with_name(final.name + ".partial")
        if self.runtime.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # a save killed before it was published left this
            partial.mkdir(parents=True)
        dist.barrier()
        content = run.strategy.checkpoint_state(run.model, run.optimizer, self.runtime.device.type).tensors
        content[f"rank{self.runtime.rank}"] = rank_entry(state, run.precision.scaler, self.runtime.device)
        _dcp().save(content, storage_writer=_writer(partial, before_write))
        if self.runtime.is_main:  # DCP's index is written: the checkpoint is complete
            write_atomically(partial / "meta.json", json.dumps(describe(run, state), indent=1))
            if final.exists():  # an earlier job's save of the same step
                shutil.rmtree(final)
            os.replace(partial, final)
            write_atomically(self.directory / "latest", final.name)
        return final

    def load(self, path: Path, run, state) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``run`` and ``state`` (on any number of ranks); return its meta."""
        meta = read_meta(path)
        check_compatible(meta, run, path)
        strategy_state = run.strategy.checkpoint_state(run.model, run.optimizer, self.runtime.device.type)
        dcp = _dcp()
        try:
            reader = dcp.FileSystemReader(path)
            saved = reader.read_metadata().state_dict_metadata
            # A rank the saving job did not have starts where rank 0 stood (ranks of one job stand alike).
            source = f"rank{self.runtime.rank}" if f"rank{self.runtime.rank}.run" in saved else "rank0"
            entry = {
                name: torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
                for name in ("run", "rng", "cuda_rng")
                if (key := f"{source}.{name}") in saved
            }
            dcp.load({**strategy_state.tensors, source: entry}, storage_reader=reader)
        except (Exception, dcp.CheckpointException) as err:  # DCP's wraps every rank's failure (a BaseException)
            cause = next(iter(err.failures.values()))[0] if getattr(err, "failures", None) else err
            first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
            raise DistlabError(
                f"checkpoint {path} could not be loaded ({first_line}): it is damaged or incomplete; "
                "resume from another step-N folder, or start fresh with --resume none"
            ) from None
        strategy_state.apply()
        load_rank_entry(entry, state, run.precision.scaler, self.runtime.device)
        _count_in_this_global_batch(meta, run, state)
        return meta


def _latest(directory: Path) -> Path | None:
    pointer = directory / "latest"
    return directory / pointer.read_text().strip() if pointer.is_file() else None


def _count_in_this_global_batch(meta: dict[str, Any], run, state) -> None:
    """Resumed mid-epoch with another global batch (another world size): the same samples
    seen, counted in this run's steps, if they make whole steps."""
    if meta["global_batch"] == run.global_batch or state.step_in_epoch == 0:
        return
    seen = state.step_in_epoch * meta["global_batch"]
    if seen % run.global_batch:
        raise DistlabError(
            f"the checkpoint stopped {seen} samples into epoch {state.epoch + 1}, not a whole number of this run's "
            f"global batches of {run.global_batch}: choose --batch-size so the global batch divides {seen}, "
            "or resume from a checkpoint taken at the end of an epoch"
        )
    state.step_in_epoch = seen // run.global_batch


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
