"""Chapter demos: entry points that run a mistake or an option, and the tables a chapter prints.

Each demo is run as ``torchrun -m distlab.demos.X`` and writes one result file that its chapter reads. Demos use
the library; the library never imports a demo.

May import: core, run, parallel, comm, measure, labs, bench, predict.
"""
