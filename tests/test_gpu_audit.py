"""What the GPU audit (../shared/reviews/gpu-audit-1.md) predicted would break on the next GPU, followed on the CPU
up to the call that needs a GPU. Each test fails on the code the audit read (b92fcb6) for the reason it gave; what
only a GPU can show has its test in the GPU tier (tests/test_gpu.py), named in the docstring.
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import pytest
import torch

from distlab.bench import fsdp_options, step
from distlab.cli import parse
from distlab.config import TrainConfig
from distlab.results import read_result

ROOT = Path(__file__).resolve().parents[1]


def test_p6_fsdp_options_measures_each_options_device_peak_with_that_option_alone(monkeypatch, tmp_path):
    """P6: CUDA's peak of each FSDP2 option was taken with all six options resident, so every row carried the
    others' bytes. Here the device's peak reader is replaced (CUDA's needs a GPU): when it measures an option, that
    option is the only trainee alive, after one warm-up step, with what was allocated before it was built. GPU
    twin: ``tests/test_gpu.py::test_the_gpu_report_runs_every_part_that_should_and_says_so`` (offload's peak below
    the default's)."""
    seen = []  # one entry per measurement: keyed by id(), a trainee freed before the next is built can lend it its id

    def fake_measure(trainee, tokens, targets, runtime, warmup, resident_before):
        gc.collect()
        alive = [obj for obj in gc.get_objects() if issubclass(type(obj), step.Trainee)]
        seen.append((len(alive), warmup, resident_before))
        return [{"max_allocated": 1, "max_reserved": 2, "resident_before": resident_before}]

    peaks = step.DevicePeaks(fake_measure, lambda: 7, lambda: None)
    monkeypatch.setattr(fsdp_options, "device_peaks", lambda runtime: peaks)
    fsdp_options.main(["--model", "gpt-tiny", "--variants", "fsdp,offload,checkpointing", "--steps", "1",
                       "--warmup", "0", "--batch-size", "2", "--seq-len", "16", "--device", "cpu",
                       "--out", str(tmp_path), "--name", "options"])  # fmt: skip
    assert seen == [(1, 1, 7)] * 3, seen
    rows = read_result(tmp_path / "options.json")["metrics"]["variants"]
    assert [row["variant"] for row in rows] == ["fsdp", "offload", "checkpointing"]
    assert all(row["cuda_memory"] == [{"max_allocated": 1, "max_reserved": 2, "resident_before": 7}] for row in rows)


def test_p7_a_training_step_makes_no_tensor_from_a_python_number(monkeypatch):
    """P7: ``MetricSums.add`` built ``torch.tensor(<a Python float>, device=...)`` every micro-step: on a GPU a
    blocking copy and a stream synchronisation, so the host never ran ahead of the GPU and the pinned-memory and
    non_blocking comparisons measured a loop that waits every step. Here ``torch.tensor`` is refused while a step's
    metrics are added. GPU twin: ``tests/test_gpu.py::test_a_training_step_never_waits_for_the_gpu``."""
    from distlab import train

    sums = train.MetricSums(torch.device("cpu"))
    losses, correct = torch.rand(8), torch.rand(8) > 0.5

    def refuse(*args, **kwargs):
        raise AssertionError("torch.tensor from host data: a synchronising copy on a GPU")

    monkeypatch.setattr(torch, "tensor", refuse)
    sums.add(losses, correct)
    sums.add(losses, correct)
    monkeypatch.undo()
    assert sums.count == 16
    assert sums.loss == pytest.approx(losses.sum().item() / 8)


def notebook_code(name: str) -> str:
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    return "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")


def test_p1_the_offline_mnist_holds_a_batch_for_every_rank_of_every_labs_gpu_branch(tmp_path):
    """P1: the GPU tier and ``play_labs.py --offline-data`` wrote 96 training images, and the labs' GPU branch takes
    batches of 128 (512 for the DDP lab's large batch) on up to two ranks: every MNIST lab stopped at its first run.
    Here the files they write are read back with torchvision's MNIST, and every ``--batch-size`` (and ``BIG_BATCH``)
    the labs pass fills at least one step on each of two ranks."""
    from torchvision.datasets import MNIST

    from distlab.labs.offline import write_offline_mnist

    root = write_offline_mnist(tmp_path / "data")
    images = len(MNIST(str(root), train=True, download=False))
    sizes = set()
    for lab in ("lab0_first_run", "lab_ddp_mnist", "lab_fsdp"):
        code = notebook_code(lab)
        sizes |= {int(n) for n in re.findall(r'"--batch-size",\s*"(\d+)"', code)}
        sizes |= {int(n) for n in re.findall(r"--batch-size (\d+)", code)}
        sizes |= {int(n) for n in re.findall(r"BIG_BATCH = .*?(\d+)\s*(?:#.*)?$", code, re.M)}
    assert 512 in sizes and 128 in sizes, sizes  # the pattern still finds the labs' GPU batches
    ranks = 2  # Kaggle's pair, and two gloo ranks sharing one GPU
    assert all(images // ranks // size >= 1 for size in sizes), (images, sizes)


def test_p1_the_gpu_tier_and_play_labs_write_the_same_offline_mnist():
    """The GPU tier's labs and ``play_labs.py --offline-data`` write their stand-in MNIST with one function."""
    for path in ("tests/test_gpu_labs.py", "scripts/play_labs.py"):
        source = (ROOT / path).read_text()
        assert "write_offline_mnist(" in source and "write_tiny_mnist(" not in source, path


def test_p3_the_gpu_tier_trains_the_sharded_strategies_in_fp16_whatever_the_gpu_supports():
    """P3: the GPU tier picked bf16 wherever the GPU has it, so an H200 never ran GradScaler, ShardedGradScaler or
    fp16 FSDP2 with offload and clipping, the only half precision a T4 has. Its training cases now hold fp16 for
    zero2, zero3, fsdp, and fsdp with CPU offload and clipping, on one rank and on two ranks sharing a GPU."""
    import test_gpu

    fp16 = {case.id: case for case in test_gpu.TRAIN_CASES if "fp16" in case.args}
    wanted = {("zero2", False), ("zero3", False), ("fsdp", False), ("fsdp", True)}
    found = {(case.strategy, "--fsdp-cpu-offload" in case.args and "--max-grad-norm" in case.args)
             for case in fp16.values()}  # fmt: skip
    assert wanted <= found, found
    layouts = {(case_id, where) for case_id, where in test_gpu.TRAIN_SELECTION if case_id in fp16}
    for case_id in fp16:
        assert {(case_id, w) for w in test_gpu.LAYOUTS} <= layouts, case_id
    for case in fp16.values():  # every such command line parses with fp16 kept
        cfg = parse(TrainConfig, test_gpu.train_argv(case, test_gpu.layout("one NCCL rank", 1)[0]), "distlab.train")
        assert cfg.precision.dtype == "fp16"


def test_p2_the_quick_gpu_selection_runs_every_gpu_path_once():
    """P2: the GPU tier took 11-17 minutes on one GPU. Its quick selection (``-m "gpu and quick"``) holds every
    strategy at least once, the fp16 paths, the report, the FSDP2 point, every lab's first GPU launch, the grader on
    CUDA ranks, and the training loop's no-wait check."""
    import gpu_quick_estimate
    import test_gpu
    import test_gpu_labs
    from distlab.parallel import STRATEGIES

    for gpus in (1, 2):
        quick = {(case_id, where) for case_id, where, marks in test_gpu.train_params(gpus) if "quick" in marks}
        strategies = {test_gpu.CASES[case_id].strategy for case_id, _ in quick}
        covered = strategies | set(test_gpu.REPORT_SWEEP_STRATEGIES) | set(test_gpu.LAB_QUICK_STRATEGIES)
        assert covered >= set(STRATEGIES), (gpus, covered)
        assert any(where == "two gloo ranks share one GPU" for _, where in quick)
    assert sum(gpu_quick_estimate.quick_estimate_s(1).values()) <= 6 * 60  # seconds, each input measured on one H200
    assert {lab.stem for lab in test_gpu_labs.LABS} == set(test_gpu_labs.LAB_QUICK_STOP)


def load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"lab_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["fsdp_train", "ddp_train"])
def test_p4_the_lab_scripts_give_their_nccl_group_a_gloo_leg_and_take_fp16(script, monkeypatch):
    """P4: ``fsdp_train.py --cpu-offload`` in fp16 (the FSDP lab's offload row on Kaggle's T4s) all-reduces the
    scaler's overflow flag, a CPU tensor, on the group of its CPU-offloaded shards: on a plain NCCL group, "No
    backend type associated with device type cpu". Both lab scripts now create ``cpu:gloo,cuda:nccl`` bound to the
    rank's GPU (run here on a simulated GPU up to ``init_process_group``), and take ``--precision fp16`` so a GPU
    with bf16 can run a T4's path. GPU twin: ``tests/test_gpu.py::test_the_fsdp_lab_script_trains_in_fp16_with_cpu_
    offload`` (two NCCL ranks on two GPUs; two gloo ranks on one)."""
    module = load_script(script)
    asked = {}

    class Stop(Exception):
        pass

    def init_process_group(*args, **kwargs):
        asked.update(args=args, kwargs=kwargs)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(module.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--device", "cuda", "--backend", "nccl", "--precision", "fp16"])
    with pytest.raises(Stop):
        module.main()
    assert asked["args"] == ("cpu:gloo,cuda:nccl",)
    assert asked["kwargs"]["device_id"] == torch.device("cuda", 1)
    assert module.compute_dtype(torch.device("cuda", 1), "fp16") == torch.float16
    assert module.compute_dtype(torch.device("cpu"), "fp16") == torch.float32  # a CPU has no fast half precision


class FakeEvent:
    def __init__(self, name: str, on_gpu: bool, start: float = 0.0, elapsed: float = 1.0):
        from types import SimpleNamespace

        self.name = name
        self.device_type = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
        self.time_range = SimpleNamespace(start=start, elapsed_us=lambda: elapsed)


def test_p14_a_profiled_ddp_step_on_gloo_ranks_sharing_a_gpu_draws_glooss_all_reduce():
    """P14: on CUDA the DDP step's profile kept GPU kernels only, so with gloo ranks sharing one GPU (Colab, a
    one-GPU Kaggle kernel) its communication lane was empty by construction: gloo's all-reduce runs on CPU
    threads. It is now drawn there, beside the GPU's kernels on the compute lane."""
    from distlab.bench.ddp_step import profiled_interval
    from distlab.runtime import Runtime

    shared_gpu = Runtime(0, 0, 2, torch.device("cuda", 0), "gloo")
    nccl = Runtime(0, 0, 2, torch.device("cuda", 0), "nccl")
    lanes = lambda runtime, event: (profiled_interval(event, runtime) or {}).get("lane")  # noqa: E731
    assert lanes(shared_gpu, FakeEvent("gloo:all_reduce", on_gpu=False)) == "communication"
    assert lanes(shared_gpu, FakeEvent("void at::native::gemm_kernel", on_gpu=True)) == "compute"
    assert lanes(shared_gpu, FakeEvent("aten::addmm", on_gpu=False)) is None  # the host's view of a GPU op
    assert lanes(nccl, FakeEvent("ncclDevKernel_AllReduce_Sum_f32", on_gpu=True)) == "communication"


def test_p14_a_profile_with_no_gpu_kernel_is_an_empty_timeline_said_in_one_line(monkeypatch, capsys):
    """P14: where the profiler records no CUDA kernel (CUPTI blocked, as on some managed GPUs) the step profile took
    ``min()`` of nothing and failed the DDP lab's cell. It now returns an empty timeline and says why."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from distlab.bench import ddp_step
    from distlab.runtime import Runtime

    @contextmanager
    def cpu_events_only(activities):
        yield SimpleNamespace(events=lambda: [FakeEvent("forward", False), FakeEvent("gloo:all_reduce", False)])

    monkeypatch.setattr(ddp_step, "profile", cpu_events_only)
    monkeypatch.setattr(ddp_step, "synchronize", lambda device: None)
    monkeypatch.setattr(ddp_step.dist, "barrier", lambda: None)
    model, inputs = torch.nn.Linear(4, 3), torch.randn(2, 4)
    shared_gpu = Runtime(0, 0, 2, torch.device("cuda", 0), "gloo")
    assert ddp_step.profile_step(model, inputs, torch.tensor([0, 2]), shared_gpu) == []
    assert "profiler recorded no computation" in capsys.readouterr().out


def test_p12_the_gpu_requirements_pin_every_package_and_bring_no_torch():
    """P12: ``tests/gpu-requirements.txt`` left torchvision unpinned, so its own download line fetched the newest
    torchvision and the torch and CUDA wheels it pins (GBs), and an install would have replaced the image's torch.
    Every line is now pinned, and neither torch nor torchvision is among them (scripts/gpu_check.py installs the
    torchvision built for the torch that is there)."""
    lines = [line.strip() for line in (ROOT / "tests" / "gpu-requirements.txt").read_text().splitlines()]
    requirements = [line for line in lines if line and not line.startswith("#")]
    assert requirements and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", r) for r in requirements)
    names = {r.split("==")[0].lower().replace("_", "-") for r in requirements}
    assert not names & {"torch", "torchvision", "torchaudio", "triton"}, names
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    assert all(pins.get(r.split("==")[0].lower().replace("_", "-")) == r.split("==")[1] for r in requirements)


@pytest.mark.parametrize("torch_version, torchvision", [("2.10.0", "0.25"), ("2.11.0+cu130", "0.26"),
                                                        ("2.14.1", "0.29")])  # fmt: skip
def test_gpu_check_installs_the_torchvision_built_for_the_torch_there(torch_version, torchvision):
    gpu_check = load_script("gpu_check")
    assert gpu_check.torchvision_for(torch_version) == f"torchvision=={torchvision}.*"


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_2(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no CUDA GPU here" in done.stderr
    assert not (tmp_path / "out").exists()


def test_p5_the_full_reports_sweep_is_planned_with_its_builds():
    """P5: the full report's sweep planned its steps but not its builds: on one H200, gpt-mini, gpt-small and
    gpt-medium with the FSDP2 point build 11.9 billion values, about 240 s more than planned, and the part was to be
    stopped at 300 s. The plan now counts every build at the slowest rate measured on the H200's host (33 M values
    a second), leaves out the presets that do not fit, and stays under the part's limit."""
    from distlab.gpu_report.run import (
        BUILD_VALUES_PER_S,
        SWEEP_PREDICTED_S,
        SWEEP_TIMEOUT_S,
        Machine,
        build_seconds,
        planned_seconds,
        sweep_sizes,
    )  # fmt: skip

    for machine in (Machine(1, 150109880320, True, ["NVIDIA H200"]),
                    Machine(8, 85899345920, True, ["NVIDIA H100 80GB HBM3"] * 8)):  # fmt: skip
        sizes = sweep_sizes(machine)
        assert planned_seconds(sizes) <= SWEEP_PREDICTED_S < SWEEP_TIMEOUT_S
        counted = sum((2 * len(s.step_s) + 1 if not s.alone else len(s.step_s)) * sweep_parameters(s.model)
                      for s in sizes)  # fmt: skip
        assert build_seconds(sizes) == pytest.approx(counted / BUILD_VALUES_PER_S)
        assert build_seconds(sizes) > planned_seconds(sizes) / 2  # the builds are most of a sized sweep's time
        assert sizes[-1].alone  # the FSDP2 point still runs


def sweep_parameters(model: str) -> int:
    from distlab.bench.sweep import preset_parameters

    return preset_parameters(model)


def test_p8_an_nccl_job_on_gpus_without_peer_access_is_launched_with_nccls_transport_set(monkeypatch):
    """P8: the GPU report, ``labs.launch`` and the tier never set ``NCCL_P2P_DISABLE``/``NCCL_CUMEM_HOST_ENABLE``
    on GPUs without peer access (a T4 pair), where NCCL's cuMem host buffers fail with CUDA error 217. Every NCCL
    job ``labs.launch.torchrun`` starts on such a machine now gets both (a gloo job, which has no NCCL, does not).
    Every other launcher (``run_torchrun``, the grader's forked ranks, a learner's ``check(..., device="cuda")``) is
    covered where its NCCL ranks start, in ``runtime.distributed``: the ``test_t2_*`` tests below."""
    from distlab.labs import launch
    from distlab.runtime import Placement

    t4_pair = {"gpus": ["Tesla T4"] * 2, "peer_access": [[None, False], [False, None]], "dev_shm": None}
    monkeypatch.setattr(launch, "survey", lambda topology=True: dict(t4_pair))
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("NCCL_CUMEM_HOST_ENABLE", raising=False)
    started = {}

    class Stop(Exception):
        pass

    def popen(command, env, **kwargs):
        started["env"] = env
        raise Stop

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    for backend, expected in (("nccl", {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_HOST_ENABLE": "0"}), ("gloo", {})):
        placement = Placement(2, "cuda", backend, 2, "test")
        with pytest.raises(Stop):
            launch.torchrun("job.py", placement=placement, echo=False)
        got = {k: v for k, v in started["env"].items() if k in ("NCCL_P2P_DISABLE", "NCCL_CUMEM_HOST_ENABLE")}
        assert got == expected, backend
    import os

    assert "NCCL_P2P_DISABLE" not in os.environ  # the job's environment, not the caller's


def test_p15_a_step_benchmark_keeps_rank_0s_memory_timeline_only(tmp_path):
    """P15: fsdp-options kept every rank's memory timeline for every option, about 0.9 MB a rank on gpt-small, so
    an 8-rank report neared its 8 MiB file cap. Only rank 0's is kept (the one every page draws)."""
    from distlab.testing import run_torchrun

    done = run_torchrun(2, "distlab.bench.fsdp_options", "--model", "gpt-tiny", "--variants", "fsdp", "--steps",
                        "1", "--warmup", "0", "--batch-size", "2", "--seq-len", "16", "--device", "cpu",
                        "--out", str(tmp_path), "--name", "options")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = read_result(tmp_path / "options.json")["metrics"]["variants"]
    ranks = row["memory"]["ranks"]
    assert "timeline" in ranks[0] and all("timeline" not in rank for rank in ranks[1:])
    assert all(rank["activations_peak"] > 0 for rank in ranks)


def test_p16_fsdp2_on_gloo_ranks_sharing_a_gpu_meshes_the_default_group_itself(monkeypatch):
    """P16: on a torch whose DeviceMesh builds a new ``cpu:gloo,cuda:nccl`` group for a 1-D mesh over a gloo
    default group, FSDP2 on two gloo ranks sharing one GPU would put two NCCL ranks on that GPU. The mesh is now
    the default group itself wherever gloo ranks run on CUDA (the library and the FSDP lab's script)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from distlab.parallel.fsdp2 import FSDP2
    from distlab.runtime import Runtime

    seen = []
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda group, device_type: seen.append(
        (group, device_type)) or "mesh"))  # fmt: skip
    shared = Runtime(1, 1, 2, torch.device("cuda", 0), "gloo")
    assert FSDP2().device_mesh(shared) == "mesh"
    assert seen == [(dist.group.WORLD, "cuda")]
    script = (ROOT / "scripts" / "fsdp_train.py").read_text()
    assert 'DeviceMesh.from_group(dist.group.WORLD, "cuda")' in script
