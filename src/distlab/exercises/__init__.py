"""Exercises the learner solves after each chapter's ideas and in each lab, graded on real ranks in seconds.

``check(name, fn)`` is what a notebook calls: the learner's function shipped to real ranks (gloo on the CPU, or
one NCCL rank per GPU where there is a GPU for each), bounded in time, answered in words. ``run_on_ranks(fn)``
runs a page's own code the same way and hands back what each rank sent, which the pictures of who sends what are
drawn from. Each chapter has one module of exercises, their trials and the mistakes they recognise; the answers,
as the pages show them, are the sub-package ``solutions``.
The library never imports this package.

May import: runtime, errors, comm, parallel, predict, measure, models, data, jobs.
"""

from .grader import Verdict, check, grade, solutions_pass
from .traced import RankRun, run_on_ranks

__all__ = ["RankRun", "Verdict", "check", "grade", "run_on_ranks", "solutions_pass"]
