"""Exercises the learner solves at the end of each chapter and lab, graded on real ranks in seconds.

* :mod:`.grader`: ``check(name, fn)``, what a notebook calls: the learner's function shipped to real ranks
  (gloo on the CPU, NCCL on two or more GPUs), bounded in time, answered in words;
* :mod:`.trial`: what each rank runs: cases, comparisons with the library's answer, traced communication;
* :mod:`.source`: a notebook function as a module other processes can import;
* :mod:`.catalog`: what an exercise is, and every exercise by name;
* one module a chapter (``ring``, ``ddp``, ...): its exercises, their trials and the mistakes they recognise;
* :mod:`.solutions`: the answers, as the pages show them.

The library never imports this package.

May import: runtime, errors, comm, parallel, predict, measure, models, data, testing.
"""

from .grader import Verdict, check, grade, solutions_pass

__all__ = ["Verdict", "check", "grade", "solutions_pass"]
