"""One command that runs every GPU path the course has and writes one report folder; the book reads them.

    python -m distlab.gpu_report --out gpu-reports --contributor "your name"

What runs where, each a benchmark of :mod:`distlab.bench` or a demo under torchrun with a time limit; what a
report says at a glance, computed from its result files; and the check a contributed report must pass before
the book shows it. Without a GPU the same entry points run on gloo ranks up to the device call; what only a GPU
executes (NCCL, CUDA streams and memory, FSDP2's offload) is the GPU tier's, ``python -m pytest -m gpu``.

May import: core, run, parallel, comm, measure, labs, bench, predict, plots.
"""
