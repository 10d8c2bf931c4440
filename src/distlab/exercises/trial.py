"""The rank side of a check: run the learner's function on cases, compare, and write what happened.

Each rank imports the learner's module, runs the exercise's ``trial(t, fn)`` with a :class:`Trial` ``t``, and
writes one JSON report: passed, or the first thing that went wrong (the case, what was compared, how far off,
and the mistake it looks like), or the learner's exception with the line of the learner's code it came from.
Every collective and point-to-point call the learner makes is traced, flushed before it can block, so that a
rank killed in a deadlock still says what it was waiting for.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import math
import os
import re
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from types import FunctionType, ModuleType

import torch

from ..errors import collective_failure
from ..jobs import become_rank
from .trace import Tracer

# "[rank1]:[F1126 12:00:00.000 file.cc:12] " and "[/path/to/gloo/file.cc:129] ": where in C++, not what happened
TORCH_LOG_PREFIX = re.compile(r"^(\[rank\d+\]:)?(\[[A-Z]\d{4} [^\]]*\] |\[[^\]]*\.(cc|cpp|h):\d+\] )*", re.M)


class StopTrial(Exception):
    """The first failure is recorded; the rank stops checking."""


class LearnerRaised(Exception):
    """The learner's function raised; the report holds where."""


class Trial:
    """What an exercise's trial sees on its rank: who it is, the device, cases, comparisons, failures."""

    def __init__(self, rank: int, world_size: int, device: torch.device, tracer: Tracer, solution_file: str):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tracer = tracer
        self.solution_file = solution_file
        self.case_label = ""
        self.cases: list[str] = []
        self.notes: list[str] = []
        self.failure: dict | None = None

    @contextmanager
    def case(self, label: str) -> Iterator[None]:
        self.case_label = label
        self.cases.append(label)
        self.tracer.case = len(self.cases) - 1
        yield

    def call(self, fn: Callable, *args, **kwargs):
        """The learner's function, with its exception turned into a report instead of a torch traceback."""
        try:
            return fn(*args, **kwargs)
        except StopTrial:
            raise
        except BaseException as err:  # noqa: BLE001 (whatever the learner's code raises is reported, not re-raised)
            self.failure = self._raised(err)
            raise LearnerRaised from None

    def _raised(self, err: BaseException) -> dict:
        frames = traceback.extract_tb(err.__traceback__)
        mine = [f for f in frames if f.filename == self.solution_file]
        where = mine[-1] if mine else None
        text = TORCH_LOG_PREFIX.sub("", str(err).strip())
        message = text.splitlines()[0] if text else ""
        failure = {
            "kind": "raised",
            "case": self.case_label,
            "rank": self.rank,
            "error": type(err).__name__,
            "message": message[:300],
            "line": where.lineno if where else None,
            "function": where.name if where else None,
            "code": where.line if where else None,
            "collective": collective_failure(err),
            "time": time.time(),
        }
        return failure

    def fail(self, what: str, detail: str, mistake: str | None = None, certain: bool = True) -> None:
        """Record a wrong result and stop: ``what`` was compared, ``detail`` says how far off, ``mistake`` names it
        (``certain=False``: the likeliest of several this rank cannot tell apart; a rank that can tell wins)."""
        self.failure = {
            "kind": "wrong",
            "case": self.case_label,
            "rank": self.rank,
            "what": what,
            "detail": detail,
            "mistake": mistake,
            "certain": certain and mistake is not None,
            "time": time.time(),
        }
        raise StopTrial

    def expect_close(
        self,
        got,
        expected: torch.Tensor,
        what: str,
        mistakes: dict[str, torch.Tensor] | None = None,
        locate: Callable[[int], str] | None = None,
        atol: float = 1e-5,
        rtol: float = 1e-4,
    ) -> None:
        """``got`` equals ``expected`` within tolerance, or a failure that says where, how far, and which of
        ``mistakes`` (name -> what that mistake would have produced) it matches."""
        if not isinstance(got, torch.Tensor):
            self.fail(what, f"expected a tensor, got {type(got).__name__}", "not_a_tensor")
        got_c = got.detach().to("cpu", torch.float64)
        # a mistake is named by the values it gave, never by a shape alone: many mistakes give the same shape
        matches = [name for name, wrong in (mistakes or {}).items() if _same(got_c, wrong, atol, rtol)]
        mistake = matches[0] if matches else None
        if tuple(got.shape) != tuple(expected.shape):
            self.fail(what, f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}", mistake)
        want = expected.detach().to("cpu", torch.float64)
        bad = ~torch.isclose(got_c, want, atol=atol, rtol=rtol)
        if not bad.any():
            return
        flat_bad = bad.reshape(-1).nonzero().flatten()
        first = int(flat_bad[0])
        where = locate(first) if locate else f"element {first}"
        worst = float((got_c - want).abs().max())
        detail = (
            f"{where}: got {got_c.reshape(-1)[first].item():.6g}, expected {want.reshape(-1)[first].item():.6g}; "
            f"{len(flat_bad)} of {want.numel()} values differ, by up to {worst:.3g}"
        )
        self.fail(what, detail, mistake)

    def note(self, text: str) -> None:
        """Something true of a passing answer worth saying (rank 0's notes are shown)."""
        if text not in self.notes:
            self.notes.append(text)


def _same(got: torch.Tensor, wrong: torch.Tensor, atol: float, rtol: float) -> bool:
    wrong = wrong.detach().to("cpu", torch.float64)
    return wrong.shape == got.shape and torch.allclose(got, wrong, atol=atol, rtol=rtol)


