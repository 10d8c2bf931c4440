"""The runtime's helpers on real gloo ranks: per-rank payloads reach rank 0
in rank order, and a result file records where the job ran, once; the group
distributed() made is gone when it ends, whatever its body built."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from distlab.cli import finish_run
from distlab.labs.launch import launcher_environment
from distlab.runtime import gather_per_rank
from distlab.testing import run_ranks

DTENSOR_DISPATCH_CACHES_SPECS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
"""From torch 2.14 DTensor keeps the sharding of the ops it has seen (their specs, the device mesh in them, and
so the process group) where no Python container holds them, out of distlab's reach: measured, torch 2.10 frees
the group once distributed() ends, 2.14.1 does not."""


def gather_and_write(runtime, out_dir: str):
    ranks = gather_per_rank({"rank": runtime.rank, "bytes": 1000 * (runtime.rank + 1)}, runtime)
    path = finish_run(runtime, out_dir, "gathered", "test", {}, {"ranks": ranks})
    return {"ranks": ranks, "path": str(path) if path else None}


def test_gather_per_rank_and_finish_run_write_once_on_rank_0(tmp_path):
    results = run_ranks(gather_and_write, 3, tmp_path, str(tmp_path))
    assert results[0]["ranks"] == [{"rank": r, "bytes": 1000 * (r + 1)} for r in range(3)]
    assert results[1]["ranks"] is None and results[2]["ranks"] is None
    assert results[0]["path"] and results[1]["path"] is None and results[2]["path"] is None
    record = json.loads((tmp_path / "gathered.json").read_text())
    env = record["environment"]
    assert (env["world_size"], env["backend"], env["device"]) == (3, "gloo", "cpu")
    assert env["torch"] == torch.__version__
    assert record["metrics"]["ranks"] == results[0]["ranks"]


# A fresh interpreter, so that torch.distributed.nn and the sharded GradScaler are first imported inside the job,
# as a script's DDP (through torch._dynamo) and distlab's FSDP import them; a one-rank gloo group in memory.
GROUP_LIFETIME = """
import sys, weakref
import torch, torch.distributed as dist, torch.nn as nn
assert "torch.distributed.nn" not in sys.modules
from distlab.runtime import distributed
from distlab.errors import run_main

groups, built = [], []

def body(fail):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    import torch.distributed.nn
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    groups.append(weakref.ref(dist.group.WORLD))
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    ddp(torch.ones(3, 4)).sum().backward()
    sharded = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))  # FSDP's modules form reference cycles
    sharded(torch.ones(3, 4)).sum().backward()
    built.extend(weakref.ref(thing) for thing in (ddp, sharded, *sharded.parameters()))
    if fail:  # the traceback keeps this frame, and both models
        raise RuntimeError("the body failed")

def failing(argv):
    with distributed("cpu"):
        body(fail=True)

with distributed("cpu"):
    body(fail=False)
try:
    run_main(failing)  # a failed rank says why first, then lets go of what still holds the group
except RuntimeError as err:
    assert str(err) == "the body failed"
print("built:", *("alive" if thing() is not None else "freed" for thing in built))
print("groups:", *("held" if group() is not None else "gone" for group in groups))
"""


def test_the_group_distributed_made_is_gone_when_it_ends():
    """A gloo group that outlives destroy_process_group keeps its worker threads and is destroyed later, where
    that deadlocks (by DDP's Reducer, under the GIL) or aborts the process (at interpreter shutdown: "terminate
    called without an active exception"). Nothing the body built, nor torch modules it imported, may hold it."""
    job = subprocess.run(
        [sys.executable, "-c", GROUP_LIFETIME], capture_output=True, text=True, timeout=120, env=launcher_environment(1)
    )
    assert job.returncode == 0, job.stderr[-3000:]
    built, groups = job.stdout.splitlines()[-2:]
    assert "alive" not in built, job.stdout + job.stderr[-3000:]  # the models, their parameters: all freed
    if DTENSOR_DISPATCH_CACHES_SPECS:
        # torch's own C++ DTensor dispatch cache keeps the last sharding specs, and through their device mesh the
        # group, whatever distlab frees; the process must still end cleanly (the abort is at exit)
        assert "terminate called" not in job.stderr
    else:
        assert groups == "groups: gone gone", job.stdout + job.stderr[-3000:]


# run_main freezes what the imports made before it calls main: its collections (the group's teardown, its own,
# the interpreter's at exit) then walk only what main made, and still free main's cycles.
FROZEN_IMPORTS = """
import atexit, gc, weakref
import torch
from distlab.errors import run_main

class Link:
    pass

def main(argv):
    first, second = Link(), Link()
    first.other, second.other = second, first
    freed = weakref.ref(first)
    walked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    atexit.register(lambda: print(walked, frozen, "freed" if freed() is None else "alive"))

run_main(main)
"""


def test_run_mains_collections_walk_what_main_made_and_free_its_cycles():
    job = subprocess.run([sys.executable, "-c", FROZEN_IMPORTS], capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    walked, frozen, cycle = job.stdout.split()
    assert int(frozen) > 10 * int(walked), job.stdout  # torch's objects skipped
    assert cycle == "freed"  # by run_main's own collection, before the interpreter's


QUIET_RANK = """
import sys
from distlab.errors import DistlabError, run_main

def main(argv):
    raise DistlabError("strategy single runs on exactly 1 rank(s)")

run_main(main)
"""


def test_a_quiet_rank_waits_for_rank_0_to_report_the_mistake_and_leaves_when_torchrun_stops_it():
    """Rank 1 of 2 hits the mistake rank 0 reports: it says nothing, and stays until torchrun's SIGTERM (which
    comes once rank 0 has said it and left). Leaving at once, it had torchrun stop rank 0 before rank 0 said
    anything (CI's slow tier, under load)."""
    import signal
    import time

    env = {**launcher_environment(1), "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    rank = subprocess.Popen([sys.executable, "-c", QUIET_RANK], env=env, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4.0)  # its imports, then the mistake: a rank that left at once has ended by now
        assert rank.poll() is None, f"rank 1 left before rank 0 could say anything: {rank.stderr.read()}"
        stopped = time.monotonic()
        rank.send_signal(signal.SIGTERM)
        _, err = rank.communicate(timeout=10)
        assert time.monotonic() - stopped < 5 and rank.returncode != 0
        assert "distlab:" not in err, err  # the mistake is rank 0's to report
    finally:
        rank.kill()
