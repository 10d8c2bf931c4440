"""Memory per rank, exactly: every byte a rank holds, by what it is, next to the ZeRO paper's arithmetic.

* :class:`MemoryTracker` follows every tensor storage from the op that first makes or reads it until it
  is freed, and splits the live bytes into parameters, gradients, optimizer state, gathered parameters
  (whole ones assembled from shards), activations and other memory: now, at the peak, along a timeline.
* :func:`state_bytes` counts what a strategy names (:meth:`.Strategy.state_tensors`), right now.
* :func:`expected_state_bytes`, :func:`expected_gathered_bytes` and :func:`expected_peak_bytes` are the
  model: bytes per parameter by optimizer and precision, divided by the N ranks stage by stage, with
  the padding each implementation really adds.

A storage counts once, by its ``nbytes``, however many tensors view it. On CPU these bytes are the
measure (the process's RSS holds the runtime and the allocator's free lists); on CUDA the tracker also
reads ``torch.cuda.max_memory_allocated``, which rounds every block up to 512 bytes.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

try:  # public since torch 2.5
    from torch.distributed.tensor import DTensor
except ImportError:
    from torch.distributed._tensor import DTensor

CATEGORIES = ("parameters", "gradients", "optimizer_state", "gathered", "activations", "other")
NAMED = ("gathered", "gradients", "optimizer_state", "parameters")
"""The categories a strategy names; a storage named under two counts under the first."""
ACTIVATION_PHASES = ("forward", "backward")
Categories = Callable[[], Mapping[str, Iterable[torch.Tensor]]]


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors with a storage in an op's arguments or results (tensors, and lists, tuples, dicts of them)."""
    if isinstance(tree, torch.Tensor):
        return [tree] if tree.layout == torch.strided and not tree.is_meta else []
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (list, tuple)):
        return []
    return [t for item in tree for t in _tensors(item)]


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """Each tensor's storage once (views and tied weights share one), by identity."""
    return {id(s): s for s in (t.untyped_storage() for t in _tensors(list(tensors)))}


