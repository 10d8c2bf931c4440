"""What the second GPU audit found on the paths a GPU takes (NCCL's transport on every NCCL rank, the quick tier's
time on one GPU and on two, FSDP2 with fused Adam and an fp16 scaler, HSDP's mesh, the report's scrub and labels),
each followed on the CPU up to the call that needs a GPU; the GPU tier (tests/test_gpu.py) holds the GPU half.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_gpu_audit import load_script

ROOT = Path(__file__).resolve().parents[1]


NCCL_TRANSPORT = ("NCCL_P2P_DISABLE", "NCCL_CUMEM_HOST_ENABLE")


def simulate_two_gpus(monkeypatch, peer_access: bool) -> None:
    """Two GPUs as ``torch.cuda`` and the survey see them (``peer_access``: a H100 pair; without: a T4 pair)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=15 << 30))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: peer_access)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))


def environment_at_group_creation(monkeypatch, device: str, backend: str) -> dict[str, str]:
    """``runtime.distributed(device, backend)`` run up to ``init_process_group`` (which needs the GPUs): the NCCL
    variables of this rank's own environment at that moment."""
    import os

    import torch.distributed as dist

    from distlab import runtime

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in NCCL_TRANSPORT})
    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(*args, **kwargs):
        seen.update({name: os.environ[name] for name in NCCL_TRANSPORT if name in os.environ})
        seen["backend"] = kwargs["backend"]
        raise Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Stop), runtime.distributed(device, backend):
        pass
    return seen