REACH_LIMIT = 200_000
"""Objects walked at most, so that a learner's global holding a large structure still ends the walk."""


def storages_reached(fn: Callable) -> set[int]:
    """The data pointers of every non-empty tensor storage the learner's own objects refer to: its module's
    globals, its functions' closures and defaults, its classes, followed through containers, attributes,
    gradients, views' bases and autograd graphs.

    What torch or a backend holds internally is not the learner's and is not reached: gloo keeps a finished
    collective's tensors until its worker thread moves on, and when that happens depends on the machine's load.
    A weak reference that is still alive says only that *something* holds a tensor; this says whether the
    learner does, the same way on a quiet and on a busy machine."""
    home = fn.__globals__.get("__name__") if isinstance(fn, FunctionType) else None
    stack: list = [fn, *(fn.__globals__.values() if isinstance(fn, FunctionType) else ())]
    # Keyed by id, holding each object: autograd hands out a fresh wrapper for a node each time it is asked, and
    # a wrapper freed mid-walk would leave its id to the next one, which would then be skipped as seen.
    seen: dict[int, object] = {}
    found: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .grad of a non-leaf warns
        while stack and len(seen) < REACH_LIMIT:
            obj = stack.pop()
            if obj is None or id(obj) in seen:
                continue
            seen[id(obj)] = obj
            stack.extend(_referents(obj, home, found))
    return found


def _referents(obj, home: str | None, found: set[int]) -> list:
    """What the walk of :func:`storages_reached` follows from ``obj`` (a tensor's storage is recorded in ``found``)."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.nbytes():
            found.add(storage.data_ptr())
        return [obj.grad, obj._base, obj.grad_fn, *gc.get_referents(obj)]
    if isinstance(obj, torch.autograd.graph.Node):
        following = [node for node, _ in obj.next_functions]
        for name in dir(obj):
            if name == "variable" or name.startswith("_saved_"):
                try:
                    following.append(getattr(obj, name))
                except RuntimeError:  # saved values already freed by backward
                    pass
        return following
    if isinstance(obj, ModuleType | str | bytes | int | float | complex | bool):
        return []
    if isinstance(obj, type):  # the learner's own classes only: torch's and Python's hold nothing of theirs
        return list(vars(obj).values()) if obj.__module__ == home else []
    if isinstance(obj, FunctionType):  # a global function's globals are the roots already
        if obj.__module__ != home:
            return []
        cells = [cell.cell_contents for cell in obj.__closure__ or () if _filled(cell)]
        return [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
    return gc.get_referents(obj)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def numbers_close(got, expected: float) -> bool:
    """A plain number (what the arithmetic exercises return) equal to ``expected`` but for rounding."""
    return isinstance(got, int | float) and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-15)


def size_label(nbytes: float) -> str:
    """``nbytes`` as the cases name it: MiB from one on, KiB below."""
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def _load(path: str, name: str) -> Callable:
    spec = importlib.util.spec_from_file_location("learner_solution", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def rank_main(module: str, exercise: str, solution: str, name: str, rank: int, world_size: int,
              rendezvous: dict[str, str], workdir: str, device: str, timeout_s: float,
              meeting_s: float) -> None:  # fmt: skip
    """One rank of a check (started by :mod:`.grader`): run ``exercise`` of the chapter ``module`` on the
    learner's ``name`` from the file ``solution``; report to ``workdir/rank{rank}.json``. ``rendezvous`` is the
    grader's store (:func:`distlab.jobs.hosted_rendezvous`); ``meeting_s`` bounds joining the group, and
    ``timeout_s`` every collective after."""
    become_rank(rank, world_size, rendezvous)
    # torch's deprecation notices are not the learner's to act on, and would drown what their code printed
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.manual_seed(1234 + rank)  # this process's own generator: the trials draw their data from their own
    from ..runtime import distributed

    work = Path(workdir)
    tracer = Tracer(work / f"rank{rank}.trace.jsonl")
    report: dict = {"rank": rank, "status": "passed"}
    with ExitStack() as group:
        try:
            runtime = group.enter_context(distributed(device, timeout_s=timeout_s, start_timeout_s=meeting_s))
        except Exception as err:  # said by the grader, which otherwise sees only an exit code
            first_line = (str(err).strip().splitlines() or [""])[0][:200]
            (work / f"rank{rank}.not_started").write_text(f"{type(err).__name__}: {first_line}")
            raise SystemExit(1) from None
        (work / f"rank{rank}.started").touch()
        trial = Trial(rank, world_size, runtime.device, tracer, solution)
        printed = open(work / f"rank{rank}.out", "w", buffering=1)  # noqa: SIM115 (the rank's exit closes it)
        try:
            fn = trial.call(_load, solution, name)
            with tracer.installed(), redirect_stdout(printed), redirect_stderr(printed):
                next(e for e in importlib.import_module(module).EXERCISES if e.name == exercise).trial(trial, fn)
        except (StopTrial, LearnerRaised):
            report["status"] = trial.failure["kind"]
        except Exception as err:  # noqa: BLE001 (the grader's own failure, said in one line)
            report["status"] = "grader"
            report["error"] = f"{type(err).__name__}: {str(err).strip()[:300]}"
        report.update(failure=trial.failure, cases=trial.cases, notes=trial.notes, bytes_sent=tracer.bytes_sent())
        (work / f"rank{rank}.json").write_text(json.dumps(report))
        if report["status"] != "passed":
            os._exit(0)  # peers may be blocked on this rank: do not wait for them in the group's teardown
