"""distlab: data-parallel training in PyTorch, from pinned memory to FSDP.

The library behind the course: one training loop for every strategy, the
from-scratch versions the chapters build, and the benchmarks that write
result files with provenance.
"""

__version__ = "0.1.0"
