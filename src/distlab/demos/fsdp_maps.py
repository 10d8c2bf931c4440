"""The map from each FSDP1 option (:mod:`distlab.parallel.fsdp1`) to FSDP2 (``fully_shard``) and to
distlab's flags, and from each Accelerate key to distlab's: data that the chapter prints and the tests
check row by row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One option, what replaces it, the flags that ask for it, and what runs here."""

    option: str
    counterpart: str
    flags: tuple[str, ...]
    """``distlab.train`` flags (``--strategy fsdp`` unless they name one), or ``torchrun ...``;
    several are alternatives. None: ``no_flag`` says why."""
    status: str
    """FSDP1 rows: what runs on a CPU with gloo (torch 2.14.1); "checked" means tests/test_fsdp1.py
    runs it. Accelerate rows: where the key comes from."""
    names: tuple[str, ...] = ()
    """FSDP1 rows: dotted names of the option and its counterpart (``Callable(arg)``: a parameter).
    Accelerate rows: the key, as accelerate's config or ``accelerate launch`` spells it."""
    no_flag: str = ""


def to_markdown(rows: tuple[Row, ...], headers: tuple[str, str, str, str]) -> str:
    """A Markdown table of ``rows``: the chapter prints the maps from the data, never by hand."""

    def flags(row: Row) -> str:
        return ", or ".join(f"`{flag}`" for flag in row.flags) or f"none: {row.no_flag}"

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += [f"| {row.option} | {row.counterpart} | {flags(row)} | {row.status} |" for row in rows]
    return "\n".join(lines)


_F, _SD = "torch.distributed.fsdp.", "torch.distributed.checkpoint.state_dict."
_FSDP, _M = _F + "FullyShardedDataParallel", _F + "FSDPModule."
_SAME = "runs; checked: trains the same weights as FSDP2"
_UNITS = "the model names its units: `shard_units()`"

