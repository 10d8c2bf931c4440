"""The course's own DDP refuses to hang: a parameter that gets no gradient
is named in one sentence. (That NaiveDDP and BucketedDDP train exactly like
torch DDP and like one process is a row of tests/test_implementations.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distlab.parallel.mini_ddp import BucketedDDP, NaiveDDP
from distlab.runtime import DistlabError
from distlab.testing import run_ranks


class _HasUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def unused_parameter_error(runtime, wrapper: str):
    model = {"naive": NaiveDDP, "bucketed": BucketedDDP}[wrapper](_HasUnusedLayer())
    try:
        model(torch.randn(3, 4)).sum().backward()
    except DistlabError as error:
        return str(error)
    return None


@pytest.mark.parametrize("wrapper", ["naive", "bucketed"])
def test_unused_parameter_is_named_not_hung(tmp_path, wrapper):
    messages = run_ranks(unused_parameter_error, 2, tmp_path, wrapper)
    assert all(m is not None and "unused." in m for m in messages), messages
