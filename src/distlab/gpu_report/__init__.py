"""One command that runs every GPU path the course has and writes one report folder; the book reads them.

    python -m distlab.gpu_report --out gpu-reports --contributor "your name"

* :mod:`.run`: what runs where (host-to-device copies, NCCL's collectives over sizes, the sweep of every
  strategy in mixed precision, FSDP2's prefetch, offload and checkpointing, SyncBatchNorm), each a benchmark
  of :mod:`distlab.bench` or a demo under torchrun with a time limit, and what it skipped and why. Without a
  GPU the same code runs on gloo ranks, so no GPU path goes unexecuted.
* :mod:`.summary`: what a report says at a glance, computed from its result files (bus bandwidth and its
  alpha-beta fit, copy bandwidth, each strategy measured against the course's models).
* :mod:`.schema`: what a report holds, the check a contributed one must pass before the book shows it,
  and the markdown the book's "Measured on GPUs" page prints.

May import: spine, parallel, comm, measure, labs, bench, predict, plots.
"""
