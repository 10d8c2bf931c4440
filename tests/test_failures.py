"""When things go wrong, the job says so: collectives that never match end at the timeout with a line per
rank (``distlab.demos.failures`` on 2 gloo ranks), and every row of the bad-input table ends in one line, a
non-zero exit and nothing left behind (``distlab.demos.bad_inputs``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from distlab.demos.bad_inputs import BAD_INPUTS, try_rows
from distlab.errors import collective_failure, torch_says
from distlab.labs.launch import launcher_environment, run_job, torchrun_command
from distlab.results import read_result

pytestmark = pytest.mark.slow

TIMEOUT_S = 3
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 3000ms for recv operation to complete"
)


def test_gloo_failures_raised_as_plain_runtime_errors_are_recognised():
    # torch 2.14+ raises gloo's timeout as a RuntimeError, not a DistError: recognised by what it says
    assert collective_failure(RuntimeError(GLOO_TIMEOUT)) == "timeout"
    assert torch_says(RuntimeError(GLOO_TIMEOUT)) == "Timed out waiting 3000ms for recv operation to complete"
    closed = "[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:28558. This is typically"
    assert collective_failure(RuntimeError(closed)) == "peer" and torch_says(RuntimeError(closed)) == (
        "Connection closed by peer"
    )
    closed_after_timeout = RuntimeError("Application timeout caused pair closure")
    assert collective_failure(closed_after_timeout) == "timeout"
    assert torch_says(closed_after_timeout) == "a peer timed out and closed the connection"
    assert collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert collective_failure(ValueError("Timed out waiting")) is None


def _case(case: str, detail: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    env = launcher_environment(1)
    if detail:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    command = torchrun_command(
        2, "distlab.demos.failures", "--case", case, "--timeout-s", str(TIMEOUT_S), "--device", "cpu"
    )
    started = time.monotonic()
    done = run_job(command, timeout=120, env=env)
    return done, time.monotonic() - started


@pytest.fixture(scope="module")
def cases() -> dict:
    """The cases, three at a time (their ranks mostly wait for the timeout)."""
    wanted = {case: (case, False) for case in ("skip", "shape", "eval-rank0", "eval-rank0-ddp")}
    wanted["mismatch-detail"] = ("mismatch", True)
    with ThreadPoolExecutor(3) as pool:
        return dict(zip(wanted, pool.map(lambda args: _case(*args), wanted.values())))


def _lines(done: subprocess.CompletedProcess, start: str) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith(start)]


def test_a_skipped_collective_pairs_silently_then_ends_at_the_timeout_one_line_per_rank(cases):
    done, _ = cases["skip"]  # bounded by the timeout: run() would raise after 120 s
    assert done.returncode != 0, done.stderr[-3000:]
    # rank 1's step-3 all-reduce met rank 0's step 2: a wrong sum, and no error yet
    assert "step 2: the all-reduce gave 5 on rank 0 (every rank's 2: 4)" in done.stdout, done.stdout
    (rank0,), (rank1,) = _lines(done, "distlab: rank 0 "), _lines(done, "distlab: rank 1 ")
    assert rank0.startswith("distlab: rank 0 stopped in all_reduce() at failures.py:"), rank0
    assert rank1.startswith("distlab: rank 1 stopped in barrier() at failures.py:"), rank1
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in rank0 + rank1
    (error,) = _lines(done, "distlab: error:")
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in error
    assert "Traceback" not in done.stderr.split(error)[0], "the ranks end in their lines (torchrun's report follows)"


def test_detail_names_the_two_different_collectives_before_any_waits(cases):
    done, _ = cases["mismatch-detail"]
    (rank0,), (rank1,) = _lines(done, "distlab: rank 0 "), _lines(done, "distlab: rank 1 ")
    assert "all_reduce() at failures.py" in rank0 and "broadcast() at failures.py" in rank1
    assert "rank 0 is in ALLREDUCE [4] #1, rank 1 in BROADCAST [4] #1" in rank0, rank0
    assert "rank 1 is in BROADCAST [4] #1, rank 0 in ALLREDUCE [4] #1" in rank1, rank1
    assert "Timed out" not in done.stderr, "DETAIL compares the calls first: nothing waits for the timeout"


def test_a_different_shape_aborts_the_rank_gloo_catches_it_on_and_the_other_says_where(cases):
    done, _ = cases["shape"]
    assert done.returncode != 0
    assert "Received data size doesn't match expected size" in done.stderr  # gloo's own words, then SIGABRT
    lines = _lines(done, "distlab: rank ")
    assert len(lines) == 1 and "stopped in all_reduce() at failures.py" in lines[0], lines


STOPPED_WHILE_FAILING = """
import os, signal, sys, time
from distlab.errors import run_main

