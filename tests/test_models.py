"""Models: shapes, parameter counts from first principles, and presets up
to billions of parameters built on the meta device."""

from __future__ import annotations

import pytest
import torch

from distlab.models import GPT_PRESETS, build_model, count_parameters, gpt_param_count


def test_cnn_parameter_count_from_its_layers():
    # conv k*k*in*out + out, linear in*out + out
    expected = (25 * 1 * 32 + 32) + (25 * 32 * 64 + 64) + (25 * 64 * 128 + 128) + (1152 * 128 + 128) + (128 * 10 + 10)
    assert count_parameters(build_model("cnn")) == expected == 405_898  # not the "about 120K" the notes claim


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
