"""Where a run stands survives a save and a load: counters, history and
the random number generator's state."""

from __future__ import annotations

import torch

from distlab.train import TrainState


def test_train_state_round_trips_through_its_state_dict():
    state = TrainState(
        epoch=2, step_in_epoch=37, global_step=237, history=[{"epoch": 1, "train_loss": 0.5}], step_times_s=[0.1, 0.2]
    )
    saved = state.state_dict()
    expected_draw = torch.rand(4)  # what the generator gives next after the save
    restored = TrainState()
    restored.load_state_dict(saved)
    assert (restored.epoch, restored.step_in_epoch, restored.global_step) == (2, 37, 237)
    assert restored.history == state.history and restored.step_times_s == state.step_times_s
    assert torch.equal(torch.rand(4), expected_draw), "loading restores the RNG to where the save left it"
