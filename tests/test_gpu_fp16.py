"""The fp16 chapter's GPU checks (``book/fp16.md``): fp16 training with torch's GradScaler on CUDA, and fp16 against
bf16 matmul time on the GPU present, recorded.

GPU tier (``-m gpu``): not run in CI, and never run where this file was written (a 2-core CPU machine, no GPU):
every test here is skipped without CUDA. ``pytest -m gpu`` collects it (``tests/conftest.py``'s ``GPU_FILES``)
and ``scripts/gpu_check.py`` runs it; alone: ``python -m pytest -m gpu tests/test_gpu_fp16.py -rA``. It is not
in the quick selection. On a
T4, ``torch.cuda.is_bf16_supported()`` may answer True while Turing has no bf16 tensor cores (the T4 datasheet lists
FP16, INT8 and INT4 only): the timing then shows what bf16 costs there. The timing is recorded three ways: pytest's
``record_property`` (in the JUnit XML), a printed line (``-rA`` shows it), and ``fp16-vs-bf16-matmul.json`` in
``$DISTLAB_GPU_CHECK_REPORT`` where ``scripts/gpu_check.py`` sets it. Its CPU twin is ``tests/test_fp16.py``: the
same scaled step, skip and back-off on the CPU's autocast fp16.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU here: run python -m pytest -m gpu where one is"
    ),
]


def test_fp16_training_with_the_scaler_on_cuda():
    """A small MLP trained in autocast fp16 with torch's GradScaler on CUDA: a scale too large at first overflows
    fp16, so the first steps are skipped and the scale halves each time; then every step is taken, the weights stay
    finite and the loss falls."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**30)  # loss x 2^30 overflows fp16's 65,504 at once
    x, y = torch.randn(512, 64, device=device), torch.randn(512, 1, device=device)
    losses, skipped = [], 0
    for _ in range(60):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
        losses.append(loss.item())
    assert skipped >= 1, "no step was skipped: the first scale did not overflow fp16"
    assert scaler.get_scale() < 2.0**30
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < 0.9 * losses[skipped], losses


def _matmul_ms(dtype: torch.dtype, n: int = 4096, repeats: int = 20) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    for _ in range(3):  # warm-up: cuBLAS picks its kernel
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def test_fp16_against_bf16_matmul_time_is_recorded(record_property, tmp_path):
    """A 4096 x 4096 matmul in fp16 and in bf16 on the GPU present, timed with CUDA events (20 repeats after a
    warm-up): both positive; bf16 timed only where torch says the GPU supports it. What it measures is recorded,
    not asserted against a ratio: on an A100, H100 or H200 both run on tensor cores; on a T4 bf16 is emulated."""
    props = torch.cuda.get_device_properties(0)
    row = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
           "bf16_supported": torch.cuda.is_bf16_supported(), "n": 4096}  # fmt: skip
    row["fp16_ms"] = _matmul_ms(torch.float16)
    if row["bf16_supported"]:
        row["bf16_ms"] = _matmul_ms(torch.bfloat16)
        row["bf16_over_fp16"] = row["bf16_ms"] / row["fp16_ms"]
    row["fp16_tflops"] = 2 * 4096**3 / (row["fp16_ms"] / 1e3) / 1e12
    for key, value in row.items():
        record_property(key, value)
    print("fp16 vs bf16 matmul:", json.dumps(row))
    out = Path(os.environ.get("DISTLAB_GPU_CHECK_REPORT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp16-vs-bf16-matmul.json").write_text(json.dumps(row, indent=1) + "\n")
    assert row["fp16_ms"] > 0 and row.get("bf16_ms", 1.0) > 0