def state_bytes(strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of each category ``strategy.state_tensors`` names right now, each storage once."""
    found = strategy.state_tensors(model, optimizer)
    return {name: sum(s.nbytes() for s in _storages(tensors).values()) for name, tensors in found.items()}


class Sample(NamedTuple):
    """One point of the timeline."""

    event: int
    """Allocations, frees and resizes seen before this sample."""
    phase: str
    total: int
    by_category: dict[str, int]


class _Live:
    """One live storage: its bytes, whether forward or backward made it, the category
    it was last named under, and the weak reference whose callback reports its free."""

    __slots__ = ("nbytes", "activation", "category", "ref")


class MemoryTracker(TorchDispatchMode):
    """Every live storage on this rank, by category: the peak and a timeline.

        with MemoryTracker(lambda: strategy.state_tensors(model, optimizer), model) as tracker:
            train_step(run, batches, sums)
        tracker.peak_bytes, tracker.peak_by_category, tracker.timeline

    ``categories()`` names parameters, gradients, optimizer state and gathered
    parameters. What it never names is ``activations`` if forward or backward
    made it, else ``other``. With ``model`` the phases mark themselves:
    ``forward`` (the model is called), ``backward`` (the autograd engine runs),
    ``optimizer`` (any optimizer steps); :meth:`mark` sets one by hand. The
    timeline samples every mark and every top of the saw-tooth (the last moment
    before memory falls).

    Only weak references are kept, and a storage's free is reported from inside
    its deallocation, where no tensor may be touched: there the tracker only
    notes which storages are live, and asks ``categories()`` at the next op or
    mark. A storage keeps the last category it was named under while it lives.
    While active the tracker also patches ``UntypedStorage.resize_`` (FSDP frees
    and re-allocates gathered parameters with it) and restores it on exit.
    """

    def __init__(self, categories: Categories = dict, model: nn.Module | None = None):
        super().__init__()
        self.categories, self.model = categories, model
        self.phase, self.events, self.current_bytes = "start", 0, 0
        self.peak_bytes, self.peak_phase = 0, "start"
        self.timeline: list[Sample] = []
        self.cuda_max_allocated: int | None = None
        """``torch.cuda.max_memory_allocated()`` of the current device over the tracked span, when CUDA
        was initialised at entry; :attr:`peak_bytes` counts storages on every device together."""
        self._live: dict[int, _Live] = {}
        self._unsettled: list[tuple] = []  # samples whose live storages are not categorised yet
        self._peak_by_category = dict.fromkeys(CATEGORIES, 0)
        self._pending = self._rising = self._active = self._naming = False
        self._undo: list[Callable[[], None]] = []
        self._lock = threading.RLock()

    @property
    def peak_by_category(self) -> dict[str, int]:
        """The breakdown at the moment of the peak (it sums to :attr:`peak_bytes`)."""
        if self._pending and self._active:  # nothing was freed since the peak: the live set is still the peak's
            self.mark(self.phase)
        return dict(self._peak_by_category)

    def mark(self, phase: str) -> None:
        """Label what follows (``"forward"`` and ``"backward"`` make activations); samples the timeline."""
        self.phase = phase
        self._snapshot()
        self._settle()

    def current_by_category(self) -> dict[str, int]:
        """Live bytes by category now (after exit: at exit)."""
        if not self._active:
            return dict(self.timeline[-1].by_category) if self.timeline else dict.fromkeys(CATEGORIES, 0)
        self._name_storages()
        return self._totals((live, live.nbytes) for live in list(self._live.values()))

    def _name_storages(self) -> None:
        """Ask ``categories()`` which storages are what (never from inside a free)."""
        named, self._naming = {}, True  # its own ops (a DTensor's to_local) must not settle
        try:
            found = self.categories()
        finally:
            self._naming = False
        for name in reversed(NAMED):  # the first of NAMED wins
            for key, storage in _storages(found.get(name, [])).items():
                named[key] = (name, storage)
        for key, (name, storage) in named.items():
            if key not in self._live:
                self._see(storage, activation=False)  # named, but made outside the dispatcher
            self._live[key].category = name

    @staticmethod
    def _totals(snapshot) -> dict[str, int]:
        totals = dict.fromkeys(CATEGORIES, 0)
        for live, nbytes in snapshot:
            totals[live.category or ("activations" if live.activation else "other")] += nbytes
        return totals

    def _snapshot(self) -> None:
        """Note the live storages and their sizes now; categorised later by :meth:`_settle`."""
        with self._lock:
            lives, is_peak, self._pending = list(self._live.values()), self._pending, False
            noted = [(live, live.nbytes) for live in lives]
            self._unsettled.append((self.events, self.phase, self.current_bytes, noted, is_peak))

    def _settle(self) -> None:
        if not self._unsettled or self._naming:
            return
        self._name_storages()
        with self._lock:
            unsettled, self._unsettled = self._unsettled, []
        for event, phase, total, snapshot, is_peak in unsettled:
            self.timeline.append(Sample(event, phase, total, self._totals(snapshot)))
            if is_peak:
                self._peak_by_category = self.timeline[-1].by_category

    def _change(self, delta: int) -> None:
        """Every allocation, free and resize passes here, the lock held. Frees come from inside a
        storage's deallocation, on whichever thread dropped it: no tensor may be touched here."""
        if delta < 0 and self._rising:  # the top of a tooth: note it before it falls
            self._snapshot()
        if delta:
            self._rising = delta > 0
        self.events += 1
        self.current_bytes += delta
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_phase, self._pending = self.current_bytes, self.phase, True

    def _see(self, storage: torch.UntypedStorage, activation: bool) -> None:
        key = id(storage)
        with self._lock:
            if key in self._live:
                return
            live = self._live[key] = _Live()
            live.nbytes, live.activation, live.category = storage.nbytes(), activation, None
            live.ref = weakref.ref(storage, lambda _, key=key: self._freed(key))
            self._change(live.nbytes)

    def _freed(self, key: int) -> None:
        with self._lock:
            live = self._live.get(key)
            if live is not None:
                self._change(-live.nbytes)  # a tooth's top is noted first, the dying storage still in it
                del self._live[key]

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        with self._lock:
            live = self._live.get(id(storage))
            if live is not None:
                self._change(nbytes - live.nbytes)
                live.nbytes = nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # DTensor runs its local ops, which come back here
        if self.model is not None and self.phase != "backward" and torch._C._current_graph_task_id() != -1:
            self.mark("backward")
        self._settle()
        for t in _tensors((args, kwargs)):  # made before tracking, first used now
            self._see(t.untyped_storage(), activation=False)
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self._see(t.untyped_storage(), activation=self.phase in ACTIVATION_PHASES)
        return out

    def __enter__(self) -> MemoryTracker:
        self._active = True
        self._name_storages()  # what exists already: the model's parameters, the optimizer's state
        self.mark(self.phase)
        original = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            self._resized(storage, nbytes)  # before the resize: a shrink notes the tooth's top first
            result = original(storage, nbytes)
            self._see(storage, activation=self.phase in ACTIVATION_PHASES)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._undo.append(lambda: setattr(torch.UntypedStorage, "resize_", original))
        if self.model is not None:
            handles = [
                self.model.register_forward_pre_hook(lambda *_: self.mark("forward"), prepend=True),
                register_optimizer_step_pre_hook(lambda *_: self.mark("optimizer")),
            ]
            self._undo += [handle.remove for handle in handles]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self.cuda_max_allocated = 0
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.mark("end")  # also settles a peak still pending
        self._active = False
        while self._undo:
            self._undo.pop()()
        self._live.clear()  # drops the weak references and their callbacks
        if self.cuda_max_allocated is not None:
            self.cuda_max_allocated = torch.cuda.max_memory_allocated()


# The analytic model. Bytes per parameter value: (parameters, gradients, optimizer state).
# "mixed" is the ZeRO paper's mixed precision: fp16/bf16 parameters and gradients, and in the
# optimizer state an fp32 master copy beside Adam's two moments. distlab's --precision bf16/fp16
# is autocast over fp32 parameters: its state is "fp32".
BYTES_PER_VALUE = {
    ("adam", "fp32"): (4, 4, 8),  # exp_avg, exp_avg_sq
    ("adamw", "fp32"): (4, 4, 8),
    ("sgd", "fp32"): (4, 4, 4),  # momentum_buffer
    ("adam", "mixed"): (2, 2, 12),  # fp32 master, exp_avg, exp_avg_sq
    ("adamw", "mixed"): (2, 2, 12),
    ("sgd", "mixed"): (2, 2, 8),  # fp32 master, momentum
}
STEP_COUNTER_BYTES = {"adam": 4, "adamw": 4, "sgd": 0}
"""torch's Adam keeps one float32 scalar ``step`` per parameter tensor it steps (on the CPU
unless capturable or fused, even when training on CUDA); SGD keeps none."""
STAGE = {"single": 0, "ddp": 0, "naive_ddp": 0, "bucketed_ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
"""ZeRO stage: 1 shards the optimizer state over the ranks, 2 also the gradients, 3 also the parameters."""
Shape = Sequence[int]


def shard_unit_shapes(model: nn.Module) -> list[list[torch.Size]]:
    """Trainable parameter shapes (each parameter once) of every shard unit of an
    unwrapped model, in order, and last those left to the root (perhaps none)."""
    seen: set[int] = set()
    units = []
    for unit in [*model.shard_units(), model]:
        fresh = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in fresh)
        units.append([p.shape for p in fresh])
    return units


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _rows(shape: Shape) -> tuple[int, int]:
    """dim 0 and the values in one dim-0 row (a scalar is one row of one)."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def _values_per_rank(strategy: str, n: int, units: Sequence[Sequence[Shape]], rank: int) -> tuple[int, int, int, int]:
    """Values one rank holds of (parameters, gradients, optimizer state), and its step counters."""
    shapes = [shape for unit in units for shape in unit]
    if strategy == "fsdp":  # FSDP2: every parameter's dim 0 padded to a multiple of N, shard = ceil(dim0/N) rows;
        # the optimizer's state has only this rank's own rows (torch.chunk's split, no padding)
        padded = sum(_ceil(d0, n) * row for d0, row in map(_rows, shapes))
        own = sum(max(0, min(_ceil(d0, n), d0 - rank * _ceil(d0, n))) * row for d0, row in map(_rows, shapes))
        return padded, padded, own, len(shapes)
    if strategy == "zero3":  # one flat buffer per shard unit, padded to a multiple of N; one optimizer tensor a unit
        shard = sum(_ceil(sum(math.prod(s) for s in unit), n) for unit in units)
        return shard, shard, shard, sum(1 for unit in units if unit)
    total, stage = sum(math.prod(s) for s in shapes), STAGE[strategy]
    shard = _ceil(total, n)  # zero1/zero2: one flat buffer over every trainable parameter, padded to a multiple of N
    if stage == 0:
        return total, total, total, len(shapes)
    # the parameters live in that padded buffer; the optimizer steps a view of this rank's slice of it
    return shard * n, shard if stage == 2 else total, shard, 1


def expected_state_bytes(
    parameters: int,
    strategy: str,
    world_size: int,
    optimizer: str = "adam",
    precision: str = "fp32",
    units: Sequence[Sequence[Shape]] | None = None,
    rank: int = 0,
) -> dict[str, int]:
    """Bytes of ``parameters``, ``gradients`` (as the optimizer steps) and ``optimizer_state`` on one rank.

    Replicated strategies (single, ddp, naive_ddp, bucketed_ddp) hold everything;
    zero1 divides the optimizer state by N, zero2 also the gradients, zero3 and
    fsdp also the parameters. A divided value is ``ceil(values / N)`` of the
    padded buffer the implementation really cuts:

    * zero1, zero2: one flat buffer over all trainable parameters;
    * zero3: one flat buffer per shard unit;
    * fsdp (FSDP2): each parameter on its own, dim 0 padded to a multiple of N; its
      Adam state is unpadded, this ``rank``'s own rows (rank 0 holds the most).

    Adam's ``step`` counters count one per tensor stepped: every parameter, but one flat
    shard for zero1/zero2 and one per unit for zero3. ``units`` are the trainable
    parameters' shapes by shard unit (:func:`shard_unit_shapes`); without them the model
    is one flat tensor of ``parameters`` values: exact for zero1/zero2, for the others
    without per-parameter padding and with one step counter. distlab's zero1/zero2 also
    keep the fp32 slice they step (``ShardedOptimizer.shard``, 4 bytes a value of the
    shard), which their ``state_tensors`` does not name: a tracker counts it as other."""
    units = [[(parameters,)]] if units is None else units
    if sum(math.prod(s) for unit in units for s in unit) != parameters:
        raise ValueError(f"the shapes in units hold a different number of values than parameters={parameters}")
    if strategy not in STAGE or (optimizer, precision) not in BYTES_PER_VALUE:
        raise ValueError(f"no model for {strategy} with {optimizer} in {precision}: see STAGE and BYTES_PER_VALUE")
    values = _values_per_rank(strategy, world_size, units, rank)
    per_value = BYTES_PER_VALUE[optimizer, precision]
    return {
        "parameters": values[0] * per_value[0],
        "gradients": values[1] * per_value[1],
        "optimizer_state": values[2] * per_value[2] + values[3] * STEP_COUNTER_BYTES[optimizer],
    }


def expected_gathered_bytes(
    strategy: str, world_size: int, units: Sequence[Sequence[Shape]], bytes_per_value: int = 4
) -> int:
    """The most whole (gathered, padded) parameters zero3 or fsdp hold at once; 0 for the others.

    ``units`` as from :func:`shard_unit_shapes`, the root's last. Both keep the root gathered from
    forward into backward (it is needed first), and with ``reshard_after_forward`` and no prefetch
    gather one other unit at a time: FSDP2 pads each parameter's dim 0, zero3 the unit's flat buffer."""
    n = world_size
    if strategy == "fsdp":
        gathered = [sum(_ceil(d0, n) * n * row for d0, row in map(_rows, unit)) for unit in units]
    elif strategy == "zero3":
        gathered = [_ceil(sum(math.prod(s) for s in unit), n) * n for unit in units]
    else:
        return 0
    return (gathered[-1] + max(gathered[:-1], default=0)) * bytes_per_value


def expected_peak_bytes(state: Mapping[str, int], gathered: int, activations: int) -> int:
    """The peak the model predicts: the state, the gathered parameters (:func:`expected_gathered_bytes`)
    and the activations (measured: they depend on batch, sequence and model, not on the strategy)."""
    return state["parameters"] + state["gradients"] + state["optimizer_state"] + gathered + activations
