"""Models: shapes, parameter counts from first principles, and presets up
to billions of parameters built on the meta device."""

from __future__ import annotations

import copy

import pytest
import torch

from distlab.models import (
    GPT_PRESETS,
    ShardUnits,
    build_model,
    count_parameters,
    gpt_param_count,
    require_shard_units,
)
from distlab.parallel.materialize import materialize
from distlab.testing import CNN_PARAMETERS


def test_cnn_parameter_count_from_its_layers():
    # conv k*k*in*out + out, linear in*out + out
    expected = (25 * 1 * 32 + 32) + (25 * 32 * 64 + 64) + (25 * 64 * 128 + 128) + (1152 * 128 + 128) + (128 * 10 + 10)
    assert count_parameters(build_model("cnn")) == expected == CNN_PARAMETERS  # not the "about 120K" the notes claim


@pytest.mark.parametrize("name,channels,size", [("cnn", 1, 28), ("resnet18", 3, 32), ("resnet18", 1, 28)])
def test_image_models_map_a_batch_to_ten_logits(name, channels, size):
    model = build_model(name, in_channels=channels, image_size=size)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 10)


def test_gpt_tiny_predicts_every_next_token():
    model = build_model("gpt-tiny")
    tokens = torch.randint(256, (3, 16))
    assert model(tokens).shape == (3, 16, 256)


@pytest.mark.parametrize("name", list(GPT_PRESETS))
def test_gpt_presets_on_meta_match_the_formula(name):
    model = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == gpt_param_count(GPT_PRESETS[name])


def test_presets_span_kilobytes_to_billions():
    counts = [gpt_param_count(cfg) for cfg in GPT_PRESETS.values()]
    assert counts == sorted(counts)
    assert counts[0] < 200_000 and counts[-1] > 10_000_000_000
    assert gpt_param_count(GPT_PRESETS["gpt-small"]) == pytest.approx(124e6, rel=0.01)  # GPT-2 small


@pytest.mark.parametrize("name", ["cnn", "resnet18", "gpt-tiny"])
def test_a_deep_copy_shards_its_own_layers(name):
    # A copy's shard units must be the copy's modules: a sharding strategy
    # applied to the copy would otherwise shard the original's layers.
    copied = copy.deepcopy(build_model(name))
    own = {id(m) for m in copied.modules()}
    assert all(id(unit) in own for unit in copied.shard_units())


@pytest.mark.parametrize("name", ["cnn", "resnet18", "gpt-tiny"])
def test_every_model_keeps_the_shard_units_contract(name):
    model = build_model(name)
    assert isinstance(model, ShardUnits) and model.shard_units()


def test_a_sharding_strategy_refuses_a_model_without_shard_units():
    from distlab.errors import DistlabError

    with pytest.raises(DistlabError) as error:
        require_shard_units(torch.nn.Linear(3, 3), "fsdp")
    assert "shard_units()" in str(error.value) and "\n" not in str(error.value)


def test_materialize_initialises_a_meta_model_and_keeps_ties_and_the_global_rng():
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    model = materialize(build_model("gpt-tiny", device="meta"), torch.device("cpu"), seed=3)
    assert torch.equal(torch.rand(3), expected_next), "library code must leave the global RNG alone"
    assert model.head.weight is model.tok_emb.weight
    assert not any(p.is_meta for p in model.parameters())
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(model.blocks[0].ln_1.weight, torch.ones(64))
    again = materialize(build_model("gpt-tiny", device="meta"), torch.device("cpu"), seed=3)
    assert torch.equal(again.tok_emb.weight, model.tok_emb.weight), "the same seed gives the same weights"


def shard_a_meta_gpt(runtime):
    from distlab.parallel import FSDP2

    model = materialize(FSDP2().wrap(build_model("gpt-tiny", device="meta"), runtime), runtime.device, seed=0)
    local = {name: p.to_local() for name, p in model.named_parameters()}
    return {
        "local_numel": sum(t.numel() for t in local.values()),
        "total_numel": count_parameters(model),
        "tied": model.head.weight is model.tok_emb.weight,
        "finite": all(torch.isfinite(t).all().item() for t in local.values()),
    }


def test_a_meta_model_sharded_then_materialised_holds_only_its_shards(ranks2):
    ranks = ranks2.run(shard_a_meta_gpt)
    total = gpt_param_count(GPT_PRESETS["gpt-tiny"])
    assert [r["total_numel"] for r in ranks] == [total, total]
    # every gpt-tiny parameter has an even first dimension: exactly half each, no padding
    assert [r["local_numel"] for r in ranks] == [total // 2, total // 2]
    assert all(r["tied"] and r["finite"] for r in ranks)


def zero3_from_meta_and_whole(runtime):
    import torch.nn.functional as F

    from distlab.parallel import Zero3

    whole = Zero3().build(build_model("gpt-tiny", device="meta"), runtime, seed=0)
    sharded = Zero3().build(build_model("gpt-tiny", device="meta"), runtime, seed=0, sharded_init=True)
    held = sum(unit.shard.numel() for unit in sharded.forward_order)
    gathered_now = sum(unit.full.untyped_storage().nbytes() for unit in sharded.forward_order)
    initial_equal = all(
        torch.equal(a, b) for a, b in zip(whole.full_state_dict().values(), sharded.full_state_dict().values())
    )
    tokens = torch.randint(0, GPT_PRESETS["gpt-tiny"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    for model in (whole, sharded):
        optimizer = torch.optim.Adam(model.shard_parameters(), lr=1e-2)
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
    stepped_equal = all(
        torch.equal(a, b) for a, b in zip(whole.full_state_dict().values(), sharded.full_state_dict().values())
    )
    return {"held": held, "gathered": gathered_now, "initial_equal": initial_equal, "stepped_equal": stepped_equal}


def test_zero3_built_on_meta_holds_only_its_slices_and_equals_the_whole_initialisation(ranks2):
    """zero3 wrapped on meta initialises unit by unit (never the whole model on a rank) with the draws
    of the whole-model path: the same weights, the same step; only this rank's slices stay."""
    ranks = ranks2.run(zero3_from_meta_and_whole)
    total = gpt_param_count(GPT_PRESETS["gpt-tiny"])
    for rank in ranks:
        assert rank["initial_equal"] and rank["stepped_equal"]
        assert rank["gathered"] == 0
        assert total // 2 <= rank["held"] <= total // 2 + 8  # ceil(numel/2) per unit: a few values of padding
