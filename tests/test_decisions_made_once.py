"""Decisions made once, in the right scope: the sweep's presets the same on every rank, the launcher's placement
told to its ranks, each rank's own CUDA generator, one forkserver and preload list, a lab report's ranks. Each
test fails on the code of b92fcb6, which made the decision twice or in the wrong place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distlab.testing import run_ranks


def _presets_planned_by(runtime, argv: list[str]):
    from distlab.bench import sweep
    from distlab.cli import parse

    # one rank reads almost nothing free, its peer plenty (each rank reads /proc/meminfo at its own moment)
    sweep.available_bytes = lambda: [1, 2**50][runtime.rank]
    fits, skipped, _ = sweep.planned_presets(parse(sweep.SweepConfig, argv), runtime)
    return fits, skipped


def test_a2_every_rank_of_the_sweep_selects_the_same_presets_whatever_memory_it_reads(tmp_path):
    """A2: each rank of the sweep judged which presets fit by its own free memory, and what fits selects the
    collectives every rank then calls: ranks on either side of the line would wait for each other forever. The
    memory judged is now the smallest over the ranks, the same on each, so both ranks select the same presets.
    Fresh ranks: the test patches a module, which the pool refuses."""
    planned = run_ranks(_presets_planned_by, 2, tmp_path, ["--models", "gpt-tiny,gpt-mini"])
    assert planned[0] == planned[1], f"rank 0 selected {planned[0]}, rank 1 {planned[1]}"
    assert planned[0] == ([], ["gpt-tiny", "gpt-mini"]), "the smallest free memory, one byte, fits nothing"


def test_a3_the_launcher_decides_where_ranks_run_and_tells_them(monkeypatch):
    """A3: ``labs.launch.torchrun`` did not place: a page that launched two ranks without ``--device`` left each
    rank to decide again (refused on one GPU; another result file on two). It now places (``place(nproc)``, or the
    placement given), tells an entry point that takes ``--device``/``--backend``, and starts the placement's ranks;
    a caller that said where keeps its flags, and a script is told nothing it cannot parse."""
    from distlab.labs import launch
    from distlab.runtime import Placement

    started = []

    class Stop(Exception):
        pass

    def popen(command, env, **kwargs):
        started.append(command)
        raise Stop

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(launch, "place", lambda nproc: Placement(nproc, "cuda", "gloo", 1, "two share one GPU"))
    cases = [
        (("distlab.bench.ddp_step", "--steps", "2"), {"nproc": 2}, ["--steps", "2", "--device", "cuda", "--backend",
                                                                    "gloo"], 2),
        (("distlab.bench.ddp_step", "--device", "cpu"), {"nproc": 2}, ["--device", "cpu"], 2),
        (("job.py", "--x", "1"), {"nproc": 3}, ["--x", "1"], 3),
        (("distlab.bench.ddp_step",), {"placement": Placement(4, "cpu", "gloo", 0, "cpu")},
         ["--device", "cpu", "--backend", "gloo"], 4),
    ]  # fmt: skip
    for args, kwargs, told, ranks in cases:
        with pytest.raises(Stop):
            launch.torchrun(*args, echo=False, **kwargs)
        command = started[-1]
        assert f"--nproc_per_node={ranks}" in command, command
        assert command[command.index(args[0]) + 1 :] == told, command


def test_a4_a_cpu_run_reads_no_cuda_generator_and_a_gpu_rank_saves_its_own_only(monkeypatch):
    """A4: every checkpoint saved every visible GPU's generator (the machine's, not the run's): a CPU run on a GPU
    machine started CUDA at each checkpoint, and a GPU checkpoint resumed on fewer GPUs failed with IndexError.
    A rank now saves its own GPU's generator only, on a GPU run only."""
    from distlab.train import TrainState

    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU run read a CUDA generator")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", no_cuda)
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_cuda)
    assert TrainState().state_dict(torch.device("cpu"))["cuda_rng"] == []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.tensor([device.index], dtype=torch.uint8))
    saved = TrainState().state_dict(torch.device("cuda", 1))
    assert [t.tolist() for t in saved["cuda_rng"]] == [[1]]


