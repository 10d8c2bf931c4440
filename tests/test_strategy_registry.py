"""A strategy answers for itself: the registry line and its class are all a new strategy needs for the
predictions, the checkpoint layouts and the command line to know it; one that names a prediction, a layout or
an option nobody has fails here, not at run time."""

from __future__ import annotations

from dataclasses import fields

import pytest

from distlab.checkpoint import LAYOUTS
from distlab.config import ParallelConfig, TrainConfig
from distlab.errors import DistlabError
from distlab.parallel import STRATEGIES
from distlab.parallel.checkpoint_state import FLAT, FLAT_OPTIMIZER, PER_PARAMETER
from distlab.parallel.flat_param import resolve_collectives
from distlab.predict.costmodel import collective_calls
from distlab.predict.memory import STAGE, expected_state_bytes
from distlab.predict.traffic import expected_bytes_per_step


class _Reading:
    """A ParallelConfig that writes down each field read from it."""

    def __init__(self):
        object.__setattr__(self, "read", set())
        object.__setattr__(self, "config", ParallelConfig())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self.config, name)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_is_known_to_the_predictions_the_checkpoints_and_the_command_line(name):
    strategy = STRATEGIES[name]
    assert strategy.name == name
    model = strategy.predicted_by
    assert model in STAGE, f"{name} names no prediction of distlab.predict.memory.STAGE"
    assert (STAGE[model] == 3) == strategy.shards_parameters, "the prediction and the strategy disagree"
    assert sum(expected_state_bytes(1_000_000, model, 2).values()) > 0
    assert expected_bytes_per_step(model, 1_000_000, 2) > 0
    assert LAYOUTS[name] in {PER_PARAMETER, FLAT_OPTIMIZER, FLAT}
    TrainConfig.from_flags(strategy=name)  # the command line accepts it and validates its defaults


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strategy_reads_only_the_options_it_names(name):
    reading = _Reading()
    STRATEGIES[name].from_config(reading)
    assert reading.read <= set(STRATEGIES[name].options), "from_config reads an option the strategy does not name"
    assert set(STRATEGIES[name].options) <= {field.name for field in fields(ParallelConfig)}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_another_strategys_option_is_refused_in_one_line(name):
    for option in {o for other in STRATEGIES.values() for o in other.options} - set(STRATEGIES[name].options):
        default = next(field.default for field in fields(ParallelConfig) if field.name == option)
        changed = {bool: not default, int: 2, float: 0.5}.get(type(default)) if not isinstance(default, str) else None
        if changed is None:  # a choice: any other of its values
            changed = next(c for c in ("root", "explicit", "bf16", "param", "ring", "torch") if c != default)
        with pytest.raises(DistlabError, match=f"which --strategy {name} is not"):
            TrainConfig.from_flags(strategy=name, **{option: changed})


def test_an_option_changes_what_a_strategy_is_predicted_by():
    no_reshard = ParallelConfig(fsdp_reshard_after_forward=False)
    assert STRATEGIES["zero3"].from_config(no_reshard).predicted_by == "zero3-no-reshard"
    assert STRATEGIES["fsdp"].from_config(no_reshard).predicted_by == "fsdp-no-reshard"
    assert STRATEGIES["fsdp"].from_config(ParallelConfig()).predicted_by == "fsdp"


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_collectives_a_strategy_runs_are_those_its_prediction_costs(name, backend):
    """The ring-or-torch rule has one home (distlab.comm.implementations): what resolve_collectives makes a
    strategy run by default is what collective_calls costs for it, on gloo and on NCCL."""
    strategy = STRATEGIES[name].from_config(ParallelConfig())
    chosen = resolve_collectives(strategy.collectives, backend) if hasattr(strategy, "collectives") else "torch"
    units = [[(7, 11), (7,)], [(5, 7), (5,)], []]  # two shard units and an empty root
    predicted = collective_calls(strategy.predicted_by, units, 2, backend)
    assert {impl for _, impl, _ in predicted} <= {chosen}, f"{name} on {backend} runs {chosen}: {predicted}"
    assert predicted or strategy.predicted_by == "single"
