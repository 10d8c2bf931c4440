"""The allocator's snapshot read by the course's reader on a real GPU (GPU tier, ``python -m pytest -m gpu``): one
FSDP2 step on one NCCL rank with the allocator's history recorded, its snapshot dumped and read. CPU twin:
tests/test_allocator.py reads snapshots written by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is"
)

RECORDED_FSDP2_STEP = """
import json, pickle, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
torch.cuda.set_device(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters())
x, y = torch.randn(512, 1024, device="cuda"), torch.randn(512, 1024, device="cuda")
torch.cuda.memory._record_memory_history(max_entries=100_000)
F.mse_loss(model(x), y).backward()
optimizer.step()
torch.cuda.synchronize()
stats = torch.cuda.memory_stats()
torch.cuda.memory._dump_snapshot(sys.argv[1] + "/snapshot.pickle")
torch.cuda.memory._record_memory_history(enabled=None)
free, total = torch.cuda.mem_get_info()
keys = ("allocated_bytes.all.current", "reserved_bytes.all.current", "requested_bytes.all.current")
json.dump({**{k: stats[k] for k in keys}, "device_used": total - free}, open(sys.argv[1] + "/stats.json", "w"))
dist.destroy_process_group()
"""


@pytest.mark.gpu
@pytest.mark.quick
@needs_gpu
def test_a_recorded_fsdp2_steps_snapshot_reads_as_memory_stats_says(tmp_path):
    """The reader's allocated, reserved and requested are the allocator's own current numbers, and the device's
    used memory holds the reserved and more (CUDA's context)."""
    import json
    import pickle

    from distlab.measure.allocator import read_snapshot

    script = tmp_path / "recorded_fsdp2_step.py"
    script.write_text(RECORDED_FSDP2_STEP)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script),
           str(tmp_path)]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads((tmp_path / "stats.json").read_text())
    snapshot = pickle.loads((tmp_path / "snapshot.pickle").read_bytes())
    assert snapshot["device_traces"] and snapshot["device_traces"][0], "the history was recorded"
    read = read_snapshot(snapshot)
    assert read["allocated"] == stats["allocated_bytes.all.current"]
    assert read["reserved"] == stats["reserved_bytes.all.current"]
    assert read["requested"] == stats["requested_bytes.all.current"]
    assert read["allocated"] + read["awaiting_free"] + read["cached"] == read["reserved"]
    assert stats["device_used"] > read["reserved"]
