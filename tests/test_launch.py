"""Jobs launched from a notebook or a test never outlive their caller, and a job that fails says why in one
line: a rank the operating system killed is named, with its signal and what to lower."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab.errors import DistlabError
from distlab.labs import launch

HANGING_LAUNCHER = """
import subprocess, sys, time
# Like torchrun, start a worker in a session of its own, then wait on it.
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


def _pid_from(path: Path) -> int:
    for _ in range(200):
        if path.is_file() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} was never written")


@pytest.mark.skipif(sys.platform != "linux", reason="finds a job's processes in /proc")
def test_a_timed_out_job_leaves_no_process_behind(tmp_path: Path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        launch.run_job([sys.executable, "-c", HANGING_LAUNCHER, str(pid_file)], timeout=3)
    assert not _alive(_pid_from(pid_file)), "the worker in its own session was stopped with its launcher"


SPAWNING_LAUNCHER = """
import subprocess, sys, time
# Starts workers in sessions of their own without pause, so the timeout finds it in the middle of one.
with open(sys.argv[1], "a") as pids:
    while True:
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the job's pipes close when it ends
        pids.write(f"{subprocess.Popen(['sleep', '120'], start_new_session=True, **quiet).pid}\\n")
        pids.flush()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="finds a job's processes in /proc")
def test_a_job_stopped_while_it_starts_workers_leaves_none_behind(tmp_path: Path):
    pid_file = tmp_path / "workers.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        launch.run_job([sys.executable, "-c", SPAWNING_LAUNCHER, str(pid_file)], timeout=2)
    pids = [int(line) for line in pid_file.read_text().split()]
    assert pids and not [pid for pid in pids if _alive(pid)], "workers started as the job was stopped outlived it"


@pytest.mark.skipif(sys.platform != "linux", reason="finds a job's processes in /proc")
def test_a_notebook_job_past_its_timeout_is_stopped_ranks_included(tmp_path: Path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'rank' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(300)\n"
    )
    with pytest.raises(DistlabError, match=r"ran past 10 s and was stopped"):
        launch.torchrun(str(script), nproc=2, echo=False, timeout_s=10)
    for rank in (0, 1):
        assert not _alive(_pid_from(tmp_path / f"rank{rank}")), f"rank {rank} outlived the job"


def test_a_rank_killed_by_the_operating_system_is_one_line(tmp_path: Path):
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(DistlabError) as failed:
        launch.torchrun(str(script), nproc=2, echo=False, timeout_s=120)
    message = str(failed.value)
    assert "\n" not in message
    assert "rank 1 was killed by SIGKILL" in message and "host memory" in message and "--batch-size" in message


def test_a_rank_ended_by_another_signal_is_named_with_its_last_words():
    output = [
        "distlab: fsdp | cnn ...\n",
        "terminate called without an active exception\n",
        "E1124 23:47:31.399000 6921 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6)\n",
        "Traceback (most recent call last):\n",
        '  File "/venv/bin/torchrun", line 6, in <module>\n',
        "Root Cause (first observed failure):\n",
        "[0]:\n",
        "  rank      : 1 (local_rank: 1)\n",
        "  exitcode  : -6 (pid: 6933)  (SIGABRT)\n",
    ]
    assert launch._failure_reason(output) == (
        "rank 1 was killed by SIGABRT; the job's last words: terminate called without an active exception"
    )
    assert launch._failure_reason(["distlab: error: --batch-size must be at least 1\n"]).startswith("distlab: error")
