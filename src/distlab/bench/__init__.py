"""Benchmarks, each a torchrun entry point that writes one result file.

Each runs as ``torchrun -m distlab.bench.X``:

* :mod:`.allreduce`: the hand-written all-reduces against ``dist.all_reduce``;
* :mod:`.shard_collectives`: reduce-scatter and all-gather, torch's and the ring, next to all-reduce;
* :mod:`.ddp_step`: forward+backward of the DDP strategies, and one profiled step;
* :mod:`.step`: one optimizer step of each strategy side by side, with its traffic and memory;
* :mod:`.fsdp_options`: one optimizer step of FSDP2 with each option;
* :mod:`.sweep`: DDP, ZeRO-1/2/3 and FSDP2 on GPT presets, with the cost model's calibration;
* :mod:`.host`: the host side of a copy, on the CPU; :mod:`.transfer`: host-to-device copies, pinned memory,
  copy/compute overlap (CUDA).

:mod:`.harness` holds the timing conventions they share. A new benchmark goes here, and its command into
``scripts/reproduce_results.sh``.

May import: spine, parallel, comm, measure, predict.
"""
