"""A hung job read from what its ranks leave: Flight Recorder's dumps lined up by sequence number name the
collective the ranks disagreed on (``distlab.measure.flight_recorder``), and ``monitored_barrier`` names the rank
that never came (``distlab.demos.hangs``).

``tests/flight-recorder/<case>/rank_<r>.json`` are two gloo ranks' real dumps of ``python -m distlab.demos.hangs
--case mismatch`` and ``--case skip`` (torch 2.14.1), torch's pickle written as JSON with each frame's path cut
to its file name (``torch/...`` for torch's own). The slow tests make them again and read the same thing.
"""

from __future__ import annotations

import json
import pickle
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distlab.demos.hangs import main_thread_stack
from distlab.exercises.troubleshooting import MISMATCH_DUMPS, SKIP_DUMPS
from distlab.labs.launch import launcher_environment, run_job, torchrun_command
from distlab.measure.flight_recorder import Call, calls_in, first_mismatch, read_dumps

DUMPS = Path(__file__).parent / "flight-recorder"
TIMEOUT_S = 3
LATE_TIMEOUT_S = 1  # the late rank needs no more to be late


def _call(rank: int, sequence: int, collective: str, group: str = "0", sizes=((4,),)) -> Call:
    return Call(rank, group, sequence, collective, sizes)


def test_the_reader_names_the_collective_two_real_gloo_dumps_disagree_on():
    mismatch = first_mismatch(read_dumps(DUMPS / "mismatch"))
    assert mismatch.describe() == (
        "collective #2 of group '0': rank 1 called broadcast([4]) at failures.py:58 in mismatch, "
        "where rank 0 called all_reduce([4]) at failures.py:56 in mismatch"
    )
    skipped = first_mismatch(read_dumps(DUMPS / "skip"))  # rank 1's step 3 paired with rank 0's step 2, silently
    assert (skipped.rank, skipped.sequence, skipped.collective) == (1, 4, "barrier")
    assert skipped.calls[0].collective == "all_reduce"


def test_the_exercise_is_graded_on_what_the_real_dumps_hold():
    assert read_dumps(DUMPS / "mismatch") == MISMATCH_DUMPS
    assert read_dumps(DUMPS / "skip") == SKIP_DUMPS


def test_calls_pair_by_sequence_number_within_their_group_not_by_place_in_the_buffer():
    rank0 = [_call(0, 3, "all_reduce"), _call(0, 4, "all_reduce")]  # its ring buffer dropped #1 and #2
    rank1 = [_call(1, s, "all_reduce") for s in (1, 2, 3)] + [_call(1, 4, "barrier", sizes=())]
    found = first_mismatch({0: rank0, 1: rank1})
    assert (found.rank, found.sequence, found.collective) == (1, 4, "barrier")
    # a second group's calls on one rank only (a subgroup) neither shift the pairing nor count as a mismatch
    side = [_call(0, 1, "all_gather", group="1")]
    assert first_mismatch({0: side + rank0[:1], 1: rank1[:3]}) is None


def test_a_rank_whose_calls_stop_first_is_named_not_the_one_that_waits():
    waiting = [_call(0, 1, "all_reduce"), _call(0, 2, "all_reduce")]
    found = first_mismatch({0: waiting, 1: waiting[:1]})
    assert (found.rank, found.sequence, found.collective) == (1, 2, None)
    assert "rank 1 never called it, where rank 0 called all_reduce([4])" in found.describe()


def test_different_sizes_of_the_same_collective_are_a_mismatch_and_most_ranks_set_the_reference():
    four, eight = _call(0, 1, "all_reduce"), _call(2, 1, "all_reduce", sizes=((8,),))
    found = first_mismatch({0: [four], 1: [_call(1, 1, "all_reduce")], 2: [eight]})
    assert (found.rank, found.collective) == (2, "all_reduce")


def test_point_to_point_entries_are_left_out_they_pair_by_another_count():
    dump = json.loads((DUMPS / "mismatch" / "rank_0.json").read_text())
    sent = {**dump["entries"][1], "is_p2p": True, "profiling_name": "gloo:send", "collective_seq_id": 0}
    assert [c.collective for c in calls_in({"entries": [*dump["entries"], sent]}, 0)] == ["barrier", "all_reduce"]


def test_torchs_analyzer_stops_on_gloo_dumps_because_their_group_is_listed_under_another_name(tmp_path):
    from torch.distributed.flight_recorder.fr_trace import main as fr_trace

    for path in (DUMPS / "mismatch").glob("rank_*.json"):
        (tmp_path / path.stem).write_bytes(pickle.dumps(json.loads(path.read_text())))  # torch's format again
    with pytest.raises(KeyError) as raised:
        fr_trace([str(tmp_path), "-p", "rank_"])
    assert raised.value.args[0] == ("0", 0)  # (the entry's group name, its rank), looked up in pg_config's names
    dump = pickle.loads((tmp_path / "rank_0").read_bytes())
    assert list(dump["pg_config"]) == [""] and {e["process_group"][0] for e in dump["entries"]} == {"0"}


def _hang(case: str, folder: Path) -> subprocess.CompletedProcess:
    timeout_s = LATE_TIMEOUT_S if case == "late" else TIMEOUT_S
    options = ["--case", case, "--dumps", str(folder), "--timeout-s", str(timeout_s), "--device", "cpu"]
    command = torchrun_command(2, "distlab.demos.hangs", *options)
    return run_job(command, timeout=120, env=launcher_environment(1))


@pytest.fixture(scope="module")
def hung(tmp_path_factory) -> dict:
    """Both hangs at once (their ranks mostly wait for the timeout): case -> (the job, its dump folder)."""
    folders = {case: tmp_path_factory.mktemp(case) for case in ("mismatch", "late")}
    with ThreadPoolExecutor(2) as pool:
        jobs = dict(zip(folders, pool.map(lambda case: _hang(case, folders[case]), folders)))
    return {case: (jobs[case], folders[case]) for case in folders}


@pytest.mark.slow
def test_a_hung_mismatch_leaves_dumps_that_name_it_and_stacks_that_show_the_line(hung):
    job, folder = hung["mismatch"]
    assert job.returncode != 0, job.stderr[-2000:]
    live, committed = first_mismatch(read_dumps(folder)), first_mismatch(read_dumps(DUMPS / "mismatch"))
    assert (live.rank, live.sequence, live.collective) == (committed.rank, committed.sequence, committed.collective)
    assert {r: c.sizes for r, c in live.calls.items()} == {r: c.sizes for r, c in committed.calls.items()}
    stack = main_thread_stack((folder / "stack_1.txt").read_text())  # faulthandler's, half-way to the timeout
    assert stack[0].endswith(" in broadcast") and stack[2].startswith("failures.py:"), stack
    assert stack[2].endswith(" in mismatch"), stack


@pytest.mark.slow
def test_monitored_barrier_names_the_rank_that_never_came(hung):
    job, folder = hung["late"]
    (line,) = [line for line in job.stderr.splitlines() if line.startswith("distlab: rank 0 ")]
    assert f"(Rank 1 failed to pass monitoredBarrier in {LATE_TIMEOUT_S * 1000} ms)" in line, line
    stack = main_thread_stack((folder / "stack_1.txt").read_text())
    assert stack[0].startswith("hangs.py:") and stack[0].endswith(" in late"), stack  # stuck outside any collective
