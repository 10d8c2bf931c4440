"""What an exercise is, and every exercise by name.

An exercise names the function the learner writes (its ``signature``, shown as the page's stub), the solution
in :mod:`distlab.exercises.solutions` (the page's collapsed answer, graded by the build), the library code it
is, how many ranks it runs on, and its ``trial``: what each rank runs against the library's answer. Its
``mistakes`` say, for each typical wrong answer its trial recognises, what it looks like and what to change.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import DistlabError

CHAPTERS = (
    "first_run",
    "ddp",
    "pinned",
    "ring",
    "zero",
    "fsdp2",
    "costs",
    "accumulation",
    "compile",
    "checkpointing",
    "fp16",
    "hooks",
    "profiling",
    "troubleshooting",
)
"""The modules of this package that hold exercises, in the book's order; each defines ``EXERCISES``."""


@dataclass(frozen=True)
class Exercise:
    name: str
    """What ``check`` takes: ``check("ring_reduce_scatter", my_function)``."""
    page: str
    """The book page that holds it (a file under ``book/`` without ``.md``, or ``labs/<lab>``): its stub, its
    ``check`` cell and its solution, right after the idea it practises."""
    task: str
    """What to write, in a sentence or two."""
    signature: str
    """The stub's first line, e.g. ``def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:``."""
    solution: str
    """The solution's name in ``distlab.exercises.solutions`` (``module.function``)."""
    library: str
    """The library code the solution is, or that grades it (dotted path)."""
    trial: Callable
    """``trial(t, fn)`` on every rank: run ``fn`` on cases and compare (see :class:`.trial.Trial`)."""
    ranks: int = 3
    """Ranks it runs on by default: one NCCL rank per GPU on a machine with that many GPUs, else gloo ranks on the
    CPU (never fewer ranks unless the learner asks)."""
    min_ranks: int = 1
    """The fewest ranks on which its typical mistakes differ from a right answer (a ring's rank + 1 and rank - 1
    are one rank on two). Checked on fewer, as a learner may ask, a right answer is checked again on this many
    gloo ranks on the CPU."""
    min_ranks_why: str = ""
    """Why fewer ranks cannot tell its mistakes apart, said after "on 2 gloo ranks"."""
    mistakes: dict[str, str] = field(default_factory=dict)
    """Mistake name -> what it looks like and what to do: the hint a recognised wrong answer gets."""
    on_error: Callable[[dict], str | None] | None = None
    """A learner exception (the trial's report) -> a mistake name, where an exception tells a typical mistake."""
    pages: tuple[str, ...] = ()
    """Further pages (labs) that hold this exercise too."""

    def solution_function(self) -> Callable:
        module, _, function = self.solution.rpartition(".")
        return getattr(importlib.import_module(f"distlab.exercises.solutions.{module}"), function)


def all_exercises() -> dict[str, Exercise]:
    found: dict[str, Exercise] = {}
    for chapter in CHAPTERS:
        for exercise in importlib.import_module(f"distlab.exercises.{chapter}").EXERCISES:
            if exercise.name in found:
                raise DistlabError(f"two exercises are named {exercise.name!r}")
            found[exercise.name] = exercise
    return found


def get(name: str) -> Exercise:
    exercises = all_exercises()
    if name not in exercises:
        raise DistlabError(f"no exercise is named {name!r}; the exercises are: {', '.join(sorted(exercises))}")
    return exercises[name]
