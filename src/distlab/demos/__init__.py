"""Chapter demos: entry points that run a mistake or an option, and the tables a chapter prints.

Each demo is run as ``torchrun -m distlab.demos.X`` and writes one result file:

* :mod:`.ddp_knobs`: torch DDP's options on a run; BatchNorm vs large-batch equivalence; Join;
* :mod:`.data_mistakes`: the two DDP data mistakes, run and caught;
* :mod:`.fsdp_mistakes`: FSDP2's silent one (gathered parameters kept across a step), run and caught;
* :mod:`.failures`: ranks that skip a collective, call another or another shape, ended by the timeout;
* :mod:`.bad_inputs`: every bad command line as data: the mistake, the line the user sees, the fix;
* :mod:`.fsdp_maps`: FSDP1 -> FSDP2 -> flag, and Accelerate -> flag, as data and markdown.

Demos use the library; the library never imports a demo.

May import: spine, parallel, comm, measure, labs, bench, predict.
"""
