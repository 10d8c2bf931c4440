"""Jobs launched from a notebook or a test never outlive their caller, and a job that fails says why in one
line: a rank the operating system killed is named, with its signal and what to lower."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="finds a job's processes in /proc")
def test_a_job_stopped_while_it_starts_workers_leaves_none_behind(tmp_path: Path):
    pid_file = tmp_path / "workers.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        launch.run_job([sys.executable, "-c", SPAWNING_LAUNCHER, str(pid_file)], timeout=2)
    pids = [int(line) for line in pid_file.read_text().split()]
    assert pids and not [pid for pid in pids if _alive(pid)], "workers started as the job was stopped outlived it"


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert launch.reason_from_lines(output) == (
        "rank 1 was killed by SIGABRT; the job's last words: terminate called without an active exception"
    )
    assert launch.reason_from_lines(["distlab: error: --batch-size must be at least 1\n"]).startswith("distlab: error")


# What torchrun printed for jobs that failed on the course's first GPU machine (an H200, 2026-11-27, at af2257a;
# the runs' logs are kept with the GPU runs), shortened: frames and the ends of torchrun's long log lines are left
# out, the rest is verbatim.
TORCHRUN_REPORT = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "<venv>/lib/python3.12/site-packages/torch/distributed/run.py", line 994, in <module>
    main()
  File "<venv>/lib/python3.12/site-packages/torch/distributed/launcher/api.py", line 317, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
{target} FAILED
------------------------------------------------------------
Failures:
{others}
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_05:51:51
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 754)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
NCCL_CPU_TENSOR = """epoch 1/1 | train loss 0.7589 | test loss 0.0173 acc 99.41% | 1.1s, 7,275 samples/s
[rank0]: Traceback (most recent call last):
[rank0]:   File "<frozen runpy>", line 198, in _run_module_as_main
[rank0]:   File "<checkout>/src/distlab/train.py", line 438, in slowest_median_step_s
[rank0]:     dist.all_reduce(median, op=dist.ReduceOp.MAX)
[rank0]:   File "<venv>/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 3068, in all_reduce
[rank0]:     work = group.allreduce([tensor], opts)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]: RuntimeError: No backend type associated with device type cpu
E1127 05:51:51.270000 728 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1) local_rank: 0
""" + TORCHRUN_REPORT.format(target="distlab.train", others="  <NO_OTHER_FAILURES>", rank=0, code=1)
ONE_GPU_TWO_RANKS = """Traceback (most recent call last):
  File "<tmp>/labs/lab-fsdp/fsdp_train.py", line 266, in main
    torch.cuda.set_device(device)
  File "<venv>/lib/python3.12/site-packages/torch/cuda/__init__.py", line 638, in set_device
    torch._C._cuda_setDevice(device)
torch.AcceleratorError: CUDA error: invalid device ordinal
GPU device may be out of range, do you have enough GPUs?
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.

W1127 06:02:42.282000 971 torch/distributed/elastic/multiprocessing/api.py:1012] Sending process 983 closing
E1127 06:02:42.397000 971 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1) local_rank: 1
""" + TORCHRUN_REPORT.format(
    target="fsdp_train.py", rank=1, code=1,
    others="[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 983)\n  error_file: <N/A>\n"
    "  traceback : Signal 15 (SIGTERM) received by PID 983",
)  # fmt: skip
REFUSED_FLAG = """usage: torchrun --standalone --nproc_per_node=N -m distlab.bench.transfer
       [-h] [--out OUT] [--name NAME] [--sizes SIZES] [--repeats REPEATS]
torchrun --standalone --nproc_per_node=N -m distlab.bench.transfer: error: unrecognized arguments: --device cuda
E1127 07:53:22.703000 12618 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2)
""" + TORCHRUN_REPORT.format(target="distlab.bench.transfer", others="  <NO_OTHER_FAILURES>", rank=0, code=2)


@pytest.mark.parametrize(
    "output, says",
    [
        (NCCL_CPU_TENSOR, "rank 0: RuntimeError: No backend type associated with device type cpu"),
        (ONE_GPU_TWO_RANKS, "rank 1: torch.AcceleratorError: CUDA error: invalid device ordinal"),
        (REFUSED_FLAG, "-m distlab.bench.transfer: error: unrecognized arguments: --device cuda"),
    ],
    ids=["nccl-cpu-tensor", "one-gpu-two-ranks", "refused-flag"],
)
def test_a_failed_jobs_reason_is_the_ranks_own_error_not_torchruns_report(output, says):
    """The GPU report's finding 3: every failure's reason was torchrun's report ("error_file: <N/A> | traceback :
    To enable traceback see: ..."), which says nothing about what failed."""
    reason = launch.failure_reason(output)
    assert says in reason and "\n" not in reason
    assert not any(banner in reason for banner in ("error_file", "To enable traceback", "=====", "ChildFailedError"))


class _NoLaunch(Exception):
    pass


def _no_launch(*args, **kwargs):
    raise _NoLaunch(args[0])


