"""Predictions: analytic models that start no process group and run no rank; most import no torch.

* :mod:`.memory`: the ZeRO paper's bytes per rank, stage by stage, with each implementation's padding;
* :mod:`.traffic`: the bytes a rank sends per step, by strategy;
* :mod:`.alphabeta`: the alpha-beta model of an all-reduce, its time for any size once fitted to a benchmark;
* :mod:`.costmodel`: a step's time and peak memory by strategy; :mod:`.calculator`: the site's calculator rows;
* :mod:`.gpu_specs`: cited GPU and node data (a new GPU's specs go here); :mod:`.gpu_predictions`: the cost
  model on those GPUs;
* :mod:`.streams`: CUDA's stream rules as an executable model; :mod:`.stream_scenarios`: its scenarios and
  predicted speed-ups; :mod:`.stream_results`: the model fed from result files.

Every figure puts one of these next to a measurement (:mod:`distlab.measure`, :mod:`distlab.bench`).

May import: models, results.
"""