# A table laid out by hand: option, counterpart, flags / status / names, no_flag.
# fmt: off
FSDP1_TO_FSDP2: tuple[Row, ...] = (
    Row("`FullyShardedDataParallel(model, ...)`, a wrapper",
        "`fully_shard(unit)` for each unit, then `fully_shard(model)`, in place", ("--strategy fsdp",),
        _SAME,
        (_FSDP, _F + "fully_shard", _F + "FSDPModule")),
    Row("`ShardingStrategy.FULL_SHARD`", "`reshard_after_forward=True`", ("--fsdp-reshard-after-forward",),
        _SAME,
        (_F + "ShardingStrategy.FULL_SHARD", _F + "fully_shard(reshard_after_forward)")),
    Row("`ShardingStrategy.SHARD_GRAD_OP`", "`reshard_after_forward=False`", ("--no-fsdp-reshard-after-forward",),
        _SAME,
        (_F + "ShardingStrategy.SHARD_GRAD_OP", _F + "fully_shard(reshard_after_forward)")),
    Row("`ShardingStrategy.NO_SHARD`", "DDP", ("--strategy ddp",),
        "runs, with a FutureWarning (deprecated); checked: trains the same weights as DDP",
        (_F + "ShardingStrategy.NO_SHARD", "torch.nn.parallel.DistributedDataParallel")),
    Row("`ShardingStrategy.HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`",
        "a 2-D mesh: `fully_shard(..., mesh=init_device_mesh(type, (replicate, shard)))`", ("--fsdp-replicate 2",),
        "runs when the replicas divide the ranks; checked on 4 gloo ranks (a 2x2 mesh): trains the same weights "
        "as DDP",
        (_F + "ShardingStrategy.HYBRID_SHARD", _F + "ShardingStrategy._HYBRID_SHARD_ZERO2", _F + "fully_shard(mesh)")),
    Row("none (FSDP2 only)", "`reshard_after_forward=N`: after forward, parameters stay gathered in groups of N ranks",
        ("--fsdp-reshard-to 2",),
        "runs when N divides the number of ranks; checked on 4 ranks: trains the same weights as DDP",
        (_F + "fully_shard(reshard_after_forward)",)),
    Row("`auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=1_000_000)`",
        "`fully_shard` the submodules you choose", (),
        "runs; checked: on the notes' CNN it wraps nothing (one root unit), and trains as FSDP2's five units",
        (_F + "wrap.size_based_auto_wrap_policy",),
        _UNITS),
    Row("`transformer_auto_wrap_policy({Block})`, `ModuleWrapPolicy({Block})`", "`fully_shard(block)` for each block",
        (),
        "checked: both wrap exactly the GPT's `shard_units()`",
        (_F + "wrap.transformer_auto_wrap_policy", _F + "wrap.ModuleWrapPolicy"),
        _UNITS),
    Row("`backward_prefetch=BackwardPrefetch.BACKWARD_PRE` (or `BACKWARD_POST`)",
        "implicit: backward gathers the next unit early by itself; explicit: `set_modules_to_backward_prefetch`",
        ("--fsdp-prefetch implicit", "--fsdp-prefetch explicit"),
        _SAME,
        (_F + "BackwardPrefetch.BACKWARD_PRE", _F + "BackwardPrefetch.BACKWARD_POST",
         _M + "set_modules_to_backward_prefetch")),
    Row("`forward_prefetch=True`", "`set_modules_to_forward_prefetch`", ("--fsdp-prefetch explicit",),
        _SAME,
        (_FSDP + "(forward_prefetch)", _M + "set_modules_to_forward_prefetch")),
    Row("`mixed_precision=MixedPrecision(param_dtype, reduce_dtype)`",
        "`mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype)`",
        ("--fsdp-param-dtype bf16 --fsdp-reduce-dtype fp32", "--fsdp-param-dtype fp16 --fsdp-reduce-dtype param"),
        "runs (gloo all-gathers bf16); checked: bf16 FSDP1 trains as bf16 FSDP2",
        (_F + "MixedPrecision", _F + "MixedPrecisionPolicy")),
    Row("`cpu_offload=CPUOffload(offload_params=True)`", "`offload_policy=CPUOffloadPolicy()`", ("--fsdp-cpu-offload",),
        "needs CUDA to pin host memory (checked: FSDP1 raises without a GPU driver); FSDP2 with "
        "`pin_memory=False` runs (checked: same weights), moving nothing on a CPU",
        (_F + "CPUOffload", _F + "CPUOffloadPolicy")),
    Row("`sync_module_states=True`",
        "one seed on every rank, or `set_model_state_dict(..., options=StateDictOptions(full_state_dict=True, "
        "broadcast_from_rank0=True))`", ("--seed 0",),
        "FSDP1 refuses CPU tensors here (checked: ValueError); FSDP2's broadcast runs (checked: ranks built "
        "from different seeds train as from rank 0's weights)",
        (_FSDP + "(sync_module_states)", _SD + "set_model_state_dict", _SD + "StateDictOptions(broadcast_from_rank0)")),
    Row("`param_init_fn=...` (a model built on `meta`)",
        "`fully_shard` the `meta` model, then `to_empty()` and initialise this rank's shards", ("--meta-init on",),
        "FSDP2 runs it; not run here with FSDP1",
        (_FSDP + "(param_init_fn)", "torch.nn.Module.to_empty")),
    Row("`use_orig_params=False` (a `FlatParameter` per unit), or `True`",
        "always the original parameters, each a `DTensor` sharded on dim 0", (),
        "runs; checked with both",
        (_FSDP + "(use_orig_params)", _F + "FlatParameter", "torch.distributed.tensor.DTensor"),
        "FSDP2 has no flat parameter"),
    Row("`FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT)`",
        "`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`, for FSDP1 too",
        ("--save-model",),
        "runs, with a FutureWarning (deprecated); checked: the same tensors as `get_model_state_dict`",
        (_FSDP + ".state_dict_type", _F + "StateDictType.FULL_STATE_DICT", _SD + "get_model_state_dict")),
    Row("`FSDP.optim_state_dict(model, optim)`",
        "`get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))`", (),
        "runs; checked: the same momentum as FSDP2's",
        (_FSDP + ".optim_state_dict", _SD + "get_optimizer_state_dict"),
        "distlab saves no optimizer state"),
    Row("`with model.no_sync():`", "`model.set_requires_gradient_sync(False)`", ("--accum-steps 2",),
        _SAME + " over 2 micro-steps",
        (_FSDP + ".no_sync", _M + "set_requires_gradient_sync")),
    Row("`model.clip_grad_norm_(max_norm)`", "`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`",
        ("--max-grad-norm 1.0",),
        "runs; checked: the same norms and weights",
        (_FSDP + ".clip_grad_norm_", "torch.nn.utils.clip_grad_norm_")),
    Row("`with FSDP.summon_full_params(model):`", "`model.unshard()` ... `model.reshard()`, or `p.full_tensor()`", (),
        "runs; checked: the same whole parameters",
        (_FSDP + ".summon_full_params", _M + "unshard", _M + "reshard", "torch.distributed.tensor.DTensor.full_tensor"),
        "the loop never needs the whole model"),
    Row("`device_id=local_rank`", "the mesh's device: `init_device_mesh(device.type, (world_size,))`",
        ("--device cpu", "--device cuda"),
        "FSDP1 on a CPU needs `device_id=torch.device('cpu')` (checked: without it, it raises)",
        (_FSDP + "(device_id)", "torch.distributed.device_mesh.init_device_mesh")),
)
"""FSDP1 option -> FSDP2 -> ``distlab.train`` flag -> what runs on a CPU."""
_YAMLS, _YAML, _DDP_YAML, _GEN = "notes (both YAMLs)", "notes (FSDP YAML)", "notes (DDP YAML)", "`accelerate config`"

