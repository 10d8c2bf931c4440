"""Benchmarks, each a torchrun entry point that writes one result file.

Each runs as ``torchrun -m distlab.bench.X``, times its subject the same way (round-robin turns, the slowest
rank's time, medians and quartiles: the module ``harness``), and writes its result through
``distlab.cli.finish_run``. A new benchmark goes here, and its command into ``scripts/reproduce_results.sh``.

May import: core, run, parallel, comm, measure, predict.
"""
