"""Where a job runs, decided once: runtime.place for machines of 0, 1, 2, 4 and 8 GPUs, simulated on the CPU.

The launcher decides with ``place`` and hands its ranks ``--device``/``--backend``; each rank places itself from
those with the same function and must get the same answer. A CUDA group carries a gloo leg, so a CPU tensor in
a collective is legal on every run; the tests follow the GPU path up to the call that needs a GPU.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch

from distlab import errors, runtime
from distlab.comm.traffic import TrafficCounter
from distlab.errors import DistlabError
from distlab.exercises import grader
from distlab.exercises.catalog import all_exercises
from distlab.parallel import STRATEGIES
from distlab.runtime import Placement, Runtime, place

GPUS = (0, 1, 2, 4, 8)
RANKS = (None, 1, 2, 4)
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
POLICIES = ("share", "cpu", "shrink", "refuse")


def _placements():
    for gpus, ranks, device, backend, policy in product(GPUS, RANKS, DEVICES, BACKENDS, POLICIES):
        try:
            yield (gpus, ranks, device, backend, policy), place(ranks, device, backend, gpus=gpus, short_of_gpus=policy)
        except DistlabError as err:
            yield (gpus, ranks, device, backend, policy), err


PLACEMENTS = list(_placements())


def test_every_answer_is_a_placement_that_can_run_or_one_line_that_says_what_to_do():
    for (gpus, ranks, device, backend, _), answer in PLACEMENTS:
        if isinstance(answer, DistlabError):
            assert "\n" not in str(answer) and len(str(answer)) < 200, str(answer)
            continue
        assert answer.ranks >= 1
        if answer.device == "cuda":
            assert gpus >= 1
        if answer.backend == "nccl":
            assert answer.device == "cuda" and answer.ranks <= gpus, (gpus, ranks, device, backend, answer)
        if ranks is not None and answer.ranks != ranks:
            assert answer.ranks == gpus and answer.backend == "nccl"  # only "shrink" changes the count
        if device != "auto":
            assert answer.device == device
        if backend != "auto":
            assert answer.backend == backend
        assert answer.reason


def test_what_is_refused_is_what_cannot_run():
    refused = {key for key, answer in PLACEMENTS if isinstance(answer, DistlabError)}
    for gpus, ranks, device, backend, policy in refused:
        cuda_without_gpu = device == "cuda" and gpus == 0
        nccl_on_cpu = backend == "nccl" and (device == "cpu" or gpus == 0)
        nccl_short = backend == "nccl" and (ranks or gpus) > gpus and not (policy == "shrink" and gpus >= 2)
        told_to_refuse = policy == "refuse" and backend == "auto" and device != "cpu" and (ranks or gpus) > gpus
        assert cuda_without_gpu or nccl_on_cpu or nccl_short or told_to_refuse, (gpus, ranks, device, backend, policy)


def test_no_gpu_sits_idle_while_auto_runs_on_the_cpu():
    for (gpus, ranks, device, backend, policy), answer in PLACEMENTS:
        # "cpu", and "shrink" on one GPU, choose the CPU on purpose (the grader: its exercises need NCCL on GPUs)
        if isinstance(answer, Placement) and gpus and device == "auto" and policy in ("share", "refuse"):
            assert answer.device == "cuda", (gpus, ranks, backend, policy, answer)


def test_each_rank_told_the_launchers_answer_places_itself_the_same_way():
    for (gpus, *_), answer in PLACEMENTS:
        if isinstance(answer, Placement):
            again = runtime.rank_placement(answer.device, answer.backend, answer.ranks, gpus=gpus)
            assert (again.ranks, again.device, again.backend) == (answer.ranks, answer.device, answer.backend)
            devices = {runtime.rank_device(again, r) for r in range(answer.ranks)}
            if answer.backend == "nccl":
                assert len(devices) == answer.ranks  # one GPU each
            if answer.device == "cuda":
                assert all(d.index < gpus for d in devices)  # never a GPU that does not exist


@pytest.mark.parametrize(
    "gpus, ranks, expected",
    [
        (0, 2, (2, "cpu", "gloo")),
        (1, 1, (1, "cuda", "nccl")),
        (1, 2, (2, "cuda", "gloo")),  # Colab, Kaggle's P100: two gloo ranks share the GPU
        (2, 2, (2, "cuda", "nccl")),  # Kaggle's T4 x2
        (2, None, (2, "cuda", "nccl")),
        (8, None, (8, "cuda", "nccl")),
        (4, 2, (2, "cuda", "nccl")),
        (0, None, (runtime.CPU_RANKS, "cpu", "gloo")),
    ],
)
def test_the_answers_a_learner_meets(gpus, ranks, expected):
    answer = place(ranks, gpus=gpus)
    assert (answer.ranks, answer.device, answer.backend) == expected
    assert answer.args == ("--device", expected[1], "--backend", expected[2])


def test_one_gpu_two_ranks_is_one_answer_said_in_one_line():
    answer = place(2, gpus=1)
    assert answer.shares_gpus and [answer.gpu_of(r) for r in range(2)] == [0, 0]
    assert "share" in answer.reason and "\n" not in answer.reason
    with pytest.raises(DistlabError, match="NCCL needs one GPU per rank"):
        place(2, backend="nccl", gpus=1)


@pytest.mark.parametrize("gpus", GPUS)
def test_the_grader_places_every_exercise_with_place(monkeypatch, gpus):
    monkeypatch.setattr(runtime, "gpu_count", lambda: gpus)
    for exercise in all_exercises().values():
        answer = grader._placement(exercise, None, "auto")
        # never fewer ranks than the exercise's: on two, a ring's wrong neighbour and torch.chunk's cut both pass
        assert answer.ranks == exercise.ranks
        if answer.device == "cuda":
            assert answer.backend == "nccl" and answer.ranks <= gpus  # CUDA tensors go point to point: NCCL
        assert (answer.device == "cuda") == (gpus >= exercise.ranks)


def test_bookkeeping_tensors_go_where_the_group_carries_them():
    cuda = torch.device("cuda", 0)
    assert Runtime(0, 0, 2, cuda, "nccl").collective_device == cuda
    assert Runtime(0, 0, 2, cuda, "gloo").collective_device == torch.device("cpu")  # gloo moves host memory
    assert Runtime(0, 0, 1, torch.device("cpu"), "gloo").reduce([1.5, 2.0], "max") == [1.5, 2.0]


def _reduced(rt):
    return {op: rt.reduce([rt.rank + 1.0, -rt.rank], op) for op in ("sum", "max", "min", "mean")}


def test_runtime_reduce_combines_every_ranks_numbers(ranks3):
    got = ranks3.run(_reduced)
    assert got[0] == got[2] == {"sum": [6.0, -3.0], "max": [3.0, 0.0], "min": [1.0, -2.0], "mean": [2.0, -1.0]}


def _slowest_median(rt):
    from distlab.train import TrainResult, TrainState, slowest_median_step_s

    state = TrainState()
    state.step_times_s = [9.0, 9.0, 9.0] + [0.1 * (rt.rank + 1)] * 3
    return slowest_median_step_s(TrainResult(None, state, 0, {}), rt)


def test_the_slowest_ranks_median_step_is_reduced_with_runtime_reduce(ranks2):
    assert ranks2.run(_slowest_median) == [pytest.approx(0.2)] * 2


def test_a_cpu_tensor_on_an_nccl_only_group_is_told_in_one_line(capsys):
    def main(argv):
        raise RuntimeError("No backend type associated with device type cpu")

    with pytest.raises(SystemExit) as stopped:
        errors.run_main(main)
    assert stopped.value.code == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "cpu:gloo,cuda:nccl" in said[0]


def test_traffic_is_counted_by_the_device_its_tensors_are_on():
    counter = TrafficCounter(2)
    counter.__torch_dispatch__(_FakeOp("allreduce_"), (), ([torch.zeros(4)],))
    assert dict(counter.bytes_by_device) == {"cpu": 16.0}


class _FakeOp:
    namespace = "c10d"

    def __init__(self, name):
        self._opname = name

    def __call__(self, *args, **kwargs):
        return None


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_keeps_its_parameters_on_the_ranks_device(name):
    cuda = Runtime(0, 0, 2, torch.device("cuda", 0), "nccl")
    assert STRATEGIES[name]().parameter_device(cuda) == cuda.device
