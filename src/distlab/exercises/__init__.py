"""Exercises the learner solves at the end of each chapter and lab, graded on real ranks in seconds.

``check(name, fn)`` is what a notebook calls: the learner's function shipped to real ranks (gloo on the CPU,
NCCL on two or more GPUs), bounded in time, answered in words. Each chapter has one module of exercises, their
trials and the mistakes they recognise; the answers, as the pages show them, are the sub-package ``solutions``.
The library never imports this package.

May import: runtime, errors, comm, parallel, predict, measure, models, data, testing.
"""

from .grader import Verdict, check, grade, solutions_pass

__all__ = ["Verdict", "check", "grade", "solutions_pass"]
