"""Collectives written by hand, and the bytes every collective sends, counted.

* :mod:`.collectives`: ring reduce-scatter, all-gather and all-reduce by hand, and two baselines;
* :mod:`.traffic`: :class:`~.traffic.TrafficCounter`, the bytes each rank sends, counted from the collectives it
  calls (an instrument: it watches a running job).

New here: a collective written by hand, or a way to account for one. A strategy that uses a collective goes to
:mod:`distlab.parallel`; a benchmark of one to :mod:`distlab.bench`.

May import: nothing.
"""
