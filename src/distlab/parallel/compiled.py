"""Compiling a wrapped model, and noticing when nothing was compiled.

``torch.compile`` says nothing when it compiles nothing: a graph break at a function the compiler must skip (DDP's
``_inside_ddp_forward``, FSDP2's hooks, which ``_fsdp_common._dynamo_disable`` marks "skipping FSDP hooks") ends
the traced frame there, the rest runs eagerly, and a frame whose code is torch's own (``nn.Sequential.forward``,
``nn.Linear.forward``: ``torch._dynamo.trace_rules`` skips ``torch/nn`` as a top-level frame) is never traced on
its own. :class:`GraphCounter` is a dynamo backend that counts the graphs it is handed before it compiles them, so
a run can check that it compiled something (:meth:`GraphCounter.require_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..errors import DistlabError


def graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


class GraphCounter:
    """A dynamo backend (``torch.compile(m, backend=GraphCounter())``) that records each graph it is handed, then
    compiles it with ``backend``: "eager" runs the graph's own forward (no compiler needed), any other name is
    looked up among dynamo's backends ("aot_eager", "inductor")."""

    def __init__(self, backend: str = "eager"):
        self.backend = backend
        self.graphs: list[torch.fx.GraphModule] = []
        self._breaks_before = graph_breaks()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs.append(gm)
        if self.backend == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.backend)(gm, example_inputs)

    @property
    def breaks(self) -> int:
        """Graph breaks counted since this counter was made."""
        return graph_breaks() - self._breaks_before

    def require_graphs(self, what: str) -> int:
        """The number of graphs compiled; none is a DistlabError that says what to do."""
        if not self.graphs:
            raise DistlabError(
                f"compiled nothing: {what} handed the compiler no graph ({self.breaks} graph breaks); compile each "
                "block with torch.compile(block) and then fully_shard it, so that FSDP's hooks stay outside the "
                "compiled call (TORCH_LOGS=graph_breaks shows where it broke)"
            )
        return len(self.graphs)


def compile_blocks(blocks: nn.ModuleList | nn.Sequential, backend: Callable | str) -> None:
    """Replace each block by ``torch.compile(block)`` in place, torchtitan's per-block order: call it before
    ``fully_shard(block)``, so that FSDP's hooks go on the compiled wrapper, outside what is compiled. The
    wrapper's state-dict keys gain ``_orig_mod.`` (:func:`strip_compiled_prefix`)."""
    for index, block in enumerate(blocks):
        blocks[index] = torch.compile(block, backend=backend)


COMPILED_PREFIX = "_orig_mod."
"""What ``torch.compile(module)``'s wrapper (``OptimizedModule``) adds to each key of the module's state dict."""


def strip_compiled_prefix(key: str) -> str:
    """A state-dict key as the uncompiled model names it: ``blocks.0._orig_mod.fc.weight`` -> ``blocks.0.fc.weight``."""
    return key.replace(COMPILED_PREFIX, "")


def compile_for_training(model: nn.Module, strategy: str, backend: str) -> GraphCounter:
    """Compile a wrapped model where its strategy lets the compiler see what it needs, counting the graphs.

    Under FSDP2, each shard unit's ``forward`` (:func:`compiled_forward`): FSDP's hooks stay in the unit's eager
    ``__call__``, outside the compiled frame, as torchtitan's ``torch.compile(block)`` then ``fully_shard`` puts
    them, and the state-dict keys stay the model's own. Otherwise the model inside any DDP-style wrapper
    (``nn.Module.compile``, so that DDP's forward runs it and dynamo's DDPOptimizer cuts the graph at DDP's
    buckets). The counter stays on the model for :func:`require_compiled`."""
    from .checkpoint_state import unwrap

    counter = GraphCounter(backend)
    inner = unwrap(model)
    if strategy == "fsdp":
        for unit in inner.shard_units():
            unit.forward = compiled_forward(unit.forward, counter)
    else:
        inner.compile(backend=counter)
    model.distlab_graph_counter = counter
    return counter


def compiled_forward(forward: Callable, backend: Callable | str) -> Callable:
    """``forward`` compiled inside a frame of distlab's own: dynamo skips a top-level frame whose code is in
    ``torch/nn`` (``nn.Linear.forward``), but inlines it when a traced frame calls it."""

    def call(*args, **kwargs):
        return forward(*args, **kwargs)

    return torch.compile(call, backend=backend)


def require_compiled(model: nn.Module, what: str) -> None:
    """After a step of a model :func:`compile_for_training` compiled: a DistlabError if no graph was compiled."""
    counter = getattr(model, "distlab_graph_counter", None)
    if counter is not None:
        counter.require_graphs(what)
