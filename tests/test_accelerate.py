"""The Accelerate route (scripts/accelerate): its DDP config, launched by
``accelerate launch`` on 2 CPU processes, ends with the weights that
``distlab.train --strategy ddp`` ends with. Its FSDP config shards the units
distlab shards and, once past Accelerate's device check, trains the same
weights too; on CPU, where that check stands, the script stops rather than
pass DDP off as FSDP."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distlab.data import DataSpec
from distlab.labs.launch import launcher_environment, run_job
from distlab.models import ATOL
from distlab.testing import assert_same_state, run_torchrun

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[1] / "scripts" / "accelerate"
SCRIPT, DDP_CONFIG, FSDP_CONFIG = HERE / "train.py", HERE / "config_ddp.yaml", HERE / "config_fsdp.yaml"
# Flags both entry points take. SGD keeps the different summation orders at
# rounding level (see test_equivalence); two micro-batches a step put
# accelerator.accumulate() against distlab's no_sync.
FLAGS = [
    "--model", "cnn", "--dataset", "synthetic", "--synthetic-size", "640", "--batch-size", "8",
    "--accum-steps", "2", "--max-steps", "3", "--optimizer", "sgd", "--lr", "0.05", "--seed", "0",
    "--num-workers", "0", "--device", "cpu",
]  # fmt: skip
SPECS = {"cnn": DataSpec("image", (1, 28, 28), 10), "gpt-tiny": DataSpec("tokens", (64,), 256)}
FSDP_ON_CPU = "the config asks for FSDP, but on cpu Accelerate runs MULTI_CPU instead"


@functools.cache
def accelerate_script():
    spec = importlib.util.spec_from_file_location("accelerate_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accelerate_launch(
    config: Path, script: Path, *args: str, cwd: Path, processes: int = 2
) -> subprocess.CompletedProcess:
    """``accelerate launch`` (its console script's module), one thread per process."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config)]
    command += ["--num_processes", str(processes), "--main_process_port", "0"]  # port 0: Accelerate picks a free one
    command += [str(script), *args]
    return run_job(command, timeout=180, env=launcher_environment(1), cwd=cwd)


def _ok(job: subprocess.CompletedProcess) -> None:
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]


@pytest.fixture(scope="module")
def distlab_ddp(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The reference: distlab.train --strategy ddp's final weights for FLAGS."""
    out = tmp_path_factory.mktemp("distlab")
    _ok(
        run_torchrun(
            2, "distlab.train", "--strategy", "ddp", *FLAGS, "--save-model", "--out", str(out), "--run-name", "ddp"
        )
    )
    return torch.load(out / "ddp.pt", weights_only=True)


def test_the_ddp_config_trains_the_weights_distlab_ddp_trains(tmp_path, distlab_ddp):
    launched = accelerate_launch(DDP_CONFIG, SCRIPT, *FLAGS, "--save", str(tmp_path / "w.pt"), cwd=tmp_path)
    _ok(launched)
    # One gloo group of two: two processes that each trained alone would also exit 0.
    assert "accelerate: MULTI_CPU, 2 process(es), backend gloo" in launched.stdout, launched.stdout
    assert_same_state(torch.load(tmp_path / "w.pt", weights_only=True), distlab_ddp, label="accelerate ddp")
    # The comparison can fail: training moved the weights far beyond its tolerance.
    cfg, _ = accelerate_script().parse_config(FLAGS)
    initial = accelerate_script().make_model(cfg, SPECS["cnn"]).state_dict()
    assert max((initial[k] - distlab_ddp[k]).abs().max().item() for k in distlab_ddp) > 100 * ATOL


def test_the_fsdp_config_shards_the_units_distlab_shards(monkeypatch):
    # Read the config as `accelerate launch` does and hand its settings on as
    # the launcher does (environment variables), without starting processes.
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin, get_module_children_bottom_up
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(FSDP_CONFIG), str(SCRIPT)])
    )
    for key, value in prepare_multi_gpu_env(args).items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    for name, spec in SPECS.items():
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        cfg, _ = accelerate_script().parse_config(["--model", name])
        model = accelerate_script().make_model(cfg, spec)
        plugin.set_auto_wrap_policy(model)
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        sharded = [m for m in get_module_children_bottom_up(model)[:-1] if policy(m)]  # the root comes last
        assert {id(m) for m in sharded} == {id(u) for u in model.shard_units()}, name


def test_the_fsdp_config_on_cpu_stops_instead_of_training_ddp(tmp_path):
    # Accelerate enables FSDP only for accelerator devices (accelerate/state.py,
    # AcceleratorState: only the MULTI_GPU/XPU/... branch sets DistributedType.FSDP);
    # on CPU processes it silently trains with DDP, which the script refuses.
    # Should a later Accelerate shard on CPU, this fails: the test below then needs no gate lifted.
    # Each process decides alone, so one process is enough to show it.
    launched = accelerate_launch(FSDP_CONFIG, SCRIPT, "--device", "cpu", "--max-steps", "1", cwd=tmp_path, processes=1)
    assert launched.returncode != 0
    assert FSDP_ON_CPU in launched.stderr, launched.stdout[-2000:] + launched.stderr[-2000:]


# Lifts the device check alone: the processes skip cpu=True and their gloo
# group passes for MULTI_GPU, so AcceleratorState turns the FSDP config on
# (and the device is named, or Accelerate would look for a GPU to put them on);
# train.py itself runs unchanged.
GATE_LIFTED = f"""
import os
import runpy
import accelerate
from accelerate.state import PartialState
from accelerate.utils import DistributedType

os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
PartialState._prepare_backend = lambda *_, **__: ("gloo", DistributedType.MULTI_GPU)
init = accelerate.Accelerator.__init__
accelerate.Accelerator.__init__ = lambda self, *args, cpu=False, **kwargs: init(self, *args, **kwargs)
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
"""


def test_accelerates_fsdp2_past_its_device_check_trains_the_ddp_weights(tmp_path, distlab_ddp):
    # What a GPU run would exercise of this route (prepare's fully_shard per unit,
    # FSDP2's accumulation, get_state_dict's gather), on gloo CPU processes.
    probe = tmp_path / "gate_lifted.py"
    probe.write_text(GATE_LIFTED)
    launched = accelerate_launch(FSDP_CONFIG, probe, *FLAGS, "--save", str(tmp_path / "w.pt"), cwd=tmp_path)
    _ok(launched)
    assert "accelerate: FSDP, 2 process(es), backend gloo, device cpu, model wrapped as FSDPMnistCNN" in launched.stdout
    assert_same_state(torch.load(tmp_path / "w.pt", weights_only=True), distlab_ddp, label="accelerate fsdp2")