ACCELERATE_TO_DISTLAB: tuple[Row, ...] = (
    Row("`distributed_type: FSDP` (or `MULTI_GPU`)", "shard with FSDP (or replicate with DDP)",
        ("--strategy fsdp", "--strategy ddp"), _YAMLS, ("distributed_type",)),
    Row("`fsdp_version: 2`", "FSDP2 (1: FSDP1)", ("--strategy fsdp",), _GEN, ("fsdp_version",)),
    Row("`num_processes: 2`", "ranks on this machine", ("torchrun --nproc_per_node=2",), _DDP_YAML,
        ("num_processes",)),
    Row("`num_machines: 1`", "machines", ("torchrun --nnodes=1",), _GEN, ("num_machines",)),
    Row("`mixed_precision: fp16`",
        "autocast and a grad scaler; under FSDP also `MixedPrecision(param_dtype=fp16, reduce_dtype=fp16)`",
        ("--strategy ddp --precision fp16", "--precision fp16 --fsdp-param-dtype fp16 --fsdp-reduce-dtype param"),
        _DDP_YAML, ("mixed_precision",)),
    Row("`use_cpu: true`", "run on the CPU", ("--device cpu",), _GEN, ("use_cpu",)),
    Row("`fsdp_sharding_strategy: FULL_SHARD` (or `SHARD_GRAD_OP`)", "FSDP1's `ShardingStrategy`",
        ("--fsdp-reshard-after-forward", "--no-fsdp-reshard-after-forward"), _YAML, ("fsdp_sharding_strategy",)),
    Row("`fsdp_reshard_after_forward: true`", "FSDP2's `reshard_after_forward`", ("--fsdp-reshard-after-forward",),
        _GEN, ("fsdp_reshard_after_forward",)),
    Row("`fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`",
        "a unit per layer of the classes named (by default `model._no_split_modules`: a model without it, "
        "such as the CNN, stays one root unit)", (), _YAML, ("fsdp_auto_wrap_policy",), _UNITS),
    Row("`fsdp_transformer_layer_cls_to_wrap: Block`", "the layer class that makes a unit", (), _GEN,
        ("fsdp_transformer_layer_cls_to_wrap",), _UNITS),
    Row("`fsdp_min_num_params: 1000000`", "`SIZE_BASED_WRAP`'s threshold", (), _GEN, ("fsdp_min_num_params",),
        _UNITS),
    Row("`fsdp_backward_prefetch: BACKWARD_PRE`", "FSDP1's `BackwardPrefetch`; dropped under FSDP2",
        ("--fsdp-prefetch implicit",), _YAML, ("fsdp_backward_prefetch",)),
    Row("`fsdp_forward_prefetch: true`", "FSDP1's `forward_prefetch`; refused under FSDP2",
        ("--fsdp-prefetch explicit",), _GEN, ("fsdp_forward_prefetch",)),
    Row("`fsdp_offload_params: true`", "`CPUOffload`, or FSDP2's `CPUOffloadPolicy`", ("--fsdp-cpu-offload",), _GEN,
        ("fsdp_offload_params",)),
    Row("`fsdp_state_dict_type: FULL_STATE_DICT`", "how a checkpoint is gathered", ("--save-model",), _GEN,
        ("fsdp_state_dict_type",)),
    Row("`fsdp_sync_module_states: true`", "rank 0's weights broadcast at wrap time", ("--seed 0",), _GEN,
        ("fsdp_sync_module_states",)),
    Row("`fsdp_cpu_ram_efficient_loading: true`", "only rank 0 loads weights; the others start on `meta`",
        ("--meta-init on",), _GEN, ("fsdp_cpu_ram_efficient_loading",)),
    Row("`fsdp_use_orig_params: true`", "FSDP1's `use_orig_params`", (), _GEN, ("fsdp_use_orig_params",),
        "FSDP2 always keeps the original parameters"),
    Row("`fsdp_activation_checkpointing: true`", "recompute activations in backward", ("--activation-checkpointing",),
        _GEN, ("fsdp_activation_checkpointing",)),
)
"""The notes' Accelerate keys, and the rest of a generated FSDP config -> distlab flags (accelerate 1.15)."""
# fmt: on


def fsdp1_to_fsdp2_markdown() -> str:
    return to_markdown(
        FSDP1_TO_FSDP2, ("FSDP1", "FSDP2", "distlab.train (with `--strategy fsdp`)", "on a CPU with gloo")
    )


def accelerate_to_distlab_markdown() -> str:
    return to_markdown(
        ACCELERATE_TO_DISTLAB, ("Accelerate config", "what it does", "distlab (with `--strategy fsdp`)", "source")
    )
