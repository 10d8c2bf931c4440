"""Two torchrun "nodes" on one machine are one job: the SLURM batch script's launch line, run twice
on 127.0.0.1 with a c10d rendezvous, trains exactly as one node with the same number of ranks.

The launch line is never retyped here: the tests run ``scripts/slurm/train.sbatch`` with ``srun``
and ``scontrol`` replaced by stubs, and take the command the script would start on each node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from distlab.jobs import free_port
from distlab.labs.launch import launcher_environment, torchrun_command

pytestmark = pytest.mark.slow

SBATCH = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "train.sbatch"
TINY_TRAINING = (
    "--model cnn --dataset synthetic --synthetic-size 256 --batch-size 16 --max-steps 5 "
    "--device cpu --num-workers 0 --log-every 1"
).split()
JOB_TIMEOUT_S = 180  # a bound on a hang, far above the ~30 s these jobs take on 2 busy cores
# The stubs stand in for Slurm: srun prints what it would run on each node (and the thread count
# the script exported for it); scontrol lists the allocation's nodes, first node first, one write at
# a time, so that a script which stops reading after the first one meets the broken pipe it would
# meet under a real scontrol with a long node list.
SRUN_STUB = '#!/usr/bin/env bash\nprintf "%s\\0" "OMP_NUM_THREADS=$OMP_NUM_THREADS" "$@"\n'
SCONTROL_STUB = '#!/usr/bin/env bash\nfor node in $STUB_NODES; do echo "$node"; sleep 0.05; done\n'


def srun_command(tmp_path: Path, slurm_env: dict[str, str], *train_args: str) -> tuple[list[str], str]:
    """The command ``train.sbatch`` hands to ``srun`` in an allocation described by ``slurm_env``
    (``STUB_NODES``: the node names), and the ``OMP_NUM_THREADS`` it exports for the ranks."""
    stubs = tmp_path / "slurm-stubs"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", **slurm_env}
    run = subprocess.run(["bash", str(SBATCH), *train_args], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, f"train.sbatch exited with {run.returncode}: {run.stderr}"
    threads, *command = run.stdout.split("\0")[:-1]
    return command, threads


def node_command(tmp_path: Path, rdzv_id: str, port: int, join_timeout_s: int, *train_args: str) -> list[str]:
    """What one node of a two-node, CPU-only allocation runs: the torchrun part of the srun line,
    with this interpreter for ``python`` and the rendezvous on 127.0.0.1."""
    slurm_env = {
        "STUB_NODES": "127.0.0.1",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": rdzv_id,
        "RDZV_PORT": str(port),
        "RDZV_JOIN_TIMEOUT_S": str(join_timeout_s),
    }
    command, _ = srun_command(tmp_path, slurm_env, *train_args)
    python = command.index("python")
    return [sys.executable, *command[python + 1 :]]


@dataclass
class Job:
    process: subprocess.Popen
    scratch: Path  # its stdout and stderr files, and torchrun's leftovers

    def output(self, stream: str) -> str:
        return (self.scratch / stream).read_text()


def start(command: list[str], tmp_path: Path) -> Job:
    """``command`` in the background, its output into files: jobs that run together must never
    block on a full pipe that nobody reads while the test waits for another job."""
    scratch = tmp_path / f"job-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    # LOGLEVEL=INFO: each torchrun reports the ranks the rendezvous gave its node. TMPDIR: torchrun
    # leaves a log folder behind in it for every run.
    env = {**launcher_environment(1), "LOGLEVEL": "INFO", "TMPDIR": str(scratch)}
    with open(scratch / "stdout", "w") as stdout, open(scratch / "stderr", "w") as stderr:
        return Job(subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env), scratch)


def finish(jobs: list[Job], timeout_s: float) -> list[tuple[int, str, str]]:
    """Each job's exit code, stdout and stderr; past ``timeout_s`` or on any error, every job still
    running is stopped: SIGTERM first, so that torchrun stops the ranks it started in their own
    sessions, then SIGKILL."""
    deadline = time.monotonic() + timeout_s
    try:
        for job in jobs:
            job.process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in (job.process for job in jobs if job.process.poll() is None):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return [(job.process.returncode, job.output("stdout"), job.output("stderr")) for job in jobs]


def ranks_of_node(stderr: str) -> tuple[int, list[int]]:
    """The node count and this node's global ranks, from torchrun's rendezvous report."""
    nodes = re.search(r"group_world_size=(\d+)", stderr)
    ranks = re.search(r"global_ranks=\[([\d, ]*)\]", stderr)
    assert nodes and ranks, f"no rendezvous report in torchrun's log:\n{stderr[-2000:]}"
    return int(nodes.group(1)), [int(r) for r in ranks.group(1).split(",")]


def test_slurm_script_runs_one_torchrun_per_node_at_the_first_nodes_rendezvous(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    gpu_job = {
        "STUB_NODES": "gpu-a17 gpu-a18 gpu-a19",
        "SLURM_JOB_NODELIST": "gpu-a[17-19]",
        "SLURM_NNODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_PER_NODE": "a100:4",
        "SLURM_CPUS_PER_TASK": "32",
    }
    command, threads = srun_command(tmp_path, gpu_job, "--strategy", "fsdp")
    assert command == [
        "--kill-on-bad-exit=1",
        "--cpus-per-task=32",
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes=3",
        "--nproc_per_node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu-a17:29500",
        "--rdzv-id=4242",
        "--rdzv-conf=join_timeout=300",
        "-m",
        "distlab.train",
        "--strategy",
        "fsdp",
    ]
    assert threads == "OMP_NUM_THREADS=8", "each rank gets its share of the task's cores"
    cpu_job = {key: gpu_job[key] for key in ("STUB_NODES", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_JOB_ID")}
    command, threads = srun_command(tmp_path, cpu_job)
    assert "--nproc_per_node=1" in command and threads == "OMP_NUM_THREADS=1", "without GPUs: one rank per node"
    # Run by hand, outside an allocation: one line saying how to submit it.
    by_hand = subprocess.run(["bash", str(SBATCH)], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert by_hand.returncode == 2 and by_hand.stderr.count("\n") == 1 and "sbatch" in by_hand.stderr


def test_two_nodes_on_one_machine_train_as_one_node_with_as_many_ranks(tmp_path):
    rdzv_id = f"distlab-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    nodes_out, reference_out = tmp_path / "two-nodes", tmp_path / "one-node"
    node = node_command(tmp_path, rdzv_id, port, 60, *TINY_TRAINING, "--out", str(nodes_out))
    reference = torchrun_command(2, "distlab.train", *TINY_TRAINING, "--out", str(reference_out))
    # Both "nodes" start together, as srun starts them; the reference runs alongside: all three
    # are independent jobs, and running them at once keeps this test within its time budget.
    outputs = finish([start(node, tmp_path), start(node, tmp_path), start(reference, tmp_path)], JOB_TIMEOUT_S)
    for job, (returncode, _, stderr) in zip(("node A", "node B", "the one-node reference"), outputs):
        assert returncode == 0, f"{job} failed:\n{stderr[-3000:]}"

    (first, second) = (ranks_of_node(stderr) for _, _, stderr in outputs[:2])
    assert first[0] == second[0] == 2, "each torchrun saw both nodes"
    assert sorted(first[1] + second[1]) == [0, 1], "the two nodes hold ranks 0 and 1, one each"
    assert sum("distlab: " in stdout for _, stdout, _ in outputs[:2]) == 1, "only rank 0's node logs"

    (nodes_file,) = nodes_out.glob("*.json")
    (reference_file,) = reference_out.glob("*.json")
    assert nodes_file.name == reference_file.name == "ddp-cnn-synthetic-2xcpu.json"
    nodes, one_node = json.loads(nodes_file.read_text()), json.loads(reference_file.read_text())
    assert nodes["environment"]["world_size"] == 2 and nodes["environment"]["backend"] == "gloo"
    assert len(nodes["metrics"]["memory"]["ranks"]) == 2, "rank 0 gathered a record from every rank"
    losses = [epoch["step_loss"] for epoch in nodes["metrics"]["epochs"]]
    assert len(losses[0]) == 5
    # Same ranks, same shards, same seed: the same sums, so the same bits, whichever node is rank 0.
    assert losses == [epoch["step_loss"] for epoch in one_node["metrics"]["epochs"]]


def test_nodes_with_different_rendezvous_ids_fail_within_the_join_timeout(tmp_path):
    # Two jobs that each wait for a second node which never joins them: both must give up.
    port, join_timeout_s = free_port(), 5
    started = time.monotonic()
    nodes = [node_command(tmp_path, rdzv_id, port, join_timeout_s, *TINY_TRAINING) for rdzv_id in ("job-a", "job-b")]
    outputs = finish([start(node, tmp_path) for node in nodes], JOB_TIMEOUT_S)
    elapsed = time.monotonic() - started
    errors = [re.findall(r"Rendezvous\w*Error", stderr) for _, _, stderr in outputs]
    assert all(returncode != 0 for returncode, _, _ in outputs)
    # The node hosting the store times out; the other may time out too, or first lose the store.
    assert all(errors) and any("RendezvousTimeoutError" in names for names in errors), errors
    assert elapsed < JOB_TIMEOUT_S / 2, f"gave up after {elapsed:.0f} s, not about {join_timeout_s} s after starting"
