"""The course's own DDP refuses to hang: a parameter that gets no gradient
is named in one sentence. (That NaiveDDP and BucketedDDP train exactly like
torch DDP and like one process is a row of tests/test_implementations.py.)"""

from __future__ import annotations

import pytest
import torch

from distlab.errors import DistlabError
from distlab.parallel.mini_ddp import BucketedDDP, NaiveDDP
from distlab.testing import ToyWithUnusedLayer, run_ranks


def unused_parameter_error(runtime, wrapper: str):
    model = {"naive": NaiveDDP, "bucketed": BucketedDDP}[wrapper](ToyWithUnusedLayer())
    try:
        model(torch.randn(3, 4)).sum().backward()
    except DistlabError as error:
        return str(error)
    return None


@pytest.mark.parametrize("wrapper", ["naive", "bucketed"])
def test_unused_parameter_is_named_not_hung(tmp_path, wrapper):
    messages = run_ranks(unused_parameter_error, 2, tmp_path, wrapper)
    assert all(m is not None and "unused." in m for m in messages), messages
