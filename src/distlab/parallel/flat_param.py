"""Parameters laid end to end in one flat buffer, cut into equal shards.

Every ZeRO stage works on this picture: the ``numel`` values of a group of
parameters, padded with zeros to a multiple of the world size ``N``, so that
rank ``r`` owns exactly ``ceil(numel / N)`` consecutive values. Equal
shards are what ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
move; the padding is never read as a parameter.

A checkpoint saves a rank's slice as its piece of the *unpadded* flat
vector (:meth:`FlatParams.shard_as_dtensor`): ``ceil(numel / N)`` values per
rank is exactly how ``torch.chunk`` and a DTensor's ``Shard(0)`` split
``numel`` values, so ``torch.distributed.checkpoint`` knows where every
piece sits and can load it on any number of ranks.

ZeRO-3 keeps the parameters of the modules it replicates in the same picture
over one rank (:class:`ReplicatedUnit`): one flat buffer, whole on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.collectives import ring_all_gather, ring_reduce_scatter
from ..comm.implementations import default_implementation
from ..errors import DistlabError
from .base import MixedPrecision

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class FlatParams:
    """How a list of tensors maps onto one padded flat buffer, and which slice this rank owns."""

    def __init__(self, params: list[torch.Tensor], world_size: int, rank: int):
        if not params:
            raise ValueError("nothing to flatten: no parameter requires a gradient")
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-self.numel // world_size)
        self.padded_numel = self.shard_numel * world_size
        self.shard = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def flatten(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """One padded flat copy of ``tensors`` (shaped like the parameters; ``None`` counts as zeros)."""
        first = self.params[0]
        flat = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        for view, tensor in zip(self.views(flat), tensors):
            if tensor is not None:
                view.copy_(tensor)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter (the padding left out)."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def shard_pieces(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Views of this rank's slice (``values``: ``shard_numel`` long) that fall inside each parameter, in
        order: the part of every parameter this rank holds, empty where it holds none."""
        pieces, offset = [], 0
        for p in self.params:
            start, stop = (min(max(at - self.shard.start, 0), self.shard_numel) for at in (offset, offset + p.numel()))
            pieces.append(values[start:stop])
            offset += p.numel()
        return pieces

    def shard_as_dtensor(self, values: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """This rank's slice of a flat buffer (``values``: ``shard_numel`` long, padding
        included) as its ``Shard(0)`` piece of the unpadded ``numel``-long vector. It
        shares memory with ``values``, so a checkpoint load writes straight into them.
        ``mesh`` lists the owner of each segment (:func:`segment_owners_mesh`)."""
        valid = max(0, min(self.numel, self.shard.stop) - self.shard.start)
        from torch.distributed.tensor import DTensor, Shard  # with sympy: a second a DDP rank need not pay

        return DTensor.from_local(
            values.detach()[:valid], mesh, [Shard(0)], run_check=False, shape=(self.numel,), stride=(1,)
        )

    def shard_state_as_dtensors(self, key: str, state: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict:
        """An optimizer's state for this rank's slice, each entry keyed ``key.name``: a per-value tensor
        (Adam's moments) as its DTensor piece (:meth:`shard_as_dtensor`), a scalar (Adam's step) as is."""
        return {
            f"{key}.{name}": self.shard_as_dtensor(value, mesh)
            if value.dim() == 1 and value.numel() == self.shard_numel
            else value
            for name, value in state.items()
        }


class ReplicatedUnit:
    """The trainable parameters of the ``replicate`` modules, whole on every rank as under DDP: laid end to
    end in one flat buffer (a :class:`.flat_param.FlatParams` over one rank: no padding, no slice), which the
    optimizer steps. When backward ends, one all-reduce averages all their gradients. Under a ``param_dtype``
    the modules compute on a copy in it, refreshed from the stepped values before each forward."""

    def __init__(self, params: list[nn.Parameter], group=None, precision: MixedPrecision = MixedPrecision()):
        self.group, self.world_size = group, dist.get_world_size(group)
        self.layout = FlatParams(params, 1, 0)
        self.shard = nn.Parameter(self.layout.flatten([p.detach() for p in params]))  # whole, named as units name it
        self.full = self.shard.detach().to(precision.param_dtype or self.shard.dtype)  # the same storage in fp32
        self.reduce_dtype = precision.reduce_dtype or self.full.dtype
        for param, view in zip(params, self.layout.views(self.full)):
            param.data = view  # the modules compute with views of the stepped values (or of their copy)
        self.ready: set[int] = set()

    def refresh(self) -> None:
        """Before a forward: a low-precision copy takes the values the optimizer last stepped."""
        if self.full.data_ptr() != self.shard.data_ptr():
            self.full.copy_(self.shard.detach())

    def gather_stepped_values(self) -> torch.Tensor:
        return self.shard.detach()  # whole already: no collective

    def stepped(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s values in the buffer the optimizer steps (a view)."""
        return next(v for p, v in zip(self.layout.params, self.layout.views(self.shard.detach())) if p is param)

    def completes_with(self, param: nn.Parameter) -> bool:
        return False  # nothing starts until backward ends, so no reduce-scatter need finish first

    def gradient_ready(self, param: nn.Parameter, sync: bool) -> None:
        self.ready.add(id(param))

    def end_backward(self, sync: bool) -> nn.Parameter | None:
        """Average the gradients over ranks (unless under ``no_sync``, or none arrived); return a parameter
        that got no gradient while others did, without reducing anything, else None."""
        arrived, self.ready = self.ready, set()
        missing = next((p for p in self.layout.params if id(p) not in arrived), None) if arrived else None
        if sync and arrived and missing is None:
            flat = self.layout.flatten([p.grad for p in self.layout.params]).to(self.reduce_dtype)
            for p in self.layout.params:
                p.grad = None  # the averaged gradient lives on as shard.grad, what the optimizer steps
            dist.all_reduce(flat.div_(self.world_size), group=self.group)
            summed = flat.to(self.shard.dtype)
            self.shard.grad = summed if self.shard.grad is None else self.shard.grad.add_(summed)
        return missing


def segment_owners_mesh(device_type: str, owners: list[int]) -> DeviceMesh:
    """A one-dimensional mesh whose entry ``i`` is the rank that holds segment ``i``
    (``range(N)`` with torch's collectives; the ring's shifts it by one), so each rank's
    ``Shard(0)`` offset is where its slice sits. Only offsets are read from it:
    it creates no process group."""
    return DeviceMesh(device_type, owners, _init_backend=False)


def _single_tensor_collectives():
    """torch 2.13 renamed the equal-shard collectives (the old names warn there);
    Kaggle's torch 2.10-2.11 still has only the old ones."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return all_gather, reduce_scatter


def all_gather_flat(shard: torch.Tensor, padded_numel: int, group=None) -> torch.Tensor:
    """Every rank's equal shard, concatenated in rank order."""
    out = torch.empty(padded_numel, dtype=shard.dtype, device=shard.device)
    _single_tensor_collectives()[0](out, shard.contiguous(), group=group)
    return out


def reduce_scatter_flat(flat: torch.Tensor, shard_numel: int, group=None) -> torch.Tensor:
    """The sum over ranks of this rank's slice of ``flat`` (equal slices in rank order)."""
    out = torch.empty(shard_numel, dtype=flat.dtype, device=flat.device)
    _single_tensor_collectives()[1](out, flat, group=group)
    return out


class TorchCollectives:
    """torch's equal-shard collectives: rank ``r`` owns segment ``r`` of the flat buffer."""

    def __init__(self, group=None):
        self.group = group

    def owned_segment(self, rank: int, world_size: int) -> int:
        return rank

    def owners_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """The mesh whose entry ``i`` is the rank that owns segment ``i`` (:func:`segment_owners_mesh`)."""
        owners = [0] * world_size
        for rank in range(world_size):
            owners[self.owned_segment(rank, world_size)] = rank
        return segment_owners_mesh(device_type, owners)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, owned: slice, async_op: bool = False):
        """Every rank's shard into ``full``; with ``async_op``, the work to wait on."""
        # Straight into the unit's buffer, and asynchronously for a prefetch: all_gather_flat does neither.
        all_gather_single = _single_tensor_collectives()[0]
        return all_gather_single(full, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, flat: torch.Tensor, owned: slice) -> torch.Tensor:
        """The sum over ranks of this rank's segment of ``flat``."""
        return reduce_scatter_flat(flat, owned.stop - owned.start, self.group)

    def start_reduce_scatter(self, flat: torch.Tensor, owned: slice) -> tuple[torch.Tensor, object]:
        """:meth:`reduce_scatter`, started: the segment it will hold, and the work to wait on."""
        out = torch.empty(owned.stop - owned.start, dtype=flat.dtype, device=flat.device)
        return out, _single_tensor_collectives()[1](out, flat, group=self.group, async_op=True)


class RingCollectives(TorchCollectives):
    """The ring chapter's hand-written collectives (all-reduce = reduce-scatter +
    all-gather). Its reduce-scatter leaves rank ``r`` the sum of segment
    ``(r+1) % n`` and its all-gather starts from that segment; the flat buffer's
    length is a multiple of ``n``, so the ring's segments are the equal shards
    and rank ``r`` simply owns segment ``(r+1) % n`` in both directions."""

    def owned_segment(self, rank: int, world_size: int) -> int:
        return (rank + 1) % world_size

    def all_gather(self, full, shard, owned, async_op=False):
        full[owned].copy_(shard)
        ring_all_gather(full, self.group)
        return None  # blocking point-to-point messages: a prefetch only moves the gather earlier

    def reduce_scatter(self, flat, owned):
        return ring_reduce_scatter(flat, self.group).clone()  # segment (rank+1) % n; the rest are partial sums

    def start_reduce_scatter(self, flat, owned):
        return self.reduce_scatter(flat, owned), None  # blocking point-to-point messages


COLLECTIVES = {"torch": TorchCollectives, "ring": RingCollectives}


def resolve_collectives(name: str, backend: str) -> str:
    """``"torch"``, ``"ring"``, or for ``"auto"`` the rule the cost model predicts with too
    (:func:`distlab.comm.implementations.default_implementation`: the ring on gloo, torch's elsewhere)."""
    if name not in {"auto", *COLLECTIVES}:
        raise DistlabError(f"unknown collectives {name!r}: use auto, {' or '.join(COLLECTIVES)}")
    return default_implementation(backend) if name == "auto" else name


def clip_sharded_grad_norm_(
    shards: list[torch.Tensor], max_norm: float, group=None, whole: list[torch.Tensor] = ()
) -> float:
    """Clip gradients that are cut into shards across ranks by their global
    norm: each rank sums the squares of its shards, one all-reduce adds the
    sums, and every rank scales its shards by the same factor. Padding is zero
    and adds nothing. ``whole``: gradients every rank holds whole and equal
    (ZeRO-3's replicated parameters), counted once, after the all-reduce.
    Returns the norm before clipping."""
    device = shards[0].device if shards else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    squares = sum((s.double().pow(2).sum() for s in shards), zero)
    dist.all_reduce(squares, group=group)
    norm = (squares + sum((w.double().pow(2).sum().to(device) for w in whole), zero)).sqrt().item()
    scale = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s epsilon
    if scale < 1:
        for grad in [*shards, *whole]:
            grad.mul_(scale)
    return norm
