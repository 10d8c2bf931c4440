"""A rank killed mid-epoch, the job restarted by torchrun and resumed from its
last checkpoint: it ends on the very weights of a job that never failed, and
its result file counts the restart and the steps it cost."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.config import TrainConfig
from distlab.labs.launch import launcher_environment, run_job, torchrun_command
from distlab.parallel import full_state_dict
from distlab.testing import run_ranks
from distlab.train import train

pytestmark = pytest.mark.slow

# 8 steps in one epoch, a checkpoint every 3: rank 1 dies after step 5, mid-epoch,
# and the restarted group goes back to step 3, losing 2 steps.
FLAGS = dict(
    model="gpt-tiny",
    seq_len=16,
    dataset="synthetic",
    synthetic_size=256,
    device="cpu",
    batch_size=8,
    max_steps=8,
    optimizer="adam",
    lr=3e-3,
    num_workers=0,
    eval_batch_size=64,
)
STRATEGIES = ["ddp", "fsdp"]


def uninterrupted(runtime, strategies: list[str]) -> dict:
    return {s: full_state_dict(train(TrainConfig.from_flags(strategy=s, **FLAGS), runtime).model) for s in strategies}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    return run_ranks(uninterrupted, 2, tmp_path_factory.mktemp("uninterrupted"), STRATEGIES)[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_killed_rank_is_restarted_and_resumes_to_the_same_weights(tmp_path, references, strategy):
    """Bitwise on CPU: the resumed steps are the same sequence of operations on the same state."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in FLAGS.items()]
    flags += [f"--strategy={strategy}", f"--checkpoint-dir={tmp_path / 'checkpoints'}", "--checkpoint-every=3"]
    flags += ["--fail-at-step=5", "--fail-rank=1", "--save-model", f"--out={tmp_path}", "--run-name=restarted"]
    command = torchrun_command(2, "distlab.train", *flags)
    command.insert(command.index("--standalone") + 1, "--max-restarts=1")
    # torchrun keeps one store across restarts; distlab.runtime gives each attempt keys of its own.
    env = launcher_environment(1)
    job = run_job(command, timeout=300, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "resumed from" in job.stdout and "step 3" in job.stdout, job.stdout[-2000:]

    metrics = json.loads((tmp_path / "restarted.json").read_text())["metrics"]
    assert metrics["optimizer_steps"] == 8
    assert metrics["fault_tolerance"] == {
        "restarts": 1,
        "resumed_from_step": 3,
        "resumes": [{"restart": 1, "resumed_from_step": 3, "last_step_reached": 5, "steps_lost": 2}],
    }
    weights = torch.load(tmp_path / "restarted.pt", weights_only=True)
    assert weights.keys() == references[strategy].keys()
    for key, value in references[strategy].items():
        assert torch.equal(weights[key], value), f"{strategy}: {key} differs from the run that never failed"