def main(argv):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun stops this rank: another one has just failed
    time.sleep(float(sys.argv[1]))  # this rank's own collective is still on its way to failing
    raise RuntimeError("[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:28558")

run_main(main)
"""


@pytest.mark.parametrize("failing_after_s, status, says", [(0.3, 3, True), (30, 143, False)])
def test_a_rank_torchrun_stops_says_where_it_was_if_it_can_within_the_grace(failing_after_s, status, says):
    # SIGTERM's default would end the rank at once, often before its failing collective returns; run_main
    # gives it SIGTERM_GRACE_S to say where it was, and ends one that stays blocked as SIGTERM would have
    started = time.monotonic()
    env = {**os.environ, "RANK": "1"}
    done = subprocess.run(
        [sys.executable, "-c", STOPPED_WHILE_FAILING, str(failing_after_s)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == status, done.stderr[-2000:]
    assert ("distlab: rank 1 stopped in" in done.stderr) == says, done.stderr[-2000:]
    assert time.monotonic() - started < 20  # the blocked one did not wait out its 30 s


def test_evaluating_on_rank_0_only_under_fsdp_ends_at_the_timeout(cases):
    done, _ = cases["eval-rank0"]
    assert done.returncode != 0
    (rank0,), (rank1,) = _lines(done, "distlab: rank 0 "), _lines(done, "distlab: rank 1 ")
    assert "stopped in evaluation's forward (FSDP all-gathers" in rank0, rank0
    assert "stopped in the barrier after evaluation" in rank1, rank1
    (error,) = _lines(done, "distlab: error:")
    assert "every rank must run evaluation's forward" in error


def test_evaluating_on_rank_0_only_under_ddp_hangs_only_where_forward_broadcasts_buffers(cases):
    done, _ = cases["eval-rank0-ddp"]
    assert done.returncode != 0
    assert "DDP, model without buffers: rank 0 evaluated alone" in done.stdout, done.stdout
    assert "model with BatchNorm: rank 0 evaluated alone" not in done.stdout
    (rank0,), (rank1,) = _lines(done, "distlab: rank 0 "), _lines(done, "distlab: rank 1 ")
    assert "stopped in evaluation's forward, model with BatchNorm" in rank0, rank0
    assert "stopped in the barrier after evaluation, model with BatchNorm" in rank1, rank1


@pytest.fixture(scope="module")
def tried(tmp_path_factory) -> dict:
    rows = [row for row in BAD_INPUTS if not (row.needs_no_gpu and torch.cuda.is_available())]
    return {outcome.row.name: outcome for outcome in try_rows(rows, tmp_path_factory.mktemp("bad-inputs"))}


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[row.name for row in BAD_INPUTS])
def test_every_bad_input_is_one_line_a_failed_exit_and_nothing_left_behind(tried, row):
    if row.name not in tried:
        pytest.skip("this machine has a GPU")
    outcome = tried[row.name]
    assert outcome.returncode != 0, outcome.output
    if row.ranks == 0:  # no launcher: distlab.train's own exit code for a mistake in the command line
        assert outcome.returncode == 2, outcome.output
    assert row.says in outcome.line, outcome.output
    assert outcome.left_behind == [], f"written half: {outcome.left_behind}"
    if row.answered_by == "distlab":
        assert outcome.distlab_lines == [outcome.line], outcome.output  # rank 0's one line, no other rank's
        assert not outcome.traceback_before_line, outcome.output
    else:  # torchrun's agent failed before any rank started: its own traceback ends in the line
        assert outcome.distlab_lines == [] and outcome.output.rstrip().endswith(outcome.line)


def test_the_table_covers_the_mistakes_the_chapter_names():
    names = {row.name for row in BAD_INPUTS}
    assert len(names) == len(BAD_INPUTS), "row names are test ids: unique"
    for row in BAD_INPUTS:
        assert row.mistake and row.says and row.fix and row.command()[0] in ("torchrun", "python")


def test_the_chapters_committed_table_is_the_list_tried_here():
    """The troubleshooting chapter shows a committed run of every row (``python -m distlab.demos.bad_inputs``): it must
    hold exactly today's rows, each answered as the row says, nothing left behind."""
    # the checkout's own file: the installed package (Kaggle's stack installs the wheel) may live anywhere
    results = Path(__file__).resolve().parents[1] / "book" / "results"
    record = read_result(results / "troubleshooting" / "bad-inputs.json")
    assert [row["name"] for row in record["metrics"]] == [row.name for row in BAD_INPUTS], "re-run it"
    for shown, row in zip(record["metrics"], BAD_INPUTS, strict=True):
        assert (shown["mistake"], shown["fix"]) == (row.mistake, row.fix)
        assert shown["command"] == " ".join(row.command({"folder": "DIR", "port": "PORT"}))
        assert row.says in shown["line"] and shown["returncode"] != 0 and shown["left_behind"] == []
