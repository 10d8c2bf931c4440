"""The profiling chapter's reader on a real GPU trace (GPU tier, ``python -m pytest -m gpu``): a DDP step profiled
with CUDA activities on one NCCL rank per GPU (two at most). CPU twin: tests/test_profiling.py reads a GPU trace
written by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(
    GPUS == 0, reason="no CUDA GPU here: the GPU tier (python -m pytest -m gpu) runs where one is"
)


PROFILED_DDP_STEP = """
import sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, schedule

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
model = DDP(torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda(),
            device_ids=[rank], bucket_cap_mb=1)
x, y = torch.randn(256, 1024, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=2)) as prof:
    for _ in range(4):
        F.cross_entropy(model(x), y).backward()
        torch.cuda.synchronize()
        prof.step()
prof.export_chrome_trace(f"{sys.argv[1]}/trace-rank{rank}.json")
dist.destroy_process_group()
"""


@pytest.mark.gpu
@needs_gpu
def test_a_profiled_ddp_step_on_the_gpu_is_read_from_its_kernels(tmp_path):
    """Compute is the GPU's kernels (no CPU op counts), and with two GPUs NCCL's all-reduce kernels are the
    communication lane."""
    from distlab.measure import profile

    ranks = min(GPUS, 2)
    script = tmp_path / "profiled_ddp_step.py"
    script.write_text(PROFILED_DDP_STEP)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script),
           str(tmp_path)]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(ranks):
        steps = profile.read_steps(tmp_path / f"trace-rank{rank}.json")
        assert len(steps) == 2
        for step in steps:
            compute = [e["name"] for e in step["events"] if e["lane"] == "compute"]
            communication = [e["name"] for e in step["events"] if e["lane"] == "communication"]
            assert compute and not any(name.startswith("aten::") for name in compute), compute[:5]
            if ranks == 2:
                assert communication and all("nccl" in name.lower() for name in communication), communication[:5]
            added = profile.step_time(step)
            assert 0 <= added["exposed_ms"] <= added["communication_ms"] <= added["step_ms"]
