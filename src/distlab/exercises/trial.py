"""The rank side of a check: run the learner's function on cases, compare, and write what happened.

Each rank imports the learner's module, runs the exercise's ``trial(t, fn)`` with a :class:`Trial` ``t``, and
writes one JSON report: passed, or the first thing that went wrong (the case, what was compared, how far off,
and the mistake it looks like), or the learner's exception with the line of the learner's code it came from.
Every collective and point-to-point call the learner makes is traced, flushed before it can block, so that a
rank killed in a deadlock still says what it was waiting for.
"""

from __future__ import annotations

import functools
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
import torch.distributed as dist

from ..errors import collective_failure
from ..jobs import become_rank

TRACED = (
    "send", "recv", "isend", "irecv", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
    "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all_single", "barrier",
    "all_gather_single", "reduce_scatter_single",  # torch 2.14's names for the *_tensor pair
)  # fmt: skip
SENDS = {"send": "dst", "isend": "dst"}
RECEIVES = {"recv": "src", "irecv": "src"}
# isend and irecv are also compared by identity inside torch (P2POp checks its op is one of them)
IDENTITY_CHECKED = ("isend", "irecv")


# "[rank1]:[F1126 12:00:00.000 file.cc:12] " and "[/path/to/gloo/file.cc:129] ": where in C++, not what happened
TORCH_LOG_PREFIX = re.compile(r"^(\[rank\d+\]:)?(\[[A-Z]\d{4} [^\]]*\] |\[[^\]]*\.(cc|cpp|h):\d+\] )*", re.M)


class StopTrial(Exception):
    """The first failure is recorded; the rank stops checking."""


class LearnerRaised(Exception):
    """The learner's function raised; the report holds where."""


def _first_tensor(kwargs: dict) -> torch.Tensor | None:
    """The tensor a call names first by keyword: ``tensor``, or the output of a collective called with keywords
    (FSDP2 calls ``reduce_scatter_tensor(output=..., input=...)``)."""
    return next((kwargs[key] for key in ("tensor", "output", "output_tensor") if key in kwargs), None)


