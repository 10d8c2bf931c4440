"""The course's first GPU run (one H200, 2026-11-27, at commit af2257a) failed where no CPU run could.
Each test here follows one of those failures on the CPU, up to the call that needs a GPU, and fails on the code
that ran there (af2257a) for the reason the GPU run failed. The library is imported inside the tests, so that
they run, and fail, against that code too.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist


def test_finding_1_a_cuda_group_is_created_with_a_gloo_leg(monkeypatch):
    """Every NCCL run of distlab.train exited 1 at its end: a CPU tensor all-reduced on an NCCL-only group. Here
    distributed() runs on a simulated GPU up to init_process_group: the group it asks for carries gloo for CPU
    tensors."""
    from distlab import runtime

    asked = {}

    class Stop(Exception):
        pass

    def init_process_group(**kwargs):
        asked.update(kwargs)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    # what the survey every NCCL rank makes for its transport reads of the (one, simulated) GPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=141 << 30))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(Stop), runtime.distributed("cuda"):
        pass
    assert asked["backend"] == "cpu:gloo,cuda:nccl"
    assert asked["device_id"] == torch.device("cuda", 0)


def test_finding_4_fsdp2_with_cpu_offload_materialises_its_shards_on_the_cpu(monkeypatch):
    """FSDP2 with CPU offload refused shards that were materialised on the GPU before fully_shard's offload."""
    from distlab.parallel import fsdp2 as fsdp2_module
    from distlab.runtime import Runtime

    cuda = Runtime(0, 0, 2, torch.device("cuda", 0), "nccl")
    strategy = fsdp2_module.FSDP2(cpu_offload=True)
    where = []
    monkeypatch.setattr(fsdp2_module.FSDP2, "wrap", lambda self, model, rt: model)
    monkeypatch.setattr("distlab.parallel.base.materialize", lambda model, device, seed: where.append(device) or model)
    strategy.build(torch.nn.Linear(2, 2, device="meta"), cuda, seed=0, sharded_init=True)
    assert where == [torch.device("cpu")]
    assert strategy.parameter_device(cuda) == torch.device("cpu")


def test_finding_7_a_result_records_the_courses_commit_not_an_enclosing_repositorys(tmp_path, monkeypatch):
    """The H200 run's results named the commit of an unrelated repository the course's copy sat inside."""
    from distlab import results

    outer = tmp_path / "outer"
    package = outer / "copy" / "src" / "distlab"
    package.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(outer)]
    subprocess.run([*git, "init", "-q"], check=True)
    (outer / "unrelated.txt").write_text("another project\n")
    subprocess.run([*git, "add", "unrelated.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "unrelated"], check=True)
    monkeypatch.setattr(results, "__file__", str(package / "results.py"))
    assert results._git_commit() is None
    monkeypatch.undo()
    own = Path(results.__file__).resolve().parents[2]
    if (own / ".git").exists():  # a checkout of the course itself names its own commit
        head = subprocess.run(["git", "-C", str(own), "rev-parse", "--short=12", "HEAD"], capture_output=True)
        assert results._git_commit().startswith(head.stdout.decode().strip())


def test_finding_8_the_measured_on_gpus_page_says_what_a_cpu_run_does_not_execute():
    """The page said the CPU tests leave no GPU path unexecuted; the first GPU run found five they had."""
    page = (Path(__file__).resolve().parents[1] / "book" / "gpu_results.md").read_text()
    assert "goes unexecuted" not in page
    assert "python -m pytest -m gpu" in page and "never executed there" in page