@pytest.mark.parametrize(
    "target, args, says",
    [
        ("distlab.bench.transfer", ("--device", "cuda"), "distlab.bench.transfer: unrecognized arguments: --device"),
        ("distlab.bench.sweep", ("--models", "gpt-nope"), "unknown preset 'gpt-nope'"),
        ("distlab.bench.host", ("--repeats", "many"), "argument --repeats: invalid int value: 'many'"),
        ("distlab.gpu_report", ("--budget", "x"), "distlab.gpu_report: argument --budget-s: invalid float value"),
        ("distlab.bench.nothing_here", (), "no module distlab.bench.nothing_here"),
    ],
)
def test_a_bad_command_line_for_a_distlab_module_is_one_line_before_any_rank_starts(monkeypatch, target, args, says):
    monkeypatch.setattr(launch.subprocess, "Popen", _no_launch)
    with pytest.raises(DistlabError) as refused:
        launch.torchrun(target, *args, nproc=1, echo=False)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_good_command_line_or_a_script_goes_on_to_launch(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(launch.subprocess, "Popen", _no_launch)
    for target, args in [
        ("distlab.bench.host", ("--sizes", "4MB", "--out", str(tmp_path))),
        (str(tmp_path / "mine.py"), ("--anything", "goes")),  # a script parses its own command line
        ("distlab.bench.sweep", ("--help",)),  # the job prints the help
    ]:
        with pytest.raises(_NoLaunch):
            launch.torchrun(target, *args, nproc=1, echo=False)


def test_a_pages_training_launch_parses_its_command_line_once(monkeypatch, tmp_path: Path):
    """B8: ``launch.train`` parsed the command line, then ``torchrun`` parsed the same arguments again; it now hands
    ``torchrun`` the parsed config."""
    parsed_again = []
    monkeypatch.setattr(launch, "check_command_line", lambda *args: parsed_again.append(args))
    monkeypatch.setattr(launch, "run_job", _no_launch)
    with pytest.raises(_NoLaunch):
        launch.train("--strategy", "ddp", "--device", "cpu", nproc=2, out=tmp_path, echo=False)
    assert parsed_again == []


def test_one_runner_captures_a_job_or_streams_it_line_by_line_as_it_runs():
    """B8: ``jobs.run_job`` is the one runner: captured, or each line handed on while the job still runs."""
    script = "import sys, time; print('first', flush=True); print('said', file=sys.stderr, flush=True); "
    script += "time.sleep(1); print('last')"
    captured = launch.run_job([sys.executable, "-c", script], timeout=60)
    assert (captured.stdout, captured.stderr) == ("first\nlast\n", "said\n")
    seen = []
    streamed = launch.run_job(
        [sys.executable, "-c", script], 60, on_line=lambda line: seen.append((line, time.monotonic()))
    )
    assert [line for line, _ in seen] == ["first\n", "said\n", "last\n"] and streamed.stdout == "first\nsaid\nlast\n"
    assert seen[-1][1] - seen[0][1] > 0.5, "the first line came while the job ran, not when it ended"
    with pytest.raises(subprocess.TimeoutExpired):
        launch.run_job([sys.executable, "-c", "import time; time.sleep(60)"], 1, on_line=seen.append)


def test_device_flags_go_to_the_entry_points_that_take_them():
    from distlab.runtime import place

    where = place(gpus=2)
    assert launch.placement_args("distlab.bench.sweep", where) == ("--device", "cuda", "--backend", "nccl")
    assert launch.placement_args("distlab.demos.ddp_knobs", place(gpus=0)) == place(gpus=0).args
    assert launch.placement_args("distlab.bench.transfer", where) == ()  # CUDA-only: no --device to give
    assert launch.placement_args("distlab.bench.host", where) == ()  # it measures the host
    assert launch.placement_args("my_script.py", where) == ()


def _rendezvous_seen(runtime) -> dict:
    return {name: os.environ.get(name) for name in ("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}


def test_ranks_meet_at_a_store_their_launcher_holds_so_no_other_socket_can_take_its_port(tmp_path: Path):
    import datetime
    import errno
    import socket

    import torch.distributed as dist

    from distlab.jobs import hosted_rendezvous
    from distlab.testing import run_ranks

    with hosted_rendezvous() as rendezvous:
        port = int(rendezvous["MASTER_PORT"])
        with socket.socket() as other, pytest.raises(OSError) as taken:  # the race a free port loses
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("reached", "yes")
        assert client.get("reached") == b"yes"
        del client
    with pytest.raises(ConnectionRefusedError):  # the store stopped with the context: nothing left serving
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # the ranks of run_ranks (and of the exercises' grader) are clients of such a store
    seen = run_ranks(_rendezvous_seen, 2, tmp_path)
    assert seen[0] == seen[1] and seen[0]["TORCHELASTIC_USE_AGENT_STORE"] == "True", seen


def _arrive_late_then_wait_alone(rank: int, rendezvous: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from distlab.runtime import distributed

    os.environ.update(rendezvous, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    if rank == 1:
        time.sleep(4.0)  # a slow start: longer than the collectives' timeout below
    with distributed("cpu", timeout_s=1.5):
        total = torch.ones(1)
        dist.all_reduce(total)
        waited = None
        if rank == 1:  # rank 0 never joins this one: it must end after the collectives' 1.5 s
            started = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1))
            except RuntimeError:
                waited = time.monotonic() - started
        else:
            time.sleep(8.0)  # alive, and not in the collective (a peer that left would fail it at once)
        Path(out, f"rank{rank}.txt").write_text(f"{total.item()} {waited}")
        os._exit(0)  # no teardown with a peer that left


@pytest.mark.slow
def test_ranks_may_take_longer_to_meet_than_a_collective_may_wait(tmp_path: Path):
    from distlab.jobs import hosted_rendezvous, rank_context

    context = rank_context()
    with hosted_rendezvous() as rendezvous:
        ranks = [
            context.Process(target=_arrive_late_then_wait_alone, args=(r, rendezvous, str(tmp_path))) for r in (0, 1)
        ]
        for rank in ranks:
            rank.start()
        for rank in ranks:
            rank.join(60)
    assert [rank.exitcode for rank in ranks] == [0, 0]
    (total0, _), (total1, waited) = ((tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1))
    assert total0 == total1 == "2.0"
    assert 1.0 < float(waited) < 10.0, waited


def test_run_many_runs_at_most_at_once_calls_and_every_call_ends_before_a_failure_is_raised():
    import threading

    running, most, ended, lock = [0], [0], [], threading.Lock()

    def job(key, fails=False):
        def call():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.2)
            with lock:
                running[0] -= 1
                ended.append(key)
            if fails:
                raise ValueError(f"{key} failed")
            return key * 2

        return call

    assert launch.run_many({k: job(k) for k in "abcde"}, at_once=2) == {k: k * 2 for k in "abcde"}
    assert most[0] == 2, "two at a time, never more"
    ended.clear()
    with pytest.raises(ValueError, match="a failed"):
        launch.run_many({"a": job("a", fails=True), "b": job("b"), "c": job("c")}, at_once=3)
    assert sorted(ended) == ["a", "b", "c"], "no job left running behind the failure"


def test_train_many_gives_each_run_the_common_flags_then_its_own_and_its_own_options(monkeypatch):
    calls = {}
    monkeypatch.setattr(launch, "train", lambda *args, **options: calls.setdefault(args[-1], (args, options)))
    runs = {"one": ["--lr", "0", "--run-name", "one"], "two": launch.Run(["--run-name", "two"], nproc=1)}
    records = launch.train_many(runs, "--lr", "0.05", at_once=2, out="here", echo=False)
    assert records == calls and list(records) == ["one", "two"]
    assert calls["one"] == (("--lr", "0.05", "--lr", "0", "--run-name", "one"), {"out": "here", "echo": False})
    assert calls["two"] == (("--lr", "0.05", "--run-name", "two"), {"out": "here", "echo": False, "nproc": 1})


def test_torchrun_many_runs_its_target_for_each_run(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "torchrun", lambda target, *args, **options: seen.append((target, args, options)))
    launch.torchrun_many("distlab.train", {"a": ["--x"], "b": launch.Run(["--y"], launcher=("--max-restarts=1",))},
                         "--common", echo=False)  # fmt: skip
    assert sorted(seen) == [
        ("distlab.train", ("--common", "--x"), {"echo": False}),
        ("distlab.train", ("--common", "--y"), {"echo": False, "launcher": ("--max-restarts=1",)}),
    ]


def test_the_pages_run_their_jobs_side_by_side_through_launch_only():
    """B12: how many jobs a page runs at once has one home (launch.run_many and its train/torchrun forms)."""
    book = Path(__file__).resolve().parents[1] / "book"
    own_pools = sorted(page.name for page in book.glob("*.md") if "ThreadPoolExecutor" in page.read_text())
    assert not own_pools, (
        f"pages with a thread pool of their own (use launch.train_many/torchrun_many/run_many): {own_pools}"
    )


def test_running_says_why_the_labs_launch_torchrun_and_not_processes_from_the_notebook():
    """Scout S9: fork after CUDA is initialised and spawn of a function defined in the notebook both fail; the page
    shows spawn's failure live (its cell asserts it, so the build fails if it stops failing) and names fork's error
    as torch words it."""
    page = (Path(__file__).resolve().parents[1] / "book" / "running.md").read_text()
    box = " ".join(page[page.index("(running-why-torchrun)=") : page.index("(platforms)=")].split())
    torch_source = (Path(torch.__file__).parent / "cuda" / "__init__.py").read_text()
    assert "Cannot re-initialize CUDA in forked subprocess" in torch_source
    assert "Cannot re-initialize CUDA in forked subprocess" in box
    assert 'mp.get_context("spawn")' in box and 'assert "exit codes: [1, 1]" in done.stdout and said,' in box
    assert "%%writefile" in box and "`torchrun`" in box
