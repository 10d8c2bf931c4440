"""Predictions: analytic models that start no process group and run no rank; most import no torch.

Memory per rank and bytes sent by strategy, the alpha-beta model of a collective, a step's time and peak
memory (the cost model), the site's calculator, cited GPU and node data (a new GPU's specs go here) and the cost
model on them, and CUDA's stream rules as an executable model. Every figure puts one of these next to a
measurement (:mod:`distlab.measure`, :mod:`distlab.bench`).

May import: models, results, comm.
"""
