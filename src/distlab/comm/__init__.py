"""Collectives written by hand, and the bytes every collective sends, counted.

New here: a collective written by hand, or a way to account for one. A strategy that uses a collective goes to
:mod:`distlab.parallel`; a benchmark of one to :mod:`distlab.bench`.

May import: nothing.
"""
