"""The recipes shipped in configs/ are valid configs: every option known, every value accepted."""

from pathlib import Path

import pytest

from lmcli.config import load_config_file
from lmcli.train.run_folder import resolve_configs

RECIPES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def test_there_are_recipes() -> None:
    assert len(RECIPES) >= 4


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_resolves_to_configs(path: Path) -> None:
    model, train = resolve_configs(load_config_file(path), {})
    assert model.n_layer > 0 and train.optim.batch_size > 0
    # each recipe says how long it runs: a step count or a wall-time budget
    assert train.schedule.max_steps is not None or train.schedule.max_time is not None
