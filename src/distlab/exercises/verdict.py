"""The notebook side's answer: what every rank reported and traced, read into one message.

Once a check's ranks have ended (:mod:`.grader` started them), :func:`verdict_from` reads each rank's report (passed,
wrong, the learner's exception) and its trace of calls (:mod:`.trace`), and says one thing: right, the first
thing that went wrong and the mistake it looks like, or, when the ranks waited for each other, who waited in
which call and why (:func:`_stuck`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .trace import RECEIVES, sent_elsewhere


@dataclass(frozen=True)
class Verdict:
    """What a check found. ``status``: passed, wrong, raised, stuck, died, not_filled, refused, grader."""

    exercise: str
    status: str
    message: str
    mistake: str | None = None
    ranks: int = 0
    device: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Ended:
    """How a check's ranks ended: ``elapsed_s`` after they started, stopped by the grader (``timed_out``, after
    ``timeout_s``) or on their own, as when the ranks a peer waits for stop and close their connections."""

    elapsed_s: float
    timed_out: bool
    timeout_s: float


WRITE_IT = "Write its body in the cell above, run that cell, then run this one again."


def ranks_said(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 1 and 2``, ``ranks 1, 2 and 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def where_checked(device: str, world: int) -> str:
    return f"{world} {'NCCL rank' if device == 'cuda' else 'gloo rank'}{'s' if world > 1 else ''}"


def verdict_from(exercise, reports, traces, died, world, device, ended: Ended) -> Verdict:
    name, where = exercise.name, where_checked(device, world)

    def verdict(status: str, message: str, mistake: str | None = None) -> Verdict:
        if mistake and mistake in exercise.mistakes:
            message += f"\n  Looks like: {exercise.mistakes[mistake]}"
        elif mistake and mistake in COMMON_MISTAKES:
            message += f"\n  Looks like: {COMMON_MISTAKES[mistake]}"
        for report in reports:
            if report is not None and report.get("printed"):
                lines = "".join(f"\n    {line}" for line in report["printed"])
                message += f"\n  rank {report['rank']} printed:{lines}"
        return Verdict(name, status, message, mistake, world, device)

    present = [r for r in reports if r is not None]
    graders = [r for r in present if r["status"] == "grader"]
    if graders:
        return verdict(
            "grader", f"✗ {name}: the grader itself failed on rank {graders[0]['rank']}: {graders[0]['error']}"
        )
    if len(present) == world and all(r["status"] == "passed" for r in present):
        cases = present[0]["cases"]
        notes = "".join(f"\n  {note}" for note in present[0]["notes"])
        return verdict(
            "passed", f"✓ {name}: right on every rank ({where}), {len(cases)} case(s): {', '.join(cases)}.{notes}"
        )

    failures = [r["failure"] for r in present if r.get("failure")]
    own = [f for f in failures if f["kind"] == "raised" and not f["collective"]]
    if own:
        first = min(own, key=lambda f: f["time"])
        if first["error"] == "NotImplementedError":
            said = f"✎ {name}: your function still raises NotImplementedError. {exercise.task} {WRITE_IT}"
            return verdict("not_filled", said)
        line = f" at line {first['line']} of your `{first['function']}`: {first['code']}" if first["line"] else ""
        mistake = exercise.on_error(first) if exercise.on_error else None
        text = (
            f"✗ {name} ({where}), case {first['case']!r}: rank {first['rank']} raised {first['error']}{line}\n"
            f"  {first['error']}: {first['message']}"
        )
        return verdict("raised", text, mistake)
    waiting = [f for f in failures if f["kind"] == "raised" and f["collective"]] or len(present) < world
    wrong = [f for f in failures if f["kind"] == "wrong"]
    first_wrong_case = min((_case_index(present, f) - 1 for f in wrong), default=None)
    stuck_cases = [p["case"] for p in map(_pending, traces) if p is not None]
    # a rank that stopped at a wrong answer leaves its peers waiting in the next case: the answer came first
    wrong_came_first = first_wrong_case is not None and stuck_cases and first_wrong_case < min(stuck_cases)
    if waiting and _collective_counts_differ(traces) and not wrong_came_first:
        return _stuck(exercise, reports, traces, where, ended, verdict)
    if wrong:
        # the first case that failed, on the rank whose answer tells the mistake apart if one does
        first = min(wrong, key=lambda f: (_case_index(present, f), not f["certain"], f["mistake"] is None, f["rank"]))
        others = sorted({f["rank"] for f in wrong} - {first["rank"]})
        also = f" ({ranks_said(others)} wrong too)" if others else ""
        text = (
            f"✗ {name} ({where}), case {first['case']!r}: rank {first['rank']}'s {first['what']} is wrong{also}.\n"
            f"  {first['detail']}"
        )
        return verdict("wrong", text, first.get("mistake"))
    if died:
        rank, code = min(died.items())
        return verdict(
            "died",
            f"✗ {name} ({where}): rank {rank} ended (exit code {code}) before it finished, and "
            f"the other ranks' collectives with it failed. Something in your function ended the process.",
        )
    return _stuck(exercise, reports, traces, where, ended, verdict)


def _case_index(reports: list[dict], failure: dict) -> int:
    for report in reports:
        if report["rank"] == failure["rank"]:
            return len(report["cases"])
    return 0


def _pending(calls: list[dict]) -> dict | None:
    """The call a rank was blocked in: the last one that never returned (an irecv counts as pending when the
    learner waits on it; the trace cannot see that wait, so a trailing irecv counts)."""
    for call in reversed(calls):
        if not call.get("done"):
            return call
    return None


def _describe(call: dict | None) -> str:
    if call is None:
        return "no call of torch.distributed"
    peer = f" {'from' if call['op'] in RECEIVES else 'to'} rank {call['peer']}" if call.get("peer") is not None else ""
    return f"{call['op']}{peer} (its call {call['n']})"


COLLECTIVES_COUNTED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
                       "reduce_scatter", "reduce", "gather", "scatter", "barrier", "all_to_all_single")  # fmt: skip

COMMON_MISTAKES = {
    "all_receive_first": (
        "every rank is waiting to receive and none is sending. Post each send with its receive "
        "(dist.isend then dist.recv, or both in one dist.batch_isend_irecv), or let even ranks send first."
    ),
    "all_send_first": (
        "every rank is blocked in dist.send and none has reached its dist.recv. A blocking send returns only "
        "once the receiver takes the message (gloo waits for the matching receive however small the message). "
        "Post the send without waiting (dist.isend, then dist.recv, then wait), or both in one dist.batch_isend_irecv."
    ),
    "collective_mismatch": (
        "the ranks did not call the same collectives the same number of times. A collective returns only "
        "when every rank of the group has called it: an `if rank == ...` around one, or a loop whose length "
        "differs by rank, leaves the others waiting."
    ),
    "unmatched_p2p": (
        "a send or receive with no partner: every dist.send to rank k needs a dist.recv from this rank on "
        "rank k, of the same size, and the other way round."
    ),
    "wrong_peer": (
        "a receive names a rank that sends to another one (or a send a rank that receives from another): every "
        "send from rank p to rank r needs a receive on rank r that names p. Work out who sends to whom, then name "
        "the sender in each receive."
    ),
}


def _collective_counts(traces: list[list[dict]]) -> list[dict[str, int]]:
    return [
        {op: sum(1 for c in calls if c["op"] == op) for op in COLLECTIVES_COUNTED if any(c["op"] == op for c in calls)}
        for calls in traces
    ]


def _collective_counts_differ(traces: list[list[dict]]) -> bool:
    counts = _collective_counts(traces)
    return any(c != counts[0] for c in counts)


def _stuck(exercise, reports, traces, where, ended: Ended, verdict) -> Verdict:
    name = exercise.name
    counts = _collective_counts(traces)
    lines, waited, elsewhere = [], [], []
    for rank, calls in enumerate(traces):
        report = reports[rank]
        failure = report.get("failure") if report else None
        if report is not None and report["status"] == "passed":
            lines.append(f"rank {rank} finished")
        elif failure and failure["kind"] == "wrong":
            lines.append(f"rank {rank} did not wait: your function returned, and its {failure['what']} was wrong "
                         f"(case {failure['case']!r})")  # fmt: skip
        else:
            place = f", at line {failure['line']}: {failure['code']}" if failure and failure.get("line") else ""
            other = sent_elsewhere(traces, rank, _pending(calls))
            lines.append(f"rank {rank} waited in {_describe(_pending(calls))}{place}{other}")
            waited.append(rank)
            elsewhere += [rank] if other else []
    pending = [
        _pending(calls) for rank, calls in enumerate(traces) if not (reports[rank] or {}).get("status") == "passed"
    ]
    if any(c != counts[0] for c in counts):
        mistake = "collective_mismatch"
        said = "; ".join(
            f"rank {r}: " + (", ".join(f"{op} x{k}" for op, k in c.items()) or "none") for r, c in enumerate(counts)
        )
        lines.append(f"collectives called: {said}")
    elif elsewhere:
        mistake = "wrong_peer"
    elif pending and all(p is not None and p["op"] in RECEIVES for p in pending):
        mistake = "all_receive_first"
    elif pending and all(p is not None and p["op"] == "send" for p in pending):
        mistake = "all_send_first"
    else:
        mistake = "unmatched_p2p"
    stopped = len(waited) < len(traces)
    if ended.timed_out or ended.elapsed_s >= ended.timeout_s:  # stopped by the grader, or by the ranks' own timeout
        head = f"the ranks waited for each other and never finished (stopped after {ended.timeout_s:g} s)."
    elif stopped and waited:  # a rank that stops closes its connections, and a peer waiting on it fails at once
        who = f"rank{'s' if len(waited) > 1 else ''} {', '.join(map(str, waited))}"
        head = (
            f"the ranks did not make matching calls: {who} waited for ranks that had stopped, and the check "
            f"ended after {ended.elapsed_s:.1f} s."
        )
    else:
        head = f"the ranks waited for each other, and the check ended after {ended.elapsed_s:.1f} s."
    return verdict("stuck", f"✗ {name} ({where}): {head}\n  " + "\n  ".join(lines), mistake)
