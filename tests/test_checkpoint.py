"""Sharded checkpoints through the library's own loop, on real gloo ranks: a
resumed run ends on the very weights of an uninterrupted one, for every
strategy; a checkpoint written on 2 ranks loads on 1, 3 and 4; a save killed
half-way leaves the previous checkpoint; a checkpoint that cannot fit is
refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distlab.checkpoint import CheckpointFolder, from_json_tensor
from distlab.config import TrainConfig
from distlab.errors import run_main
from distlab.labs.launch import launcher_environment, run_job
from distlab.parallel import full_state_dict
from distlab.runtime import distributed
from distlab.testing import run_ranks
from distlab.train import TrainState, build_run, main, train

# Adam, whose per-parameter state a checkpoint must carry; gpt-tiny, whose tied
# embedding and head stay in the sharded strategies' root unit.
GLOBAL_BATCH = 24  # divides by 1, 2, 3 and 4 ranks: every world size takes the same samples per step
STEPS_PER_EPOCH, EPOCHS, SAVE_EVERY = 3, 2, 4  # step 4 is the first step of epoch 2: mid-epoch
SAVED_ON_TWO = ["ddp", "naive_ddp", "bucketed_ddp", "zero1", "zero2", "zero3", "fsdp"]
RESHARDED = {1: ["fsdp", "zero1", "ddp@single"], 3: ["fsdp", "zero3", "zero1"], 4: ["fsdp", "zero3"]}
"""World size -> what loads there the 2-rank checkpoint (``saver@loader``: another strategy of the same layout)."""


def _config(strategy: str, world_size: int, **overrides) -> TrainConfig:
    flags = dict(
        strategy=strategy,
        model="gpt-tiny",
        seq_len=16,
        dataset="synthetic",
        synthetic_size=256,
        device="cpu",
        batch_size=GLOBAL_BATCH // world_size,
        max_steps=STEPS_PER_EPOCH,
        epochs=EPOCHS,
        optimizer="adam",
        lr=3e-3,
        num_workers=0,
        log_every=-1,
        eval_batch_size=64,
        resume="none",
    )
    return TrainConfig.from_flags(**{**flags, **overrides})


def _trained(runtime, cfg: TrainConfig) -> dict:
    result = train(cfg, runtime)
    return {"state": full_state_dict(result.model), "history": result.history}


def _rng_after_loading(runtime, strategy: str, path: Path) -> torch.Tensor:
    run = build_run(_config(strategy, runtime.world_size), runtime)
    CheckpointFolder("", runtime).load(path, run, TrainState())
    return torch.get_rng_state()


def save_and_resume(runtime, strategies: list[str], root: str) -> dict:
    """On each rank: for each strategy, an uninterrupted run that checkpoints at step 4
    and at the end, then a fresh run resumed from step 4."""
    torch.manual_seed(1000 + runtime.rank)  # each rank its own RNG stream, to see each come back as its own
    out = {}
    for strategy in strategies:
        folder = Path(root) / strategy
        saving = _config(strategy, runtime.world_size, checkpoint_dir=str(folder), checkpoint_every=SAVE_EVERY)
        out[strategy] = {
            "uninterrupted": _trained(runtime, saving),
            "resumed": _trained(runtime, _config(strategy, runtime.world_size, resume=str(folder / "step-4"))),
        }
    out["rng"] = _rng_after_loading(runtime, "zero3", Path(root) / "zero3" / "step-4")
    return out


def load_elsewhere(runtime, strategies: list[str], root: str, resaved: str) -> dict:
    """On each of N ranks: load the 2-rank step-4 checkpoint and save it again right away
    (its contents must not change), resume from it to the end, and run uninterrupted."""
    out = {}
    for strategy in strategies:
        saved = Path(root) / strategy.partition("@")[0] / "step-4"
        strategy = strategy.partition("@")[2] or strategy
        run, state = build_run(_config(strategy, runtime.world_size), runtime), TrainState()
        folder = CheckpointFolder(str(Path(resaved) / strategy), runtime)
        folder.load(saved, run, state)
        folder.save(run, state)
        out[strategy] = {
            "resumed": _trained(runtime, _config(strategy, runtime.world_size, resume=str(saved))),
            "uninterrupted": _trained(runtime, _config(strategy, runtime.world_size)),
        }
    return out


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("checkpoints")
    return root, run_ranks(save_and_resume, 2, root, SAVED_ON_TWO, str(root))


def _exported(path: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint as one flat dict of whole tensors (no process group needed)."""
    out = scratch / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return _flat(torch.load(out, weights_only=True))


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def test_every_strategy_resumes_to_the_uninterrupted_weights_bitwise(saved_on_two, tmp_path):
    """Same ranks, same step sequence, and the checkpoint restores model, Adam state, the
    step counters, the loader's place in the epoch and each rank's RNG: nothing differs, so
    the weights are compared with torch.equal, not a tolerance."""
    root, ranks = saved_on_two
    for strategy in SAVED_ON_TWO:
        for rank in ranks:
            done, resumed = rank[strategy]["uninterrupted"], rank[strategy]["resumed"]
            for key, value in done["state"].items():
                assert torch.equal(resumed["state"][key], value), f"{strategy}: {key} differs after resuming"
            # the resumed epoch reports the whole epoch, the steps before the checkpoint included
            assert resumed["history"][1]["step_loss"] == done["history"][1]["step_loss"], strategy
            assert resumed["history"][1]["train_loss"] == done["history"][1]["train_loss"], strategy
        folder = root / strategy
        assert (folder / "latest").read_text() == "step-6" and not list(folder.glob("*.partial"))
        meta = json.loads((folder / "step-4" / "meta.json").read_text())
        assert (meta["model"], meta["strategy"], meta["world_size"], meta["global_step"]) == (
            "gpt-tiny",
            strategy,
            2,
            4,
        )
        assert meta["parameters"] == 120_576 and meta["torch"] == torch.__version__
        rank_files = sorted(p.name for p in (folder / "step-4").glob("*.distcp"))
        assert len(rank_files) == 2, f"{strategy}: each rank writes its own file: {rank_files}"
    for strategy in ("fsdp", "zero3"):  # parameters sharded: each rank's file holds about half
        sizes = [p.stat().st_size for p in (root / strategy / "step-4").glob("*.distcp")]
        assert max(sizes) < 0.6 * sum(sizes), f"{strategy}: one rank wrote most of the state: {sizes}"
    exported = _exported(root / "zero3" / "step-4", tmp_path)
    saved_rng = [exported[f"rank{rank}.rng"] for rank in range(2)]
    assert not torch.equal(saved_rng[0], saved_rng[1]), "the test gave each rank its own RNG stream"
    for rank, result in enumerate(ranks):
        assert torch.equal(result["rng"], saved_rng[rank]), f"rank {rank} got another rank's RNG back"


