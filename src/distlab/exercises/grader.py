"""The notebook side of a check: ship the learner's function to real ranks, bound them in time, and answer.

``check("ring_reduce_scatter", my_ring_reduce_scatter)`` starts the exercise's ranks (one NCCL rank per GPU on a
machine with a GPU for each, else gloo ranks on the CPU), each of which runs the learner's function against
the library's answer (:mod:`.trial`). It waits at most ``timeout_s`` for them, then stops whatever still runs,
and prints one answer: right, or the first thing that went wrong, which rank, which case, how far off, and
the mistake it looks like. It never prints a traceback from inside torch.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from .. import runtime
from ..errors import DistlabError
from ..jobs import hosted_rendezvous, rank_context
from ..runtime import Placement, place
from .catalog import Exercise, all_exercises, get
from .source import is_stub, module_source
from .trial import rank_main
from .verdict import WRITE_IT, Ended, Verdict, verdict_from, where_checked

STARTUP_S = 180.0
"""How long the ranks may take to start (the first check starts a server that imports torch once)."""
MEETING_S = 90.0
"""How long started ranks may take to join their group: well under :data:`STARTUP_S`, so that a rank that
cannot join says why before the grader stops it."""
PRELOAD = ("distlab.parallel", "distlab.exercises.trial")
"""What the rank server imports for the grader's ranks, besides torch (:func:`distlab.jobs.rank_context`): the
library the exercises compare with, and the rank side every rank starts in."""


def check(name: str, fn, ranks: int | None = None, device: str = "auto", timeout_s: float = 20.0) -> None:
    """Grade ``fn`` as exercise ``name`` on real ranks and print the answer (see :func:`grade`)."""
    print(wrapped(grade(name, fn, ranks=ranks, device=device, timeout_s=timeout_s).message), flush=True)


def wrapped(message: str, width: int = 100) -> str:
    """Each line of ``message`` folded to ``width`` columns (a notebook's output box does not fold), its
    continuation indented under the line's own text."""
    lines = []
    for line in message.splitlines():
        indent = len(line) - len(line.lstrip())
        lines.append(textwrap.fill(line, width, subsequent_indent=" " * (indent + 2), break_long_words=False))
    return "\n".join(lines)


def grade(name: str, fn, ranks: int | None = None, device: str = "auto", timeout_s: float = 20.0) -> Verdict:
    """Run exercise ``name`` with ``fn`` on ``ranks`` ranks (the exercise's default when None) on ``device``
    (``auto``: one NCCL rank per GPU on a machine with a GPU for each rank, else gloo ranks on the CPU;
    ``cuda`` without ``ranks``: one NCCL rank per GPU, fewer than the exercise's if the machine has fewer GPUs);
    every rank must finish within ``timeout_s`` seconds of starting. A right answer checked on fewer ranks than
    the exercise's ``min_ranks`` is checked again on that many gloo ranks on the CPU, where its typical mistakes
    show."""
    verdict = _grade_once(name, fn, ranks, device, timeout_s)
    exercise = all_exercises().get(name)
    if not verdict.passed or exercise is None or verdict.ranks >= exercise.min_ranks:
        return verdict
    where = where_checked(verdict.device, verdict.ranks)
    again = _grade_once(name, fn, exercise.min_ranks, "cpu", timeout_s)
    why = f"on {where}, {exercise.min_ranks_why}" if exercise.min_ranks_why else f"{where} cannot tell them apart"
    if again.passed:
        again_where = where_checked("cpu", exercise.min_ranks)
        said = f"{verdict.message}\n  Also right on {again_where} on the CPU, where its typical mistakes show ({why})."
        return replace(verdict, message=said)
    head, _, rest = again.message.partition("\n")
    said = f"It was right on the {where} asked for, but {why}: checked again on {where_checked('cpu', again.ranks)}."
    return replace(again, message=f"{head}\n  {said}" + (f"\n{rest}" if rest else ""))


def _grade_once(name: str, fn, ranks: int | None, device: str, timeout_s: float) -> Verdict:
    try:
        exercise = get(name)
        if is_stub(fn):
            return _not_filled(exercise, fn)
        source, fn_name = module_source(fn)
        placement = _placement(exercise, ranks, device)
        device, world = placement.device, placement.ranks
    except DistlabError as err:
        return Verdict(name, "refused", f"✗ {name}: {err}")
    workdir = Path(tempfile.mkdtemp(prefix=f"distlab-{name}-"))
    try:
        (workdir / "solution.py").write_text(source)
        reports, traces, died, ended = _run_ranks(exercise, workdir, fn_name, world, device, timeout_s)
        return verdict_from(exercise, reports, traces, died, world, device, ended)
    except DistlabError as err:
        return Verdict(name, "grader", f"✗ {name}: {err}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def solutions_pass(page: str) -> list[str]:
    """Grade the solution of every exercise on ``page``, wherever on the page it sits (what the book's build
    runs): the names graded; DistlabError with the verdicts if one fails."""
    exercises = [e for e in all_exercises().values() if page in (e.page, *e.pages)]
    if not exercises:
        raise DistlabError(f"no exercise is on page {page!r}")
    failed = [v for v in (grade(e.name, e.solution_function()) for e in exercises) if not v.passed]
    if failed:
        raise DistlabError("a solution fails its own check:\n" + "\n".join(v.message for v in failed))
    return [e.name for e in exercises]


def _not_filled(exercise: Exercise, fn) -> Verdict:
    message = f"✎ {exercise.name}: `{fn.__name__}` is still the empty stub. {exercise.task} {WRITE_IT}"
    return Verdict(exercise.name, "not_filled", message)


def _placement(exercise: Exercise, ranks: int | None, device: str) -> Placement:
    """Where the check runs, by :func:`distlab.runtime.place`: the exercise's ranks (or the learner's
    ``ranks``), one NCCL rank per GPU on a machine with a GPU for each, gloo ranks on the CPU otherwise. ``auto``
    never checks on fewer ranks than asked: on two GPUs a ring's rank + 1 and rank - 1 are one rank, and
    torch.chunk cuts every length as segment_bounds does, so a two-rank check passes both mistakes. Only
    ``device="cuda"`` without ``ranks`` takes one rank per GPU when there are fewer GPUs than ranks (at least
    two). A GPU rank is always an NCCL rank: the exercises send CUDA tensors point to point, which gloo cannot."""
    if device not in ("auto", "cpu", "cuda"):
        raise DistlabError(f"device must be auto, cpu or cuda, not {device!r}")
    world = exercise.ranks if ranks is None else ranks
    backend = "nccl" if device == "cuda" else "auto"
    try:
        return place(world, device, backend, short_of_gpus="shrink" if device == "cuda" and ranks is None else "cpu")
    except DistlabError:
        if device != "cuda":
            raise
        gpus = runtime.gpu_count()  # place's refusal names command-line flags; a check takes keywords
    leave = f"leave device out to check on {world} gloo ranks on the CPU"
    if gpus == 0:
        raise DistlabError(f'device="cuda" was asked for, but this machine has no usable CUDA GPU: {leave}')
    fewer = f"pass ranks={gpus}, or " if gpus >= 2 else ""
    raise DistlabError(f'device="cuda" runs one NCCL rank per GPU, and this machine has {gpus} for {world} ranks: '
                       f"{fewer}{leave}")  # fmt: skip


@contextmanager
def _main_script_left_behind():
    """A rank needs nothing of the caller's ``__main__``; started from a script, multiprocessing would run that
    script again in each rank (and a ``check`` at its top level again), so its path is hidden while they start."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) if getattr(main, "__spec__", None) is None else None
    if path is not None:
        del main.__file__
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def _run_ranks(exercise, workdir: Path, fn_name: str, world: int, device: str, timeout_s: float):
    """Start the ranks; wait for them to start, then at most ``timeout_s`` (plus the group's own teardown);
    stop what is left. Returns each rank's report (None if it wrote none), its traced calls, whether any
    rank ended on its own without a report (rank -> exit code), and how the check ended (:class:`Ended`)."""
    context = rank_context(*PRELOAD)
    with hosted_rendezvous() as rendezvous:  # held until every rank has ended
        processes = [
            context.Process(
                target=rank_main,
                args=(
                    exercise.trial.__module__,
                    exercise.name,
                    str(workdir / "solution.py"),
                    fn_name,
                    rank,
                    world,
                    rendezvous,
                    str(workdir),
                    device,
                    timeout_s,
                    MEETING_S,
                ),
                daemon=True,
            )
            for rank in range(world)
        ]
        with _main_script_left_behind():
            for process in processes:
                process.start()
        started = time.monotonic()
        deadline = started + STARTUP_S  # until every rank has started
        while time.monotonic() < deadline and any(p.is_alive() for p in processes):
            if all((workdir / f"rank{r}.started").exists() for r in range(world)):
                started = time.monotonic()  # the check's own time starts now
                deadline = started + timeout_s + 5.0
                break
            time.sleep(0.005)  # a rank starts within tens of ms: polled finely, so a check waits no longer than it must
        running = [p.sentinel for p in processes if p.is_alive()]
        while running and (left := deadline - time.monotonic()) > 0:  # woken the moment a rank ends
            finished = multiprocessing.connection.wait(running, timeout=left)
            running = [sentinel for sentinel in running if sentinel not in finished]
        ended = Ended(time.monotonic() - started, timed_out=any(p.is_alive() for p in processes), timeout_s=timeout_s)
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(10)
    if not any((workdir / f"rank{r}.started").exists() for r in range(world)):
        raise DistlabError(f"the ranks did not start ({_why_not_started(workdir, processes)}); run this check again")
    reports = [_read_json(workdir / f"rank{r}.json") for r in range(world)]
    for rank, report in enumerate(reports):
        if report is not None:
            report["printed"] = _read_text(workdir / f"rank{rank}.out")
    traces = [_read_trace(workdir / f"rank{r}.trace.jsonl") for r in range(world)]
    died = {r: p.exitcode for r, p in enumerate(processes) if reports[r] is None and p.exitcode not in (0, -9)}
    return reports, traces, died, ended


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _why_not_started(workdir: Path, processes) -> str:
    """What the ranks said when they could not join the group (each rank's one line, ranks that said the same
    together), or their exit codes where none said anything."""
    ranks_by_reason: dict[str, list[str]] = {}
    for rank in range(len(processes)):
        for line in _read_text(workdir / f"rank{rank}.not_started"):
            ranks_by_reason.setdefault(line.rstrip("."), []).append(str(rank))
    if not ranks_by_reason and all(p.exitcode == -signal.SIGKILL for p in processes):
        return f"none had joined the group after {STARTUP_S:.0f} s, when the check stopped them"
    if not ranks_by_reason:
        return "exit codes " + ", ".join(str(p.exitcode) for p in processes)
    return "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(rs)}: {line}" for line, rs in ranks_by_reason.items())


def _read_text(path: Path, most_lines: int = 12) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return lines[:most_lines] + ([f"... ({len(lines) - most_lines} more lines)"] if len(lines) > most_lines else [])


def _read_trace(path: Path) -> list[dict]:
    calls: dict[int, dict] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if "op" in entry:
            calls[entry["n"]] = entry
        elif entry["n"] in calls:
            calls[entry["n"]]["done"] = True
    return [calls[n] for n in sorted(calls)]
