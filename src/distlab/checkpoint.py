"""Checkpoints of a run, sharded: every rank writes its own part, and any number of ranks reads it back.

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
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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


def rank_entry(state, scaler: torch.amp.GradScaler) -> dict[str, torch.Tensor]:
    """This rank's :class:`~distlab.train.TrainState` and gradient scaler, saved under its own key."""
    saved = state.state_dict()
    rng, cuda_rng = saved.pop("rng"), saved.pop("cuda_rng")
    entry = {"run": json_tensor({**saved, "scaler": scaler.state_dict()}), "rng": rng}
    if cuda_rng:
        entry["cuda_rng"] = torch.stack(cuda_rng)
    return entry


def load_rank_entry(entry: dict[str, torch.Tensor], state, scaler: torch.amp.GradScaler) -> None:
    saved = from_json_tensor(entry["run"])
    scaler_state = saved.pop("scaler")
    cuda_rng = list(entry["cuda_rng"]) if "cuda_rng" in entry else []
    state.load_state_dict({**saved, "rng": entry["rng"], "cuda_rng": cuda_rng})
    if scaler_state and scaler.is_enabled():
        scaler.load_state_dict(scaler_state)


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old contents or the new, never half of them."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer with a hook called before this rank writes its shards (fault injection)."""

    def __init__(self, path: Path, before_write):
        super().__init__(path, sync_files=True)
        self.before_write = before_write

    def write_data(self, plan, planner):
        self.before_write()
        return super().write_data(plan, planner)


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
        content[f"rank{self.runtime.rank}"] = rank_entry(state, run.precision.scaler)
        dcp.save(content, storage_writer=_Writer(partial, before_write))
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
        load_rank_entry(entry, state, run.precision.scaler)
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
