"""A page's own code run on real ranks, as ``check`` runs an answer, with what each rank sent.

``run_on_ranks(fn, ranks=3)`` ships ``fn`` (a function of the page, with the helpers and constants it names) to
``ranks`` gloo ranks, runs it once on each under the grader's tracer, and hands back what each rank printed,
returned and called: every send, receive and collective, with its bytes and peer, in order. The chapters draw
their pictures of who sends what from these calls, so a picture shows what the code on the page did.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DistlabError
from .catalog import Exercise
from .grader import _run_ranks
from .source import module_source


def _run_once(trial, fn) -> None:
    """The trial of a traced run: ``fn()`` once, its result kept in the rank's report."""
    trial.notes.append(json.dumps(_plain(trial.call(fn))))


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: tensors as nested lists, containers element by element, else its repr."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


RUN = Exercise("run_on_ranks", page="", task="", signature="", solution="", library="", trial=_run_once)
EXERCISES = [RUN]
"""What a rank looks its trial up in (:func:`distlab.exercises.trial.rank_main`); not an exercise of any page."""


@dataclass(frozen=True)
class RankRun:
    """One rank's run: what it printed (the first lines), returned (as JSON holds it) and called, in order."""

    rank: int
    printed: list[str]
    returned: Any
    calls: list[dict]

    def sends(self) -> list[dict]:
        """Its point-to-point sends (``send``, ``isend``), each with ``peer`` and ``bytes``."""
        return [call for call in self.calls if call["op"] in ("send", "isend")]


def run_on_ranks(fn, ranks: int = 3, timeout_s: float = 20.0) -> list[RankRun]:
    """Run ``fn()`` once on each of ``ranks`` gloo ranks on the CPU; each rank's :class:`RankRun`. A rank that
    raises, hangs past ``timeout_s`` or dies is one :class:`~distlab.errors.DistlabError` line."""
    source, fn_name = module_source(fn)
    workdir = Path(tempfile.mkdtemp(prefix="distlab-run-"))
    try:
        (workdir / "solution.py").write_text(source)
        reports, traces, died, ended = _run_ranks(RUN, workdir, fn_name, ranks, "cpu", timeout_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for rank, report in enumerate(reports):
        if report is None or report["status"] != "passed":
            why = (report or {}).get("failure") or {}
            said = why.get("message") or (report or {}).get("error") or ""
            if ended.timed_out:
                said = f"still running after {timeout_s:.0f} s"
            elif rank in died:
                said = f"died with exit code {died[rank]}"
            raise DistlabError(f"run_on_ranks: rank {rank} of {ranks}: {said or 'no report'}")
    return [
        RankRun(rank, report["printed"], json.loads(report["notes"][0]), traces[rank])
        for rank, report in enumerate(reports)
    ]
