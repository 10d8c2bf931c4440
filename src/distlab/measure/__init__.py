"""Instruments that watch a live job or the machine it runs on.

Each returns plain numbers that a result file keeps:

* :mod:`.memory`: :class:`~.memory.MemoryTracker`, every byte a rank holds by what it is, and ``state_bytes``;
* :mod:`.hardware`: the GPUs a machine has, peer access, topology, /dev/shm: what decides NCCL's transport.

The bytes a rank sends are counted in :mod:`distlab.comm.traffic`; what the numbers should be is
:mod:`distlab.predict`, which never imports an instrument.

May import: nothing.
"""