def test_t2_every_nccl_rank_sets_nccls_transport_before_its_group_on_gpus_without_peer_access(monkeypatch):
    """T2 (gpu-audit-2): NCCL's transport for GPUs without peer access (P8) was set by the labs, the report and
    ``labs.launch``, not by ``distlab.testing.run_torchrun`` or the grader's forked ranks: on a T4 pair NCCL 2.27
    would run with cuMem host buffers on (CUDA error 217). ``runtime.distributed``, where every NCCL rank of the
    course starts, now sets it in the rank's own environment before the group is made (run here on two simulated
    T4s up to ``init_process_group``); a gloo rank, and a rank on GPUs with peer access, get nothing. GPU twin:
    every NCCL test of ``tests/test_gpu.py`` on a T4 pair."""
    simulate_two_gpus(monkeypatch, peer_access=False)
    seen = environment_at_group_creation(monkeypatch, "cuda", "nccl")
    assert seen == {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0", "backend": "cpu:gloo,cuda:nccl"}
    assert environment_at_group_creation(monkeypatch, "cuda", "gloo") == {"backend": "gloo"}


def test_t2_nothing_is_set_for_nccl_ranks_on_gpus_with_peer_access(monkeypatch):
    simulate_two_gpus(monkeypatch, peer_access=True)
    assert environment_at_group_creation(monkeypatch, "cuda", "nccl") == {"backend": "cpu:gloo,cuda:nccl"}


def test_t2_a_value_the_launcher_chose_is_kept(monkeypatch):
    """A launcher (or a learner) that set one of the variables keeps it: the rank only fills in what is missing."""
    import os

    simulate_two_gpus(monkeypatch, peer_access=False)
    monkeypatch.setenv("NCCL_CUMEM_HOST_ENABLE", "1")
    kept = dict(os.environ)
    monkeypatch.setattr(os, "environ", kept)
    from distlab import runtime

    runtime.set_nccl_transport_here()
    assert kept["NCCL_CUMEM_HOST_ENABLE"] == "1" and kept["NCCL_P2P_DISABLE"] == "1"


def test_t7_the_images_nccl_version_is_not_an_nccl_setting():
    """T7 (gpu-audit-2): the H200 report's ``nccl_settings`` held ``NCCL_VERSION`` (2.28.3-1), the CUDA image's
    variable: not a setting, and not the NCCL that ran (2.28.9). Settings are what NCCL reads."""
    from distlab.measure.hardware import nccl_settings

    environ = {"NCCL_VERSION": "2.28.3-1", "NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "WARN", "PATH": "/usr/bin"}
    assert nccl_settings(environ) == {"NCCL_DEBUG": "WARN", "NCCL_P2P_DISABLE": "1"}


def test_t8_a_one_rank_gpu_run_is_not_labelled_with_a_backend_it_does_not_use():
    """T8 (gpu-audit-2): the pinned page printed "Measured on 1 x NVIDIA H200 (nccl)" for copies that send nothing
    between ranks. The backend is named where there are ranks to connect."""
    from distlab.results import hardware_label

    one = {"device": "cuda:0", "gpus": ["NVIDIA H200"], "device_name": "NVIDIA H200", "backend": "nccl",
           "world_size": 1}  # fmt: skip
    assert hardware_label(one) == "1 x NVIDIA H200"
    two = one | {"gpus": ["Tesla T4"] * 2, "device_name": "Tesla T4", "world_size": 2}
    assert hardware_label(two) == "2 x Tesla T4 (nccl)"
    assert hardware_label(two | {"backend": "gloo"}) == "2 x Tesla T4 (gloo)"


def test_t10_gpu_check_without_torch_says_so_in_one_line_and_exits_2(tmp_path):
    """T10 (gpu-audit-2): in a Python without torch, ``gpu_check.py`` ended in a ``ModuleNotFoundError`` traceback.
    Here torch is made unimportable (``sys.modules["torch"] = None``) before the script runs."""
    import subprocess
    import sys

    script = ROOT / "scripts" / "gpu_check.py"
    run = (f"import runpy, sys; sys.modules['torch'] = None; sys.argv = [{str(script)!r}, {str(tmp_path / 'o')!r}]; "
           f"runpy.run_path({str(script)!r}, run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "torch is not installed" in done.stderr, done.stderr


QUICK_LIMIT_S = 480
"""The most the quick selection may be estimated to take on one GPU or on two: 80 % of ``gpu_check.py``'s stop,
room for a slower host (every test starts torchrun and imports torch) and for the estimates' own error."""


def quick_marked(function) -> bool:
    """Whether a test of the GPU tier is in the quick selection: marked itself, or one of its parameters is."""
    marks = getattr(function, "pytestmark", [])
    if any(mark.name == "quick" for mark in marks):
        return True
    params = [value for mark in marks if mark.name == "parametrize" for value in mark.args[1]]
    return any(mark.name == "quick" for value in params for mark in getattr(value, "marks", ()))


def test_t3_the_quick_selection_is_estimated_test_by_test_on_one_gpu_and_on_two_inside_its_stop():
    """T3 (gpu-audit-2): the quick selection was timed for one GPU only (5.9 minutes), and two GPUs were said to add
    ~70 s; they add the report's two NCCL parts, NCCL jobs in four labs and on the grader: ~9 minutes against a 600 s
    stop. ``gpu_quick_estimate.quick_estimate_s`` now gives each quick test's time on one GPU and on two, from the
    H200 run's durations and named estimates; on two GPUs the selection leaves what two ranks already run, and both
    totals fit well inside the stop, the report inside its own budget. Every quick test of the tier is counted."""
    import gpu_quick_estimate
    import test_gpu
    import test_gpu_labs

    gpu_check = load_script("gpu_check")
    assert QUICK_LIMIT_S <= 0.8 * gpu_check.STOP_S["quick"]
    tier = {**vars(test_gpu), **vars(test_gpu_labs)}
    quick = {name for name, function in tier.items() if name.startswith("test_") and quick_marked(function)}
    for gpus in (1, 2):
        estimate = gpu_quick_estimate.quick_estimate_s(gpus)
        assert sum(estimate.values()) <= QUICK_LIMIT_S, (gpus, round(sum(estimate.values())), estimate)
        assert {name.split("[")[0] for name in estimate if name.startswith("test_")} == quick, gpus
        report = estimate["test_the_gpu_report_runs_every_part_that_should_and_says_so"]
        assert report < test_gpu.REPORT_BUDGET_S
    assert sum(gpu_quick_estimate.quick_estimate_s(2).values()) > sum(gpu_quick_estimate.quick_estimate_s(1).values())


def test_t9_the_no_wait_check_runs_whole_steps_of_the_library_run():
    """T9 (gpu-audit-2): the no-wait GPU test checked ``MetricSums.add`` only. It now runs whole steps of
    ``distlab.train``'s own run (its DataLoader, forward, backward, Adam, the metric sums) under CUDA's sync debug
    mode. Here the same code on one CPU rank, up to that mode, which needs CUDA: a warm-up step and three more."""
    import test_gpu

    assert test_gpu.steps_of_a_run("cpu", "gloo", steps=3) == 4 * 32


def fsdp2_fused_adam_and_scaler_steps(runtime, steps: int) -> tuple[float, int, bool]:
    """The FSDP lab script's model (``fsdp_train.build``: FSDP2 on gpt-tiny) stepped as its ``train`` steps it on a
    T4, ``Adam(fused=True)`` and an enabled GradScaler, on this CPU rank: the scale after ``steps`` steps, how many
    steps the scaler skipped, and whether every shard moved. fp32 compute: a CPU has no fp16 autocast worth the
    name, and the fused kernel here is the CPU's."""
    script = load_script("fsdp_train")
    args = script.parse_args(["--model", "gpt-tiny", "--samples", "64", "--batch-size", "4", "--num-workers", "0"])
    model, _ = script.build(args, torch.device("cpu"), torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    before = [p.to_local().detach().clone() for p in model.parameters()]
    tokens, targets = script.synthetic(args, 4 * steps, 0).tensors
    skipped = 0
    for index in range(steps):
        x, y = tokens[4 * index : 4 * index + 4], targets[4 * index : 4 * index + 4]
        losses, _ = script.loss_and_correct(model(x), y)
        scaler.scale(losses.mean()).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale
        optimizer.zero_grad(set_to_none=True)
    moved = all(not torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before) if b.numel())
    return scaler.get_scale(), skipped, moved


def test_t4_fsdp2_steps_with_fused_adam_and_an_enabled_gradscaler_on_gloo_ranks(tmp_path):
    """T4 (gpu-audit-2): FSDP2 + ``Adam(fused=True)`` + an enabled GradScaler, the FSDP lab's GPT step on a T4, had
    never run. Here the lab script's own model and the same optimizer and scaler step on two gloo ranks of the CPU:
    the fused kernel takes the DTensor shards beside the scaler's plain ``grad_scale``/``found_inf``, every rank
    agrees on the scale, and the shards move. What only CUDA has (fp16 autocast, the CUDA fused kernel, NCCL):
    ``tests/test_gpu.py::test_fsdp2_with_fused_adam_and_an_fp16_gradscaler_trains_on_the_gpu``."""
    from distlab.testing import run_ranks

    ranks = run_ranks(fsdp2_fused_adam_and_scaler_steps, 2, tmp_path, 3)
    assert ranks[0] == ranks[1], ranks  # one scale, the same skipped steps: found_inf was reduced over the ranks
    scale, skipped, moved = ranks[0]
    assert scale == 65536.0 * 2.0**-skipped and skipped < 3 and moved, ranks


def test_p13_hsdps_mesh_on_nccl_ranks_is_made_from_new_groups_with_a_gloo_leg_not_split_group(monkeypatch):
    """P13, T5 (gpu-audit-2): HSDP's 2-D mesh came from ``init_device_mesh``, which on a default group bound to a GPU
    makes its groups with ``split_group`` of the gloo+NCCL parent, the path torch changed across releases. It is now
    made from ``dist.new_group`` groups on ``cpu:gloo,cuda:nccl`` (NCCL split by NCCL itself, gloo anew) and
    ``DeviceMesh.from_group``. Here rank 1 of four simulated NCCL ranks, up to the groups (which need GPUs): every
    rank makes every column's then every row's group, in one order, and keeps its own; ``split_group`` and
    ``init_device_mesh`` are never called. The same code runs whole on four gloo ranks:
    ``tests/test_equivalence.py::test_hsdp_on_a_2x2_mesh_trains_like_ddp``. ``reshard_to``'s mesh FSDP2 builds
    itself; the GPU tier's 4-GPU test says so."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.device_mesh import DeviceMesh

    from distlab.parallel.fsdp2 import FSDP2
    from distlab.runtime import Runtime

    made, meshes = [], []

    def refuse(*args, **kwargs):
        raise AssertionError("split_group or init_device_mesh: the path P13 leaves")

    monkeypatch.setattr(dist, "split_group", refuse)
    monkeypatch.setattr(device_mesh, "init_device_mesh", refuse)
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend: made.append((ranks, backend)) or f"group{ranks}")
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda groups, device_type, mesh, mesh_dim_names:
                        meshes.append((groups, device_type, mesh.tolist(), mesh_dim_names)) or "mesh"))  # fmt: skip
    rank_1_of_4 = Runtime(1, 1, 4, torch.device("cuda", 1), "nccl")
    assert FSDP2(replicate=2).device_mesh(rank_1_of_4) == "mesh"
    both = "cpu:gloo,cuda:nccl"
    assert made == [([0, 2], both), ([1, 3], both), ([0, 1], both), ([2, 3], both)]
    assert meshes == [(["group[1, 3]", "group[0, 1]"], "cuda", [[0, 1], [2, 3]], ("replicate", "shard"))]