@pytest.mark.parametrize(
    "saved, device, expected",
    [(8, torch.device("cuda", 1), [1]), (1, torch.device("cuda", 0), [0]), (8, torch.device("cpu"), []),
     (1, torch.device("cpu"), [])],
    ids=["an-older-checkpoint-of-8-gpus-on-gpu-1", "this-ranks-own", "on-the-cpu", "its-own-on-the-cpu"],
)  # fmt: skip
def test_a4_a_resumed_rank_restores_its_own_gpus_generator_whatever_the_gpus_saved(monkeypatch, saved, device,
                                                                                    expected):  # fmt: skip
    from distlab.train import TrainState

    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append(int(state[0])))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append("every GPU's"))
    state = TrainState().state_dict()
    state["cuda_rng"] = [torch.tensor([i], dtype=torch.uint8) for i in range(saved)]
    TrainState().load_state_dict(state, device)
    assert restored == expected


def test_a12_a_labs_report_is_labelled_with_the_ranks_its_runs_ran_on(monkeypatch, tmp_path):
    """A12: a lab's report labelled its ranks by deciding the placement again (one rank per GPU), not what the lab
    ran: on one GPU it said 1 for runs made on 2 ranks sharing it. The ranks now come from the result files."""
    from distlab.gpu_report import lab
    from distlab.gpu_report.run import Machine
    from distlab.results import read_result

    results = tmp_path / "results"
    results.mkdir()
    book_results = Path(__file__).resolve().parents[1] / "book" / "results" / "ddp"
    committed = next(p for p in sorted(book_results.glob("*.json")) if read_result(p)["environment"]["world_size"] == 2)
    (results / committed.name).write_text(committed.read_text())
    (results / "hardware.json").write_text(json.dumps({"gpus": ["NVIDIA H200"]}))  # not a result: left out
    monkeypatch.setattr(Machine, "here", classmethod(lambda cls: Machine(1, 150109880320, True, ["NVIDIA H200"])))
    written = {}
    monkeypatch.setattr(lab, "finish", lambda folder, machine, report: written.update(report) or folder)
    folder = lab.report_from_results(results, "lab_ddp_mnist", out=tmp_path / "reports")
    assert written["ranks"] == 2 and written["parts"][0]["ranks"] == 2
    assert folder.name.startswith("nvidia-h200-2x-")


def _where_this_rank_came_from(runtime):
    import os
    import sys

    from distlab import jobs

    return os.getppid(), [name for name in jobs.PRELOAD if name not in sys.modules]


def test_a5_every_rank_started_here_comes_from_one_server_with_one_preload_list(ranks2, tmp_path, monkeypatch):
    """A5: the tests' ranks and the grader's each set the forkserver's preload list, two lists for one server, and
    the first to start it won (the grader's ranks then imported torch._dynamo after the fork). Now the ranks of
    run_ranks, of the pool and of the grader are all children of one server, and each finds every module of
    jobs.PRELOAD imported before it ran a line of its own."""
    import multiprocessing.context
    import multiprocessing.forkserver

    from distlab import jobs
    from distlab.exercises import grader
    from distlab.exercises.catalog import get

    grader_ranks = []
    started = multiprocessing.context.ForkServerProcess.start

    def start_and_record_the_parent(process):
        started(process)
        grader_ranks.append(int(jobs._stat_fields(process.pid)[1]))

    with monkeypatch.context() as patched:
        patched.setattr(multiprocessing.context.ForkServerProcess, "start", start_and_record_the_parent)
        assert grader.grade("ring_reduce_scatter", get("ring_reduce_scatter").solution_function()).passed
    assert grader_ranks, "the grader started its ranks from the forkserver"
    fresh = run_ranks(_where_this_rank_came_from, 2, tmp_path)
    pooled = ranks2.run(_where_this_rank_came_from)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert {parent for parent, _ in fresh + pooled} | set(grader_ranks) == {server}, "one server for every rank"
    assert [missing for _, missing in fresh + pooled] == [[]] * 4, "each rank was forked with jobs.PRELOAD loaded"


def test_a6_the_process_runner_is_named_for_what_it_is_apart_from_the_test_fixtures():
    """A6: testing.py held the production process runner, which labs.launch re-exported private names of. The
    runner is distlab.jobs; testing keeps what only tests use (the rank pool, fresh ranks, run_entry, the toy models
    only tests train), and no module of the library imports it (tests/test_layout.py)."""
    from distlab import testing
    from distlab.labs import launch

    for name in ("run_job", "stop_job", "failure_reason", "torchrun_command", "launcher_environment"):
        assert getattr(launch, name).__module__ == "distlab.jobs", name
    source = Path(testing.__file__).read_text()
    assert "def stop_job" not in source and "def reason_from_lines" not in source and "TCPStore" not in source
