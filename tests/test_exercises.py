"""The exercises: every solution passes its own check on real gloo ranks; every typical wrong answer
(tests/mistakes_<chapter>.py) fails with the mistake it makes named; what a learner can get wrong around the
check itself (a stub, a lambda, an exception, a deadlock, a dead rank) is answered in words, bounded in time."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.exercises import grade
from distlab.exercises.catalog import CHAPTERS, all_exercises, get
from distlab.exercises.solutions import ring as ring_solutions

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = all_exercises()
MISTAKES = [case for chapter in CHAPTERS for case in importlib.import_module(f"mistakes_{chapter}").MISTAKES]
STUCK_TIMEOUT_S = 4.0  # a wrong answer that deadlocks is stopped after this long


def test_there_are_at_least_fifteen_exercises_across_the_book():
    assert len(EXERCISES) >= 15, sorted(EXERCISES)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_solution_passes_its_check(name):
    verdict = grade(name, get(name).solution_function())
    assert verdict.passed, verdict.message
    assert verdict.message.startswith(f"✓ {name}")


DEADLOCKS = {"all_send_first", "wrong_peer"}
"""Mistakes whose ranks wait on each other: the grader names them only once STUCK_TIMEOUT_S has expired, so their
grading waits and sits in the slow tier (CONTRIBUTING: a timeout that must expire), which CI runs on every change."""


@pytest.mark.parametrize(
    "exercise, wrong, mistake, says",
    [pytest.param(*case, marks=pytest.mark.slow) if case[2] in DEADLOCKS else case for case in MISTAKES],
    ids=[f"{e}-{w.__name__}" for e, w, _, _ in MISTAKES],
)
def test_a_typical_mistake_fails_with_its_name(exercise, wrong, mistake, says):
    verdict = grade(exercise, wrong, timeout_s=STUCK_TIMEOUT_S)
    assert not verdict.passed, f"{wrong.__name__} passed"
    assert verdict.mistake == mistake, verdict.message
    assert says in verdict.message, verdict.message
    assert "Traceback" not in verdict.message and "torch/" not in verdict.message, verdict.message
    known = {**_common(), **get(exercise).mistakes}  # as the grader reads them: the exercise's own first
    assert known[mistake].split(".")[0] in verdict.message  # the hint is shown, not only the name


def _common() -> dict:
    from distlab.exercises.verdict import COMMON_MISTAKES

    return COMMON_MISTAKES


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_exercise_has_two_typical_mistakes_named(name):
    named = {mistake for exercise, _, mistake, _ in MISTAKES if exercise == name}
    assert len(named) >= 2, f"{name}: typical mistakes tested: {sorted(named)}"


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_exercise_ends_its_pages_with_stub_check_and_solution(name):
    exercise = get(name)
    solution_module, _, solution_name = exercise.solution.rpartition(".")
    for page in (exercise.page, *exercise.pages):
        path = ROOT / "book" / f"{page}.md"
        if path.exists():
            text = path.read_text()
        else:
            cells = json.loads((ROOT / "notebooks" / f"{page.split('/')[-1]}.ipynb").read_text())["cells"]
            text = "\n".join("".join(cell["source"]) for cell in cells)
            solution = inspect.getsource(exercise.solution_function()).rstrip()
            assert "<details><summary>Solution" in text and solution in text, f"{page}: not the solution of {name}"
        assert exercise.signature in text, f"{page}: no stub for {name}"
        assert f'check("{name}", ' in text, f'{page}: no check("{name}", ...) cell'
        if path.exists():
            include = rf"solutions/{solution_module}\.py\n(:[^\n]*\n)*:pyobject: {solution_name}\n"
            assert re.search(include, text), f"{page}: the solution of {name} is not literalincluded"
            assert f'solutions_pass("{page}")' in text, f"{page}: the build does not grade its solutions"


def test_a_stub_is_told_what_to_write_without_starting_ranks():
    def ring_reduce_scatter(tensor):
        """Your code here."""
        ...

    verdict = grade("ring_reduce_scatter", ring_reduce_scatter)
    assert verdict.status == "not_filled" and "still the empty stub" in verdict.message
    assert get("ring_reduce_scatter").task in verdict.message


def raises_not_implemented(tensor):
    rank = dist.get_rank()
    raise NotImplementedError(f"rank {rank}")


def raises_its_own_error(tensor):
    n = dist.get_world_size()
    return tensor[n * 1000]


def only_rank_zero_reduces(tensor):
    if dist.get_rank() == 0:
        dist.all_reduce(tensor)
    return tensor


def rank_one_dies(tensor):
    import os

    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(tensor)
    return tensor


def test_a_started_stub_that_raises_not_implemented_is_a_stub():
    verdict = grade("ring_reduce_scatter", raises_not_implemented)
    assert verdict.status == "not_filled", verdict.message


def test_an_exception_names_the_rank_and_the_learners_line_not_torch():
    verdict = grade("ring_reduce_scatter", raises_its_own_error)
    assert verdict.status == "raised", verdict.message
    assert re.search(r"rank \d raised IndexError at line \d+ of your `raises_its_own_error`", verdict.message)
    assert "return tensor[n * 1000]" in verdict.message and "Traceback" not in verdict.message


def test_a_collective_only_some_ranks_call_ends_in_time_and_says_so():
    verdict = grade("ring_all_reduce", only_rank_zero_reduces, timeout_s=STUCK_TIMEOUT_S)
    assert verdict.status == "stuck" and verdict.mistake == "collective_mismatch", verdict.message
    assert "rank 0: all_reduce x1" in verdict.message and "rank 1: none" in verdict.message
    # ranks 1 and 2 returned and stopped at their wrong answer; rank 0's all-reduce failed as they left, at once
    assert "never finished" not in verdict.message, verdict.message
    assert float(re.search(r"ended after (\d+\.\d) s", verdict.message)[1]) < STUCK_TIMEOUT_S, verdict.message
    assert "rank 0 waited in all_reduce" in verdict.message, verdict.message
    assert "rank 1 did not wait: your function returned, and its tensor was wrong" in verdict.message


@pytest.mark.slow
def test_ranks_that_cannot_meet_say_why_in_one_line(monkeypatch):
    from contextlib import contextmanager

    from distlab.exercises import grader
    from distlab.jobs import free_port

    @contextmanager
    def nobody_serves():  # the ranks are told of a store that no process hosts
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    monkeypatch.setattr(grader, "hosted_rendezvous", nobody_serves)
    monkeypatch.setattr(grader, "MEETING_S", 3.0)  # how long each rank tries to join before it says so
    verdict = grade("global_mean", get("global_mean").solution_function(), timeout_s=2)
    assert verdict.status == "grader" and "the ranks did not start (ranks 0, 1, 2: " in verdict.message, verdict.message
    assert "run this check again" in verdict.message and "exit codes" not in verdict.message, verdict.message
    assert len(verdict.message.splitlines()) == 1, verdict.message
    # ranks still trying to join when the check's start-up time is over are stopped, and it says so
    monkeypatch.setattr(grader, "MEETING_S", 60.0)
    monkeypatch.setattr(grader, "STARTUP_S", 3.0)
    verdict = grade("global_mean", get("global_mean").solution_function(), timeout_s=2)
    assert "the ranks did not start (none had joined the group after 3 s" in verdict.message, verdict.message


def overlap_waits_on_futures(model):
    pending = []

    def launch(p):
        p.grad /= dist.get_world_size()
        pending.append(dist.all_reduce(p.grad, async_op=True).get_future())

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        torch.futures.wait_all(pending)
        pending.clear()

    return finish


def test_an_overlap_that_waits_on_the_handles_futures_passes():
    verdict = grade("overlap_gradients", overlap_waits_on_futures)
    assert verdict.passed, verdict.message


def test_a_rank_that_dies_is_reported_in_one_answer():
    verdict = grade("ring_all_reduce", rank_one_dies, timeout_s=STUCK_TIMEOUT_S)
    assert not verdict.passed
    assert "rank 1" in verdict.message and "Traceback" not in verdict.message, verdict.message


GLOBAL_TENSOR = torch.ones(3)
SCALE = 2


def uses_a_global_tensor(tensor):
    return tensor + GLOBAL_TENSOR


def doubled(tensor):
    return ring_solutions.ring_reduce_scatter(tensor * SCALE) / SCALE


def test_what_the_function_names_travels_or_is_refused_in_one_line():
    verdict = grade("ring_reduce_scatter", uses_a_global_tensor)
    assert verdict.status == "refused" and "`GLOBAL_TENSOR` (a Tensor)" in verdict.message
    assert grade("ring_reduce_scatter", lambda t: t).status == "refused"
    assert grade("no_such_exercise", doubled).status == "refused"
    # a module, a plain constant and an imported library module travel with the function
    assert grade("ring_reduce_scatter", doubled).passed


def test_more_ranks_than_the_default_on_the_cpu():
    verdict = grade("ring_all_reduce", ring_solutions.ring_all_reduce, ranks=4, device="cpu")
    assert verdict.passed and "4 gloo ranks" in verdict.message, verdict.message


def prints_and_is_wrong(tensor):
    print(f"rank {dist.get_rank()} starts with {tensor.tolist()[:2]}")
    return tensor


def test_what_the_learners_function_prints_comes_back_with_the_answer():
    verdict = grade("ring_reduce_scatter", prints_and_is_wrong)
    assert verdict.status == "wrong", verdict.message
    assert "rank 1 printed:\n    rank 1 starts with" in verdict.message


def test_check_prints_the_answer_folded_for_a_notebook(capsys):
    from distlab.exercises import check

    def ring_all_reduce(tensor):
        raise NotImplementedError

    check("ring_all_reduce", ring_all_reduce)
    printed = capsys.readouterr().out
    assert printed.startswith("✎ ring_all_reduce") and max(map(len, printed.splitlines())) <= 100
