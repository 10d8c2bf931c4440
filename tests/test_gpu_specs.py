"""distlab.predict.gpu_specs: every cited number has a source, sane units, and no zeros; the module needs no torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from distlab.predict import gpu_specs
from distlab.predict.gpu_specs import GPUS, SYSTEMS

# Plausible ranges for each unit: FLOP/s, bytes/s, bytes, seconds.
FLOPS = (1e12, 1e16)
MEMORY_BANDWIDTH = (1e11, 1e13)  # 100 GB/s .. 10 TB/s
LINK_BANDWIDTH = (1e9, 1e12)  # 1 GB/s .. 1 TB/s per direction
MEMORY = (8 * 2**30, 200 * 2**30)
LATENCY = (1e-7, 1e-4)


def numeric_fields(obj):
    return {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if f.name not in ("sources", "count") and not isinstance(getattr(obj, f.name), (str, gpu_specs.GPU))
    }


@pytest.mark.parametrize("obj", [*GPUS.values(), *SYSTEMS.values()], ids=[*GPUS, *SYSTEMS])
def test_every_numeric_field_has_a_source_and_none_is_zero(obj):
    for name, value in numeric_fields(obj).items():
        assert len(obj.sources.get(name, "")) > 20, f"{name} has no source"
        assert value is None or value > 0, f"{name} is {value}"
        if value is None:
            assert "not available" in obj.sources[name].lower()


@pytest.mark.parametrize("gpu", GPUS.values(), ids=list(GPUS))
def test_gpu_units_are_sane(gpu):
    for precision in ("fp32", "tf32", "fp16", "bf16"):
        value = getattr(gpu, f"{precision}_flops")
        assert value is None or FLOPS[0] < value < FLOPS[1], precision
    assert gpu.fp16_flops > gpu.fp32_flops
    assert MEMORY_BANDWIDTH[0] < gpu.memory_bandwidth < MEMORY_BANDWIDTH[1]
    assert MEMORY[0] < gpu.usable_memory_bytes <= gpu.memory_bytes * 1.01 < MEMORY[1]
    assert 0.05 < gpu.mfu < 0.8


@pytest.mark.parametrize("system", SYSTEMS.values(), ids=list(SYSTEMS))
def test_system_units_are_sane(system):
    assert system.count in (1, 2, 8) and system.sources["count"]
    for name in ("link_bandwidth", "allreduce_busbw", "gather_busbw"):
        assert LINK_BANDWIDTH[0] < getattr(system, name) < LINK_BANDWIDTH[1], name
    # Ring bus bandwidth cannot beat the link; NVLink SHARP all-reduce can (the switch does the reduction).
    assert system.gather_busbw <= system.link_bandwidth
    for name in ("alpha_step_s", "alpha_base_s"):
        assert LATENCY[0] < getattr(system, name) < LATENCY[1], name


def test_sources_are_read_only_and_assumptions_are_marked():
    with pytest.raises(TypeError):
        gpu_specs.T4.sources["mfu"] = "changed"
    assert "ASSUMPTION" in gpu_specs.T4.sources["mfu"]
    assert "ASSUMPTION" in gpu_specs.KAGGLE_T4X2.sources["allreduce_busbw"]


def test_t4_has_no_bf16_or_tf32_peak():
    with pytest.raises(ValueError, match="bf16"):
        gpu_specs.T4.peak_flops("bf16")
    with pytest.raises(ValueError, match="tf32"):
        gpu_specs.T4.peak_flops("tf32")
    assert gpu_specs.T4.peak_flops("fp16") == 65e12
    assert gpu_specs.H100_SXM.peak_flops("bf16") == pytest.approx(989.5e12)


def test_the_h200_is_cited_like_the_h100_dense_and_with_its_own_memory():
    """NVIDIA's H200 page quotes tensor FLOP/s with sparsity, as the H100's sheet does: both are halved. The
    H200 is the H100's die with more, faster memory: the same dense peaks, its own memory figures."""
    h100, h200 = gpu_specs.H100_SXM, gpu_specs.H200_SXM
    assert h200.peak_flops("bf16") == pytest.approx(989.5e12)
    for precision in ("tf32", "fp16", "bf16"):
        assert h200.peak_flops(precision) == h100.peak_flops(precision)
        assert "sparsity" in h200.sources[f"{precision}_flops"] and "half" in h200.sources[f"{precision}_flops"]
    assert h200.fp32_flops == 67e12
    assert h200.memory_bandwidth == 4.8e12 and "4.8TB/s" in h200.sources["memory_bandwidth"]
    assert h200.memory_bytes == 141 * 2**30 and h200.usable_memory_bytes == 143156 * 2**20
    assert h200.usable_memory_bytes > h100.memory_bytes
    assert "ASSUMPTION" in h200.sources["mfu"] and h200.mfu == h100.mfu
    assert gpu_specs.evidence(h200, "bf16_flops") == "cited" and gpu_specs.evidence(h200, "mfu") == "assumed"


def test_the_h200_systems_one_gpu_and_an_hgx_node():
    one, node = SYSTEMS["H200x1"], SYSTEMS["H200x8"]
    assert one.gpu is node.gpu is gpu_specs.H200_SXM
    assert (one.count, node.count) == (1, 8)
    assert "PCIe Gen5: 128GB/s" in one.sources["count"]
    # NVLink 4 as on the H100 node: 900 GB/s both ways, 450 per direction; the all-reduce busbw measured on H200s
    assert node.link_bandwidth == gpu_specs.H100X8.link_bandwidth == 450e9
    assert node.allreduce_busbw == 475e9 and "issues/272" in node.sources["allreduce_busbw"]
    assert gpu_specs.evidence(node, "allreduce_busbw") == "cited"
    assert gpu_specs.evidence(node, "gather_busbw") == "assumed"
    for name in ("link_bandwidth", "allreduce_busbw", "gather_busbw", "alpha_step_s", "alpha_base_s"):
        assert getattr(one, name) == getattr(node, name) and one.sources[name] == node.sources[name]


def test_the_specs_do_not_need_torch():
    code = "import sys, distlab.predict.gpu_specs; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
