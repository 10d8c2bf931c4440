"""A strategy in the registry is known everywhere the course reasons about strategies: a new one that a
prediction, the checkpoint layouts or the configuration does not know fails here, not at run time."""

from __future__ import annotations

import pytest

from distlab.checkpoint import LAYOUTS
from distlab.config import TrainConfig
from distlab.parallel import STRATEGIES
from distlab.parallel.checkpoint_state import FLAT, FLAT_OPTIMIZER, PER_PARAMETER
from distlab.predict.memory import STAGE, expected_state_bytes
from distlab.predict.traffic import expected_bytes_per_step


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_is_known_to_the_predictions_the_checkpoints_and_the_command_line(name):
    strategy = STRATEGIES[name]
    assert strategy.name == name
    assert STAGE[name] == strategy.zero_stage, "the memory model and the strategy disagree on what is sharded"
    assert sum(expected_state_bytes(1_000_000, name, 2).values()) > 0
    if name != "single" and name != "fsdp":  # fsdp's traffic is derived through zero3's (per unit, padded)
        assert expected_bytes_per_step(name, 1_000_000, 2) > 0
    assert LAYOUTS[name] in {PER_PARAMETER, FLAT_OPTIMIZER, FLAT}
    TrainConfig.from_flags(strategy=name)  # the command line accepts it and validates its defaults
