"""The recipes shipped in configs/ are valid configs: every option known, every value accepted."""

import re
from pathlib import Path

import pytest

from lmcli.config.files import load_config_file
from lmcli.train.run_folder import resolve_configs

PROJECT = Path(__file__).resolve().parents[2]
RECIPES = sorted((PROJECT / "configs").glob("*.toml"))


def test_every_recipe_the_docs_name_exists_and_every_recipe_is_documented() -> None:
    """A user copies `--config configs/X.toml` from the README or docs/: X is there, and no
    recipe sits in configs/ without a page that says what it is for."""
    pages = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
    named = {m for page in pages for m in re.findall(r"configs/([\w.-]+\.toml)", page.read_text())}
    assert named, "the docs name no recipe"
    assert named <= {p.name for p in RECIPES}, f"named but missing: {named - {p.name for p in RECIPES}}"
    assert {p.name for p in RECIPES} <= named, f"undocumented: {({p.name for p in RECIPES}) - named}"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_resolves_to_configs(path: Path) -> None:
    model, train = resolve_configs(load_config_file(path), {})
    assert model.n_layer > 0 and train.optim.batch_size > 0
    # each recipe says how long it runs: a step count or a wall-time budget
    assert train.schedule.max_steps is not None or train.schedule.max_time is not None
