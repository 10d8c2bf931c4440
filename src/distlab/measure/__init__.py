"""Instruments that watch a live job or the machine it runs on.

Each returns plain numbers that a result file keeps: every byte a rank holds by what it is, and the machine's
GPUs, peer access, topology and shared memory (what decides NCCL's transport). The bytes a rank sends are
counted in :mod:`distlab.comm.traffic`; what the numbers should be is :mod:`distlab.predict`, which never
imports an instrument.

May import: nothing.
"""
