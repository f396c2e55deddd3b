"""The one mechanism that saves and restores training state: every stateful part registered once
in a ``StateRegistry``, laid out in ``trainer_state.pt`` as every run folder so far has it."""

from __future__ import annotations

import torch
from helpers import train_config

from lmcli.config.model import ModelConfig
from lmcli.model.transformer import Transformer
from lmcli.train.averaging import EMA
from lmcli.train.distributed import Dist
from lmcli.train.setup import training_state
from lmcli.train.state import COUNTERS, StateRegistry, TrainState

MODEL = ModelConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8)


class Counter:
    """A part of training of a kind the registry has never seen."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_the_layout_is_lmcli_0_1s_and_any_part_round_trips() -> None:
    counter = Counter()
    counter.n = 5
    saved = StateRegistry({COUNTERS: TrainState(step=3, cursor=24), "counter": counter}).state_dict()
    assert saved["step"] == 3 and saved["cursor"] == 24 and saved["counter"] == {"n": 5}  # counters on top
    state, again = TrainState(), Counter()
    StateRegistry({COUNTERS: state, "counter": again}).load_state_dict(saved)
    assert (state.step, state.cursor, again.n) == (3, 24, 5)


def test_a_new_runs_parts_are_registered_once_and_an_average_added_on_resume_starts_fresh() -> None:
    model = Transformer(MODEL)
    cpu = torch.device("cpu")
    _, _, state, states = training_state(model, train_config(), None, Dist(), cpu)
    assert list(states.parts) == [COUNTERS, "optimizer", "scaler", "rng"]
    state.step = 7
    saved = states.state_dict()
    assert set(saved) == {*TrainState().state_dict(), "optimizer", "scaler", "rng"}

    averages = [EMA(model, 0.9)]
    _, _, resumed, states = training_state(model, train_config(ema=0.9), None, Dist(), cpu, averages)
    assert isinstance(averages[0], EMA) and states.parts["ema"] is averages[0]
    fresh = {k: v.clone() for k, v in averages[0].state_dict().items()}
    states.load_state_dict(saved)  # saved without an average: it starts from here
    assert resumed.step == 7
    assert all(torch.equal(v, fresh[k]) for k, v in averages[0].state_dict().items())
    assert "ema" in states.state_dict()  # and is saved from now on
