"""torch's FSDP2 (``fully_shard``): every shard unit the model declares, then
the root, sharded across the ranks, with the options that trade memory for
communication (resharding, prefetch, mixed precision, offload)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar, Literal

import torch
import torch.nn as nn

from ..errors import DistlabError
from ..models import require_shard_units
from .base import ShardingOptions, Strategy


def _fsdp():
    """torch's ``fully_shard`` and its policies, imported when FSDP2 is used: ``torch.distributed.fsdp`` imports
    DTensor and, through it, sympy, about a second of every rank's start that a DDP run need not pay."""
    try:  # public since torch 2.6
        import torch.distributed.fsdp as fsdp

        fsdp.fully_shard  # noqa: B018 (absent before 2.6)
    except (ImportError, AttributeError):  # torch 2.4-2.5
        import torch.distributed._composable.fsdp as fsdp
    return fsdp


class FSDP2(Strategy):
    """FSDP2: each shard unit, then the root, sharded across ranks.

    ``reshard_after_forward=True`` frees gathered parameters after forward
    (FSDP1's FULL_SHARD); ``False`` keeps them until backward (SHARD_GRAD_OP);
    an integer ``g`` keeps each parameter gathered over groups of ``g`` ranks,
    so backward's all-gather stays inside a group (a node, say). ``replicate=R``
    is HSDP (FSDP1's HYBRID_SHARD): a 2-D mesh of R replicas, each sharding over
    N/R ranks.
    """

    name: ClassVar[str] = "fsdp"
    predicted_by: str = "fsdp"
    options: ClassVar[tuple[str, ...]] = ShardingOptions.OPTIONS + (
        "fsdp_units",
        "fsdp_reshard_to",
        "fsdp_replicate",
        "fsdp_prefetch",
        "fsdp_prefetch_depth",
        "fsdp_cpu_offload",
        "fsdp_reshard_between_micro_steps",
    )
    shards_parameters: ClassVar[bool] = True

    def __init__(
        self,
        reshard_after_forward: bool | int = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        prefetch: Literal["implicit", "explicit"] = "implicit",
        prefetch_depth: int = 1,
        cpu_offload: bool = False,
        reshard_between_micro_steps: bool = True,
        units: Literal["model", "root"] = "model",
        replicate: int = 1,
    ):
        self.reshard_after_forward = reshard_after_forward
        self.replicate = replicate
        self.predicted_by = "fsdp-no-reshard" if reshard_after_forward is False else "fsdp"
        self.mp_policy = _fsdp().MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        self.prefetch, self.prefetch_depth = prefetch, prefetch_depth
        self.cpu_offload = cpu_offload
        self.reshard_between_micro_steps = reshard_between_micro_steps
        self.units = units

    @classmethod
    def from_config(cls, parallel):
        sharding = ShardingOptions.from_config(parallel)
        return cls(
            parallel.fsdp_reshard_to or sharding.reshard_after_forward,
            param_dtype=sharding.precision.param_dtype,
            reduce_dtype=sharding.precision.reduce_dtype,
            prefetch=parallel.fsdp_prefetch,
            prefetch_depth=parallel.fsdp_prefetch_depth,
            cpu_offload=parallel.fsdp_cpu_offload,
            reshard_between_micro_steps=parallel.fsdp_reshard_between_micro_steps,
            units=parallel.fsdp_units,
            replicate=parallel.fsdp_replicate,
        )

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        group = self.reshard_after_forward
        if not isinstance(group, bool) and (group < 2 or world_size % group):
            raise DistlabError(
                f"--fsdp-reshard-to {group} must divide the {world_size} ranks and be at least 2 "
                f"(it is the size of the group a parameter stays gathered over): use a divisor of {world_size}, "
                "or --fsdp-reshard-after-forward"
            )
        if self.replicate < 1 or world_size % self.replicate:
            raise DistlabError(
                f"--fsdp-replicate {self.replicate} must divide the {world_size} ranks (it is the number of "
                f"replicas, each sharding over the rest): use a divisor of {world_size}, or 1 to shard over all"
            )
        if self.replicate > 1 and not isinstance(group, bool):
            raise DistlabError("--fsdp-replicate and --fsdp-reshard-to both cut the ranks into groups: use one of them")

    def wrap(self, model: nn.Module, runtime) -> nn.Module:
        self.check_world_size(runtime.world_size)
        # One root unit gathers the whole model at once: what FSDP1's size-based
        # policy does when its threshold is above every layer's size.
        units = require_shard_units(model, self.name) if self.units == "model" else []
        mesh = self.device_mesh(runtime)
        options = dict(
            mesh=mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.mp_policy,
            offload_policy=self._offload_policy(runtime.device),
        )
        for unit in units:
            _fsdp().fully_shard(unit, **options)
        # The root's parameters (a GPT's embedding and its tied head) are used at the
        # end of forward and again first thing in backward: freeing them in between
        # would only gather them again at once (torch's own default for the root).
        root = _fsdp().fully_shard(model, **{**options, "reshard_after_forward": False})
        if self.prefetch == "explicit":
            # Implicit prefetch already overlaps one unit: the all-gather runs on its own stream
            # while the CPU runs ahead in forward, and backward gathers in reverse forward order.
            # A list of one only issues that all-gather earlier; two keep two in flight.
            depth = self.prefetch_depth
            for index, unit in enumerate(units):
                unit.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + depth])
                unit.set_modules_to_backward_prefetch(units[max(0, index - depth) : index][::-1])
        return root

    def device_mesh(self, runtime):
        """A 1-D mesh over every rank, or HSDP's 2-D one: ``replicate`` rows of ``N / replicate`` ranks, each row
        one replica that shards the model (rank r in row r // (N / replicate)), each column one shard's replicas
        (:func:`hsdp_mesh`).

        ``reshard_to``'s 2-D mesh is not built here: FSDP2 builds it itself from this 1-D one
        (``_get_post_forward_mesh_info``: ``DeviceMesh(device_type, mesh.view(-1, g))``), and on GPUs DeviceMesh
        makes its groups with ``split_group`` from the default group, which is bound to the rank's GPU and carries
        NCCL and gloo (torch 2.14 ``device_mesh.py`` ``_init_one_process_group``; 2.10 the same, lines 420-444): a
        path whose mixed-backend handling torch changed across releases (pytorch/pytorch#159200, #162424). It has
        not run on GPUs (four are needed: ``tests/test_gpu.py::test_fsdp2_on_a_two_dimensional_mesh_of_nccl_ranks``)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.replicate > 1:
            return hsdp_mesh(runtime, self.replicate)
        if runtime.device.type == "cuda" and runtime.backend == "gloo":
            # Ranks sharing a GPU through gloo: the mesh is the default group itself. Asked for a new group instead,
            # some torch releases build it as cpu:gloo,cuda:nccl, two NCCL ranks on one GPU, which NCCL refuses.
            return DeviceMesh.from_group(dist.group.WORLD, "cuda")
        return init_device_mesh(runtime.device.type, (runtime.world_size,))

    def parameter_device(self, runtime) -> torch.device:
        return torch.device("cpu") if self.cpu_offload else runtime.device

    def _offload_policy(self, device: torch.device):
        if not self.cpu_offload:
            return _fsdp().OffloadPolicy()
        # Pinned host memory is what lets the copies overlap, and pinning needs a GPU driver:
        # on a CPU the shards already live in host memory and there is nothing to move.
        return _fsdp().CPUOffloadPolicy(pin_memory=device.type == "cuda")

    @contextmanager
    def no_sync(self, model) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        if not self.reshard_between_micro_steps:
            model.set_reshard_after_backward(False)  # recursive: every unit keeps its gathered parameters
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            # The last micro-step must reshard: the optimizer updates the shards, and a
            # gathered copy left over would be used, stale, by the next forward.
            model.set_reshard_after_backward(True)

    def make_optimizer(self, model, factory):
        optimizer = factory(model.parameters())
        optimizer.register_step_pre_hook(lambda *_: refuse_stale_gathered_parameters(model))
        return optimizer

    def state_tensors(self, model, optimizer):
        found = super().state_tensors(model, optimizer)
        found["gradients"] += whole_gradients(model)
        found["gathered"] = gathered_parameters(model)
        return found


def hsdp_mesh(runtime, replicate: int):
    """HSDP's 2-D mesh, ``("replicate", "shard")``, from groups made here with ``dist.new_group``: every rank makes
    every row's and every column's group, in the same order, on the default group's backends
    (:func:`distlab.runtime.group_backend`: ``cpu:gloo,cuda:nccl`` on NCCL ranks, so a CPU tensor still has a leg).

    Not ``init_device_mesh``: on a default group bound to a GPU it makes a 2-D mesh's groups with ``split_group``
    (torch 2.14 ``device_mesh.py`` ``_init_one_process_group``, "If bound_device_id exists ... use split_group";
    2.10 the same, lines 420-444), whose handling of a parent with both gloo and NCCL changed across releases
    (pytorch/pytorch#159200, open; #162424). ``new_group`` splits only NCCL's own communicator from the default
    group's (``ncclCommSplit``) and makes the gloo leg anew: on a CPU, whose default group is bound to no device,
    the very calls ``init_device_mesh`` makes, so the CPU tests run this code whole. Not yet run on GPUs (four:
    ``tests/test_gpu.py::test_fsdp2_on_a_two_dimensional_mesh_of_nccl_ranks``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime import group_backend

    layout = torch.arange(runtime.world_size).view(replicate, runtime.world_size // replicate)

    def this_ranks_group(groups_of_ranks: torch.Tensor):
        mine = None
        for ranks in groups_of_ranks.tolist():  # every rank makes every group: new_group is collective
            group = dist.new_group(ranks, backend=group_backend(runtime.backend))
            mine = group if runtime.rank in ranks else mine
        return mine

    replicas, shards = this_ranks_group(layout.t()), this_ranks_group(layout)
    return DeviceMesh.from_group(
        [replicas, shards], runtime.device.type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )


def refuse_stale_gathered_parameters(model: nn.Module) -> None:
    """Fail before an optimizer step that would leave gathered parameters stale.

    The step updates each rank's shards; a whole parameter still gathered from the
    old shards would be reused by the next forward, which then computes with last
    step's weights and raises nothing (``set_reshard_after_backward(False)`` left
    on does this). ``reshard()`` is per unit, not recursive, so every unit counts.
    """
    if gathered_parameters(model):
        raise DistlabError(
            "FSDP parameters are still gathered at the optimizer step, so the next forward would use "
            "stale weights: call set_reshard_after_backward(True) before the last micro-step's backward, "
            "or reshard() every fully_shard-ed module before stepping"
        )


def gathered_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The whole parameters FSDP2 has assembled from shards and not yet freed."""
    return [param for param in _unsharded_parameters(model) if param.untyped_storage().size() > 0]


def whole_gradients(model: nn.Module) -> list[torch.Tensor]:
    """The whole (unsharded) gradients FSDP2 keeps across micro-steps under ``set_requires_gradient_sync(False)``:
    on the gathered parameter (``.grad``), or cast to the reduce dtype (``unsharded_accumulated_grad``, torch 2.14
    ``_fsdp_param.py``), until the synchronised backward reduce-scatters them. Without them a no_sync step's whole
    gradients were counted as activations. They live in FSDP2's private state; if that moves, they are counted as
    other memory."""
    found = []
    for fsdp_param in _fsdp_params(model):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        for grad in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)):
            if grad is not None and grad.untyped_storage().size() > 0:
                found.append(grad)
    return found


def _unsharded_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The whole parameters FSDP2 assembles from shards (allocated only while gathered).
    They live in FSDP2's private state; if that moves, they are counted as other memory."""
    unsharded = (getattr(fsdp_param, "_unsharded_param", None) for fsdp_param in _fsdp_params(model))
    return [param for param in unsharded if param is not None]


def _fsdp_params(model: nn.Module) -> list:
    """FSDP2's record of each parameter it shards (``FSDPParam``), unit by unit."""
    found = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", lambda: None)()
        groups = getattr(state, "_fsdp_param_groups", None) if state is not None else None
        if groups is None:  # older torch: at most one group per state
            group = getattr(state, "_fsdp_param_group", None) if state is not None else None
            groups = [group] if group is not None else []
        for group in groups:
            found.extend(getattr(group, "fsdp_params", []))
    return found
