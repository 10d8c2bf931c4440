"""The course's ZeRO-3 with modules kept whole (``ShardedParameters(..., replicate=[...])``) and its
per-parameter view of the shards (``named_shards()``), on 2 and 3 real gloo ranks.

* Trained a few Adam steps, it ends with the weights of one process on the whole batch, within the float32
  tolerance every ZeRO test uses (:data:`distlab.models.ATOL`/``RTOL``): the review's Tiny model (an
  embedding and a head sharded around a LayerNorm kept whole) with either collectives, with accumulation
  and clipping, under bf16, and gpt-tiny with every LayerNorm kept whole, those inside its block units too.
* The replicated parameters are whole on every rank, and the same on every rank after the steps.
* Its flat state goes through a DCP checkpoint and back, on the same and on another number of ranks.
* Every rank's ``named_shards()`` views, concatenated in segment order, are the whole parameter and the
  whole gradient one process computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

from distlab.errors import DistlabError
from distlab.models import build_model
from distlab.parallel import Zero3
from distlab.parallel.base import MixedPrecision
from distlab.parallel.checkpoint_state import FlatState
from distlab.parallel.zero3 import ShardedParameters
from distlab.testing import assert_same_state

VOCAB, DIM, ROWS, SEQ = 41, 10, 2, 6
"""Tiny's sizes: 410 values in each of the embedding and the head, so every unit is padded on 3 ranks;
``ROWS`` sequences of ``SEQ`` tokens per rank and micro-step."""
LR, STEPS = 1e-2, 3


class Tiny(nn.Module):
    """The peer review's model: an embedding and a head, each a shard unit, around a LayerNorm. With
    ``head_bias`` the head's unit holds two parameters, and a rank's slice can end inside one or miss it."""

    def __init__(self, head_bias: bool = False):
        super().__init__()
        self.emb, self.norm = nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=head_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))


def _tiny() -> Tiny:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Tiny()


def _gpt() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build_model("gpt-tiny")


def _norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.LayerNorm)]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up, float64 as it is
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _batches(world_size: int, steps: int, micro_steps: int, vocab: int) -> torch.Tensor:
    """Every step's global batch, micro-step by micro-step: ``world_size * ROWS`` sequences each."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (steps, micro_steps, world_size * ROWS, SEQ + 1), generator=generator)


