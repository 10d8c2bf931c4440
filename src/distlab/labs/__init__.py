"""What the lab notebooks need around the library: a torchrun job from a notebook cell.

Build a torchrun command line, parse it first, run it, read the result it wrote, say why it failed. The set-up
cell every lab starts with is ``scripts/lab_setup.py``; the GPUs a lab got are surveyed by
:mod:`distlab.measure.hardware`, whose NCCL transport every NCCL job launched from here runs with.

May import: runtime, errors, cli, config, results, jobs, data, measure.
"""
