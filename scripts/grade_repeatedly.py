"""Grade every exercise's solution and each typical wrong answer of tests/mistakes_*.py many times, and count
the verdicts: a check whose verdict depends on the machine's load shows up as a split count.

    python scripts/grade_repeatedly.py                                  # every case, 20 times each
    python scripts/grade_repeatedly.py --runs 50 --only zero3_unit,zero1_step

Each case is graded as tests/test_exercises.py grades it: a solution with the default time limit, a wrong
answer with the shorter one a deadlock gets there. A run's verdict is "passed", or the mistake the check named
(its status, such as "stuck", where it named none); a named mistake whose message lacks the text the test looks
for counts apart, as "<mistake> (other message)". One line per case shows its runs as they finish (. as
expected, x not), then a table gives every case's counts. Exits 1 if any run's verdict was not the expected one.

What the ranks themselves write to stderr (gloo's and torch's own logging of a wrong answer's failed collective)
is dropped unless --rank-stderr is given: the verdict already says what went wrong, and a thousand runs of it
would bury the progress lines.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))  # the typical wrong answers, and the limits the tests grade them with

from distlab.exercises import grade  # noqa: E402
from distlab.exercises.catalog import all_exercises  # noqa: E402
from test_exercises import MISTAKES, STUCK_TIMEOUT_S  # noqa: E402

PASSED = "passed"


@dataclass
class Case:
    """One answer to one exercise, graded ``runs`` times."""

    exercise: str
    answer: str
    fn: object
    expected: str
    says: str | None = None  # text a wrong answer's message must hold (its test's)
    timeout_s: float = 20.0
    got: Counter = field(default_factory=Counter)
    first_message: dict[str, str] = field(default_factory=dict)  # an unexpected verdict -> the first such message

    @property
    def as_expected(self) -> bool:
        return set(self.got) <= {self.expected}


def cases(only: set[str] | None) -> list[Case]:
    """The library's solution of every exercise, then its typical wrong answers, in the book's order."""
    found = []
    for name, exercise in all_exercises().items():
        if only and name not in only:
            continue
        found.append(Case(name, "solution", exercise.solution_function(), PASSED))
        for exercise_name, wrong, mistake, says in MISTAKES:
            if exercise_name == name:
                found.append(Case(name, wrong.__name__, wrong, mistake, says, STUCK_TIMEOUT_S))
    return found


def verdict_of(case: Case) -> tuple[str, str]:
    """Grade ``case`` once: what it got, and the message."""
    verdict = grade(case.exercise, case.fn, timeout_s=case.timeout_s)
    if verdict.passed:
        return PASSED, verdict.message
    got = verdict.mistake or verdict.status
    if got == case.expected and case.says and case.says not in verdict.message:
        got += " (other message)"
    return got, verdict.message


def run(case: Case, runs: int, index: int, total: int) -> None:
    print(f"[{index}/{total}] {case.exercise} / {case.answer}: ", end="", flush=True)
    started = time.monotonic()
    for _ in range(runs):
        got, message = verdict_of(case)
        case.got[got] += 1
        if got != case.expected:
            case.first_message.setdefault(got, message)
        print("." if got == case.expected else "x", end="", flush=True)
    seconds = (time.monotonic() - started) / runs
    print(f"  {counts(case)} ({seconds:.1f} s a run)", flush=True)


def counts(case: Case) -> str:
    return ", ".join(f"{verdict} {k}" for verdict, k in case.got.most_common())


def table(graded: list[Case]) -> str:
    rows = [("", "exercise", "answer", "expected", "got")]
    rows += [("" if c.as_expected else "✗", c.exercise, c.answer, c.expected, counts(c)) for c in graded]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows]
    lines.insert(1, "-" * max(map(len, lines)))
    return "\n".join(line.rstrip() for line in lines)


def drop_rank_stderr() -> None:
    """Point file descriptor 2, which the ranks inherit, at /dev/null; this script keeps writing to the old one."""
    kept = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    sys.stderr = os.fdopen(kept, "w", buffering=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="times each case is graded (default 20)")
    parser.add_argument("--only", help="exercises to grade, by name, separated by commas (default: every one)")
    parser.add_argument("--rank-stderr", action="store_true", help="keep what the ranks write to stderr")
    args = parser.parse_args(argv)
    only = {name.strip() for name in args.only.split(",") if name.strip()} if args.only else None
    unknown = sorted((only or set()) - set(all_exercises()))
    if unknown:
        parser.error(f"no exercise is named {', '.join(unknown)}; the exercises are: {', '.join(all_exercises())}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not args.rank_stderr:
        drop_rank_stderr()
    todo = cases(only)
    graded: list[Case] = []
    started = time.monotonic()
    try:
        for index, case in enumerate(todo, 1):
            run(case, args.runs, index, len(todo))
            graded.append(case)
    except KeyboardInterrupt:
        print("\nstopped: the table below holds the cases graded so far", flush=True)
    print(f"\n{len(graded)} case(s), {args.runs} run(s) each, in {(time.monotonic() - started) / 60:.1f} min\n")
    print(table(graded))
    differing = [case for case in graded if not case.as_expected]
    for case in differing:
        for got, message in case.first_message.items():
            print(f"\n{case.exercise} / {case.answer} got {got!r} (expected {case.expected!r}), first such message:")
            print("    " + message.replace("\n", "\n    "))
    print(f"\n{len(differing)} case(s) got a verdict other than the expected one" if differing else "\nas expected")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