class Tracer:
    """Every traced call this rank makes, appended to a file as it starts and when it returns."""

    def __init__(self, path: Path):
        self.path = path
        self.calls: list[dict] = []
        self.inside = False  # torch's send is its isend waited on: only the learner's own call is traced
        self.case = -1  # the index of the case running, set by Trial.case
        self.watch_waits = False  # an async call's handle reports the learner's wait (a trial that needs it says so)
        self.batching = False  # inside dist.batch_isend_irecv, whose requests are watched as a batch
        self.in_flight: dict[int, tuple[torch.Tensor, int]] = {}  # call -> (its tensor, its version at launch)
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed by the rank's exit)

    def record(self, op: str, args: tuple, kwargs: dict) -> dict:
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(kwargs)
        call = {"op": op, "n": len(self.calls) + 1, "done": False, "case": self.case}
        if isinstance(tensor, torch.Tensor):
            call["bytes"] = tensor.numel() * tensor.element_size()
            # what the call reads or writes: a received segment lands in `tensor` itself or in a copy of it
            call["storage"] = tensor.untyped_storage().data_ptr()
        reduce_op = kwargs.get("op", args[1] if op == "all_reduce" and len(args) > 1 else None)
        if op == "all_reduce" and reduce_op is not None:
            call["reduce_op"] = getattr(reduce_op, "name", str(reduce_op))  # ReduceOp.AVG -> "AVG"
        peer_key = SENDS.get(op) or RECEIVES.get(op)
        if peer_key:
            peer = kwargs.get(peer_key, args[1] if len(args) > 1 else None)
            if peer is None:
                peer = kwargs.get(f"group_{peer_key}")
            call["peer"] = peer
        self.calls.append(call)
        self.file.write(json.dumps(call) + "\n")
        return call

    def finish(self, call: dict) -> None:
        call["done"] = True
        self.file.write(json.dumps({"n": call["n"], "done": True}) + "\n")

    def waited(self, call: dict, done: bool) -> None:
        """The learner waited for an async ``call`` (``done``: it has returned), or took its future to wait on.
        A tensor the learner changed in place between the launch and this wait is marked ``changed_in_flight``:
        torch's collectives never bump a tensor's version, so only the learner's own in-place ops (``/=``) do."""
        call["waited"] = True
        launched = self.in_flight.pop(call["n"], None)
        if launched is not None and launched[0]._version != launched[1]:
            call["changed_in_flight"] = True
        if done and not call["done"]:
            self.finish(call)

    def watch(self, result, calls: list[dict]):
        """``result``, the handle of the async ``calls``, wrapped to report the learner's wait to each of them."""
        for call in calls:
            call["watched"] = True

        def waited(done: bool) -> None:
            for call in calls:
                self.waited(call, done)

        return WatchedWork(result, waited)

    def bytes_sent(self, since: int = 0) -> int:
        sent = 0
        for call in self.calls[since:]:
            if call["op"] in SENDS:
                sent += call.get("bytes", 0)
        return sent

    def ops(self, since: int = 0) -> list[str]:
        return [call["op"] for call in self.calls[since:]]

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap torch.distributed's calls for the duration; the originals come back afterwards."""
        import torch.distributed.distributed_c10d as c10d

        originals = {}
        for op in TRACED:
            original = getattr(dist, op, None)
            if original is None:
                continue
            originals[op] = original
            wrapped = self._wrap(op, original)
            setattr(dist, op, wrapped)
            if op in IDENTITY_CHECKED:
                setattr(c10d, op, wrapped)
        batch = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap_batch(batch)
        try:
            yield
        finally:
            dist.batch_isend_irecv = batch
            for op, original in originals.items():
                setattr(dist, op, original)
                if op in IDENTITY_CHECKED:
                    setattr(c10d, op, original)

    def _wrap(self, op: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def traced(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            call = self.record(op, args, kwargs)
            self.inside = True
            try:
                result = original(*args, **kwargs)
            finally:
                self.inside = False
            if op not in ("isend", "irecv") and not kwargs.get("async_op"):
                self.finish(call)
            elif self.watch_waits and isinstance(result, dist.Work) and not self.batching:
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
                if isinstance(tensor, torch.Tensor):
                    self.in_flight[call["n"]] = (tensor, tensor._version)
                result = self.watch(result, [call])
            return result

        return traced

    def _wrap_batch(self, original: Callable) -> Callable:
        """dist.batch_isend_irecv, whose sends and receives are traced one by one; with ``watch_waits``, its
        requests report the learner's waits: one request per op (gloo), or one for the whole batch (NCCL
        coalesces it), which then stands for every op in it."""

        @functools.wraps(original)
        def traced(p2p_op_list):
            since = len(self.calls)
            self.batching = True
            try:
                requests = original(p2p_op_list)
            finally:
                self.batching = False
            if not self.watch_waits or not isinstance(requests, list):
                return requests
            calls = [c for c in self.calls[since:] if c["op"] in ("isend", "irecv")]
            if len(requests) == len(calls):
                return [self.watch(r, [c]) for r, c in zip(requests, calls)]
            return [self.watch(r, calls) for r in requests]

        return traced


class WatchedWork:
    """The handle an async call returned, which tells the tracer when the learner waits for it. Whether an
    all-reduce was ever waited for cannot be read from its values: on an idle machine gloo often finishes it
    before anything looks, so an answer that never waits would pass or fail by chance. Everything else is the
    handle's own."""

    def __init__(self, work: dist.Work, on_wait: Callable[[bool], None]):
        self._work, self._on_wait = work, on_wait

    def wait(self, *args, **kwargs):
        finished = self._work.wait(*args, **kwargs)
        self._on_wait(True)
        return finished

    def is_completed(self) -> bool:
        completed = self._work.is_completed()
        if completed:  # a learner's loop that polls until it is done has waited
            self._on_wait(True)
        return completed

    def get_future(self):
        self._on_wait(False)  # what waits on the future is the learner's own code
        return self._work.get_future()

    def __getattr__(self, name: str):
        return getattr(self._work, name)


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


def ranks_said(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 1 and 2``, ``ranks 1, 2 and 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _posted(calls: list[dict], ops: dict, peer: int) -> int:
    return sum(1 for c in calls if c["op"] in ops and c.get("peer") == peer)


def sent_elsewhere(traces: list[list[dict]], rank: int, call: dict | None) -> str:
    """Read from every rank's trace (the grader's, once the ranks have ended): when ``call``, the send or receive
    ``rank`` waits in, names a peer that posted no message for it but one for another rank that no receive takes
    (or a receive from another rank that nothing fills), that, said."""
    if call is None or call.get("peer") is None or not 0 <= call["peer"] < len(traces):
        return ""
    peer, receiving = call["peer"], call["op"] in RECEIVES
    mine, theirs = (RECEIVES, SENDS) if receiving else (SENDS, RECEIVES)
    if _posted(traces[peer], theirs, rank) >= _posted(traces[rank], mine, peer):
        return ""  # the peer posted its half
    others = []
    for c in traces[peer]:
        other = c.get("peer")
        if c["op"] in theirs and other not in (None, rank) and 0 <= other < len(traces) and other not in others:
            if _posted(traces[peer], theirs, other) > _posted(traces[other], mine, peer):
                others.append(other)
    if not others:
        return ""
    listed = " and ".join(f"rank {k}" for k in others)
    if receiving:
        return f"; rank {peer} sent to {listed}, not to rank {rank}"
    return f"; rank {peer} receives from {listed}, not from rank {rank}"


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
