"""Memory per rank, exactly: every byte a rank holds, by what it is.

* :class:`MemoryTracker` follows every tensor storage from the op that first makes or reads it until it
  is freed, and splits the live bytes into parameters, gradients, optimizer state, gathered parameters
  (whole ones assembled from shards), activations and other memory: now, at the peak, along a timeline.
* :func:`state_bytes` counts what a strategy names (:meth:`.Strategy.state_tensors`), right now.

The model these are compared with, the ZeRO paper's arithmetic, is :mod:`distlab.predict.memory`.

A storage counts once, by its ``nbytes``, however many tensors view it. On CPU these bytes are the
measure (the process's RSS holds the runtime and the allocator's free lists); on CUDA the tracker also
reads ``torch.cuda.max_memory_allocated``, which rounds every block up to 512 bytes.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode


def _dtensor_class() -> type | None:
    """DTensor, once its module is imported (no DTensor can exist before): importing it for a run that never makes
    one would cost each rank about a second (it imports sympy)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # public since torch 2.5
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DTensor"):
            return module.DTensor
    return None


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
        dtensor = _dtensor_class()
        if dtensor is not None and dtensor in types:
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