def _train_one_process(model: nn.Module, batches: torch.Tensor, max_norm: float | None) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    norms = []
    for step in batches:
        for micro in step:
            (_loss(model, micro) / len(step)).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def _train_sharded(runtime, wrapped: ShardedParameters, batches: torch.Tensor, max_norm: float | None) -> list[float]:
    """This rank's rows of every micro-batch; every micro-step but the last under ``no_sync``."""
    optimizer = torch.optim.Adam(wrapped.shard_parameters(), lr=LR)
    mine = slice(runtime.rank * ROWS, (runtime.rank + 1) * ROWS)
    norms = []
    for step in batches:
        for index, micro in enumerate(step):
            if index < len(step) - 1:
                with wrapped.no_sync():
                    (_loss(wrapped, micro[mine]) / len(step)).backward()
            else:
                (_loss(wrapped, micro[mine]) / len(step)).backward()
        if max_norm is not None:
            norms.append(Zero3().clip_grad_norm_(wrapped, max_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


TINY_VARIANTS = {
    "torch": dict(collectives="torch"),
    "ring": dict(collectives="ring"),
    "accumulated_and_clipped": dict(collectives="torch", micro_steps=2, max_norm=0.05),
}


def _replicated_report(wrapped: ShardedParameters, group_size: int) -> dict:
    """Whether the replicated parameters are whole in the modules and the same on every rank."""
    stepped = wrapped.replicated.shard.detach()
    everyone = [torch.empty_like(stepped) for _ in range(group_size)]
    dist.all_gather(everyone, stepped.contiguous())
    whole = [m.weight.numel() + m.bias.numel() for m in _norms(wrapped.module)]
    return {
        "stepped_numel": stepped.numel(),
        "whole_numel": sum(whole),
        "module_bytes": sum(p.untyped_storage().nbytes() > 0 for m in _norms(wrapped.module) for p in m.parameters()),
        "same_on_every_rank": all(torch.equal(stepped, other) for other in everyone),
    }


def tiny_against_one_process(runtime) -> dict:
    """Each Tiny variant, sharded with the LayerNorm whole, beside one process on the whole batch."""
    out = {}
    for name, options in TINY_VARIANTS.items():
        micro_steps, max_norm = options.get("micro_steps", 1), options.get("max_norm")
        batches = _batches(runtime.world_size, STEPS, micro_steps, VOCAB)
        plain = _tiny()
        reference = copy.deepcopy(plain)
        wrapped = ShardedParameters(
            plain, [plain.emb, plain.head], collectives=options["collectives"], replicate=[plain.norm]
        )
        norms = _train_sharded(runtime, wrapped, batches, max_norm)
        reference_norms = _train_one_process(reference, batches, max_norm)
        out[name] = {
            "state": wrapped.full_state_dict(),
            "reference": reference.state_dict(),
            "norms": (norms, reference_norms),
            "replicated": _replicated_report(wrapped, runtime.world_size),
            "units": [unit.layout.numel for unit in wrapped.forward_order],
        }
    out["bf16"] = _tiny_under_bf16(runtime)
    out["gpt"] = _gpt_with_every_norm_whole(runtime)
    return out


def _tiny_under_bf16(runtime) -> dict:
    """Under bf16 compute with fp32 reduction and shards: the LayerNorm replicated, against it sharded (in the
    root). Both compute the same bf16 forward; only where the norm's values live differs."""
    batches = _batches(runtime.world_size, STEPS, 1, VOCAB)
    states, dtypes = {}, {}
    for replicated in (True, False):
        plain = _tiny()
        policy = MixedPrecision(torch.bfloat16, torch.float32)
        wrapped = ShardedParameters(
            plain, [plain.emb, plain.head], precision=policy, replicate=[plain.norm] if replicated else ()
        )
        with torch.no_grad():
            dtypes[replicated] = str(wrapped(batches[0, 0][:1, :-1]).dtype)
        _train_sharded(runtime, wrapped, batches, None)
        states[replicated] = wrapped.full_state_dict()
    return {"states": states, "computed_in": dtypes, "initial": _tiny().state_dict()}


def _gpt_with_every_norm_whole(runtime) -> dict:
    """gpt-tiny: its two blocks are units, each containing two LayerNorms, and ln_f is in the root; all five
    stay whole. Two Adam steps against one process, in float64: the keys' bias gets a gradient within rounding
    of zero, which Adam divides by its own size, so in float32 splitting the batch moves it by 4e-5 (with the
    norms sharded too: the same 3.8e-5 on 2 ranks), in float64 by 1e-13."""
    batches = _batches(runtime.world_size, 2, 1, 256)
    plain = _gpt().double()
    reference = copy.deepcopy(plain)
    wrapped = ShardedParameters(plain, plain.shard_units(), replicate=_norms(plain))
    _train_sharded(runtime, wrapped, batches, None)
    _train_one_process(reference, batches, None)
    whole = sum(p.numel() for m in _norms(plain) for p in m.parameters())
    return {
        "state": wrapped.full_state_dict(),
        "reference": reference.state_dict(),
        "replicated_numel": wrapped.replicated.shard.numel(),
        "norm_numel": whole,
        "sharded_numel": sum(unit.layout.numel for unit in wrapped.forward_order),
        "trainable_numel": sum(p.numel() for p in reference.parameters()),
        "initial": _gpt().double().state_dict(),
    }


@pytest.fixture(scope="module")
def trained(ranks2, ranks3) -> dict[int, list[dict]]:
    return {2: ranks2.run(tiny_against_one_process), 3: ranks3.run(tiny_against_one_process)}


def _max_abs_diff(state: dict, reference: dict) -> float:
    return max(float((state[k].double() - reference[k].double()).abs().max()) for k in reference)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_tiny_with_its_norm_whole_trains_like_one_process(trained, world_size, variant):
    for rank, results in enumerate(trained[world_size]):
        run = results[variant]
        label = f"{variant}, rank {rank} of {world_size}: max abs diff {_max_abs_diff(run['state'], run['reference'])}"
        assert_same_state(run["state"], run["reference"], label=label)
        norms, reference_norms = run["norms"]
        assert norms == pytest.approx(reference_norms, rel=1e-5), label
        # the embedding and the head are the units; the norm went to no unit (the root holds nothing)
        assert run["units"] == [VOCAB * DIM, VOCAB * DIM], label
    initial = _tiny().state_dict()
    trained_state = trained[2][0][variant]["reference"]
    assert all(not torch.allclose(initial[k], trained_state[k]) for k in initial), "a parameter never moved"


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicated_parameters_are_whole_on_every_rank_and_the_same_after_steps(trained, world_size):
    for results in trained[world_size]:
        for variant in TINY_VARIANTS:
            assert results[variant]["replicated"] == {
                "stepped_numel": 2 * DIM,
                "whole_numel": 2 * DIM,
                "module_bytes": 2,  # both the weight and the bias have their storage, never resized to 0
                "same_on_every_rank": True,
            }, variant


@pytest.mark.parametrize("world_size", [2, 3])
def test_gpt_with_every_layernorm_whole_trains_like_one_process(trained, world_size):
    for rank, results in enumerate(trained[world_size]):
        run = results["gpt"]
        label = f"gpt-tiny, rank {rank} of {world_size}: max abs diff {_max_abs_diff(run['state'], run['reference'])}"
        assert_same_state(run["state"], run["reference"], label=label)
        # the block units shard only what their norms leave; the norms are the replicated flat tensor
        assert run["replicated_numel"] == run["norm_numel"] == 5 * 2 * 64
        assert run["sharded_numel"] + run["norm_numel"] == run["trainable_numel"]
        assert not torch.allclose(run["initial"]["blocks.0.ln_1.weight"], run["state"]["blocks.0.ln_1.weight"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_replicated_norm_under_bf16_computes_in_bf16_and_steps_as_a_sharded_one(trained, world_size):
    for results in trained[world_size]:
        run = results["bf16"]
        assert run["computed_in"] == {True: "torch.bfloat16", False: "torch.bfloat16"}
        replicated, sharded = run["states"][True], run["states"][False]
        assert all(t.dtype == torch.float32 for t in replicated.values())
        assert_same_state(replicated, sharded, label=f"bf16 on {world_size}: {_max_abs_diff(replicated, sharded)}")
        assert not torch.allclose(run["initial"]["norm.weight"], replicated["norm.weight"]), "the norm never moved"


def test_a_replicated_module_that_is_or_holds_a_unit_is_refused_in_one_line():
    model = Tiny()
    for units, replicate, relation in (([model.emb], [model.emb], "is"), ([model.emb], [model], "contains")):
        with pytest.raises(DistlabError, match=f"replicated \\w+ {relation} the shard unit Embedding") as error:
            ShardedParameters(model, units, replicate=replicate)
        assert "\n" not in str(error.value)


def _wrapped_tiny(
    seed: int, collectives: str = "torch", head_bias: bool = False
) -> tuple[ShardedParameters, torch.optim.Optimizer]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        plain = Tiny(head_bias)
    wrapped = ShardedParameters(plain, [plain.emb, plain.head], collectives=collectives, replicate=[plain.norm])
    return wrapped, torch.optim.Adam(wrapped.shard_parameters(), lr=LR)


def _replicated_moments(wrapped: ShardedParameters, optimizer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in optimizer.state[wrapped.replicated.shard].items()}


def save_after_two_steps(runtime, path: str) -> dict:
    wrapped, optimizer = _wrapped_tiny(0)
    batches = _batches(runtime.world_size, 2, 1, VOCAB)
    for step in batches:
        _loss(wrapped, step[0][runtime.rank * ROWS : (runtime.rank + 1) * ROWS]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dcp.save(FlatState(wrapped, optimizer, "cpu").tensors, checkpoint_id=path)
    return {"state": wrapped.full_state_dict(), "moments": _replicated_moments(wrapped, optimizer)}


def load_into_a_fresh_model(runtime, path: str) -> dict:
    wrapped, optimizer = _wrapped_tiny(seed=5)  # other weights: the load must overwrite every one
    before = wrapped.full_state_dict()
    state = FlatState(wrapped, optimizer, "cpu")
    dcp.load(state.tensors, checkpoint_id=path)
    state.apply()
    return {"before": before, "state": wrapped.full_state_dict(), "moments": _replicated_moments(wrapped, optimizer)}


def test_the_flat_state_with_replicated_parameters_round_trips_on_2_and_3_ranks(ranks2, ranks3, tmp_path):
    saved = ranks2.run(save_after_two_steps, str(tmp_path / "ckpt"))[0]
    for world_size, pool in ((2, ranks2), (3, ranks3)):
        for rank, loaded in enumerate(pool.run(load_into_a_fresh_model, str(tmp_path / "ckpt"))):
            label = f"rank {rank} of {world_size}"
            assert not torch.equal(loaded["before"]["norm.weight"], saved["state"]["norm.weight"])
            assert loaded["state"].keys() == saved["state"].keys() == Tiny().state_dict().keys()
            for key, value in saved["state"].items():
                assert torch.equal(loaded["state"][key], value), f"{label} {key}"
            assert loaded["moments"].keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key, value in saved["moments"].items():
                assert torch.equal(loaded["moments"][key], value), f"{label} optimizer {key}"


def named_shards_report(runtime, collectives: str) -> dict:
    """After one Adam step and a second backward: every rank's named_shards(), gathered, against the whole
    parameter (full_state_dict) and one process's gradient of the whole batch at those weights."""
    wrapped, optimizer = _wrapped_tiny(0, collectives, head_bias=True)
    before_backward = [g for _, _, g in wrapped.named_shards()]
    batches = _batches(runtime.world_size, 2, 1, VOCAB)
    mine = slice(runtime.rank * ROWS, (runtime.rank + 1) * ROWS)
    _loss(wrapped, batches[0, 0][mine]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _loss(wrapped, batches[1, 0][mine]).backward()
    views = list(wrapped.named_shards())
    everyone = [None] * runtime.world_size
    segment = wrapped.forward_order[0].collectives.owned_segment(runtime.rank, runtime.world_size)
    dist.all_gather_object(everyone, (segment, [(n, v.clone(), g.clone()) for n, v, g in views]))
    whole = wrapped.full_state_dict()
    reference = Tiny(head_bias=True)
    reference.load_state_dict(whole)
    _loss(reference, batches[1, 0]).backward()
    grads = dict(reference.named_parameters())
    shard_storages = {u.shard.grad.untyped_storage().data_ptr() for u in wrapped.every_unit}
    out = {
        "names": [n for n, _, _ in views],
        "segment": segment,
        "before_backward": before_backward,
        "grad_views_share_shard_grads": all(g.untyped_storage().data_ptr() in shard_storages for _, _, g in views),
        "value_views_share_shards": all(
            v.untyped_storage().data_ptr() in {u.shard.untyped_storage().data_ptr() for u in wrapped.every_unit}
            for _, v, _ in views
        ),
        "lengths": {n: v.numel() for n, v, _ in views},
        "values": {},
        "grads": {},
    }
    ordered = [parts for _, parts in sorted(everyone, key=lambda item: item[0])]
    for index, name in enumerate(out["names"]):
        if name.startswith("norm."):  # whole on every rank: each rank's view is the parameter
            pieces = [parts[index] for parts in ordered]
            value, grad = pieces[0][1], pieces[0][2]
            assert all(torch.equal(p[1], value) and torch.equal(p[2], grad) for p in pieces)
        else:
            value = torch.cat([parts[index][1] for parts in ordered]).view_as(whole[name])
            grad = torch.cat([parts[index][2] for parts in ordered]).view_as(whole[name])
        out["values"][name] = float((value - whole[name]).abs().max())
        out["grads"][name] = float((grad - grads[name].grad).abs().max())
        out.setdefault("grad_scale", {})[name] = float(grads[name].grad.abs().max())
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("collectives", ["torch", "ring"])
def test_named_shards_of_every_rank_make_the_whole_parameter_and_gradient(ranks2, ranks3, world_size, collectives):
    pool, lengths = ranks2 if world_size == 2 else ranks3, []
    for rank, report in enumerate(pool.run(named_shards_report, collectives)):
        assert report["names"] == ["emb.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"]
        assert report["before_backward"] == [None] * 5
        assert report["grad_views_share_shard_grads"] and report["value_views_share_shards"]
        assert report["lengths"]["norm.weight"] == DIM  # whole; a unit's parameters are cut (cat checks how)
        lengths.append((report["segment"], report["lengths"]["head.bias"]))
        assert report["values"] == {name: 0.0 for name in report["names"]}, f"rank {rank}"
        for name, diff in report["grads"].items():
            assert diff <= 1e-6 + 1e-5 * report["grad_scale"][name], f"rank {rank} {name}: {diff}"
    # the head's 451 values, ceil(451 / N) a segment: the bias lies in the last segment alone
    assert [length for _, length in sorted(lengths)] == [0] * (world_size - 1) + [VOCAB], lengths


def materialized_on_meta(runtime) -> dict:
    """gpt-tiny built on meta and initialised unit by unit (``materialize``), its norms whole or not."""
    states = {}
    for replicated in (True, False):
        meta = build_model("gpt-tiny", device="meta")
        wrapped = ShardedParameters(meta, meta.shard_units(), replicate=_norms(meta) if replicated else ())
        wrapped.materialize(torch.device("cpu"), seed=3)
        states[replicated] = wrapped.full_state_dict()
        states[f"{replicated} replicated numel"] = wrapped.replicated.shard.numel() if wrapped.replicated else 0
        states[f"{replicated} sharded numel"] = sum(unit.layout.numel for unit in wrapped.forward_order)
    return states


def test_a_model_materialized_from_meta_with_its_norms_whole_draws_the_same_weights(ranks2):
    for states in ranks2.run(materialized_on_meta):
        assert states["True replicated numel"] == 5 * 2 * 64 and states["False replicated numel"] == 0
        assert states["True sharded numel"] == states["False sharded numel"] - 5 * 2 * 64  # no norm in a unit
        assert states[True].keys() == states[False].keys()
        assert all(torch.equal(states[True][k], states[False][k]) for k in states[False])