@pytest.mark.parametrize("world_size", [1, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_a_checkpoint_from_two_ranks_loads_on_another_number(saved_on_two, tmp_path, world_size):
    """Resharding. Reference: the checkpoint holds the state of the 2-rank run after step 4.
    1. Loaded on N ranks and saved again at once, it holds the same tensors, bitwise
       (the per-rank RNG and counters aside): N ranks took exactly that state.
    2. Resumed on N ranks it trains on to the weights of an uninterrupted N-rank run
       with the same global batch (24 samples a step, so the same samples in every
       step at any N). The two differ only in the rounding of the first 4 steps, whose
       gradients were averaged over 2 ranks instead of N: within distlab.models'
       tolerance scaled by 10, for Adam's division by sqrt(v) amplifies rounding.
    On one rank the ddp checkpoint loads into the single strategy too (the same layout)."""
    root, _ = saved_on_two
    strategies = RESHARDED[world_size]
    arguments = (strategies, str(root), str(tmp_path / "resaved"))
    if world_size == 1:  # one rank needs no launch: this process is a one-rank group
        with distributed("cpu") as runtime:
            ranks = [load_elsewhere(runtime, *arguments)]
    else:
        ranks = run_ranks(load_elsewhere, world_size, tmp_path, *arguments)
    for strategy in strategies:
        saved_by, strategy = strategy.partition("@")[0], strategy.partition("@")[2] or strategy
        before = _exported(root / saved_by / "step-4", tmp_path)
        after = _exported(tmp_path / "resaved" / strategy / "step-4", tmp_path)
        tensors = [key for key in before if not key.startswith("rank")]
        assert tensors and sorted(tensors) == sorted(k for k in after if not k.startswith("rank")), strategy
        for key in tensors:
            assert torch.equal(after[key], before[key]), f"{strategy} on {world_size} ranks: {key} changed"
        for rank in ranks:
            resumed, uninterrupted = rank[strategy]["resumed"]["state"], rank[strategy]["uninterrupted"]["state"]
            for key, value in uninterrupted.items():
                torch.testing.assert_close(resumed[key], value, atol=1e-4, rtol=1e-3, msg=f"{strategy} {key}")


def _train_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "distlab.train", *map(str, flags)]


@pytest.mark.slow
def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path, capsys):
    """The process dies by SIGKILL as it starts writing step 4's checkpoint: step 2 stays
    complete and named by latest; resuming finds it. Then checkpoints that do not fit this
    run (another model; a layout the strategy cannot load; a truncated file) are each
    refused in one line, exit code 2."""
    folder = tmp_path / "checkpoints"
    flags = ["--strategy", "single", "--model", "gpt-tiny", "--seq-len", "16", "--synthetic-size", "128"]
    flags += ["--batch-size", "8", "--max-steps", "6", "--device", "cpu", "--num-workers", "0", "--out", tmp_path]
    flags += ["--checkpoint-dir", folder, "--checkpoint-every", "2"]
    killed = run_job(
        _train_command(*flags, "--fail-at-step", "4", "--fail-during-save"), timeout=120, env=launcher_environment(1)
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (folder / "latest").read_text() == "step-2"
    assert (folder / "step-2" / ".metadata").is_file() and (folder / "step-2" / "meta.json").is_file()
    assert not (folder / "step-4").exists() and not (folder / "step-4.partial" / ".metadata").exists()

    run_main(main, [str(f) for f in flags])
    record = json.loads((tmp_path / "single-gpt-tiny-synthetic-1xcpu.json").read_text())
    tolerance = record["metrics"]["fault_tolerance"]
    assert tolerance["resumed_from_step"] == 2 and record["metrics"]["optimizer_steps"] == 6
    assert tolerance["resumes"] == [{"restart": 0, "resumed_from_step": 2, "last_step_reached": 4, "steps_lost": 2}]
    assert (folder / "latest").read_text() == "step-6" and not (folder / "step-4.partial").exists()

    def refusal(*wrong) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_code:
            run_main(main, [str(f) for f in flags + ["--resume", folder / "step-2", *wrong]])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_code.value.code == 2 and len(lines) == 1, lines
        return lines[0]

    assert "holds a gpt-tiny model" in refusal("--model", "cnn")
    assert "saved by --strategy single (per-parameter), which --strategy zero3" in refusal("--strategy", "zero3")
    (shard,) = (folder / "step-2").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert "could not be loaded" in refusal()
    meta = from_json_tensor(_exported(folder / "step-6", tmp_path)["rank0.run"])
    assert meta["global_step"] == 6 and meta["epoch"] == 1
