"""The benchmarks, each a torchrun entry point that writes one result file:

* :mod:`.allreduce`: the hand-written all-reduces against ``dist.all_reduce``;
* :mod:`.ddp_step`: forward+backward of the DDP strategies, and one profiled step;
* :mod:`.transfer`: host-to-device copies, pinned memory, copy/compute overlap (CUDA).

:mod:`.harness` holds the timing conventions they share.
"""
