"""Training options in sections (``cfg.optim.lr``), named flat everywhere a user sees them: flags,
TOML keys (in ``[optim]``-style tables, flat, or in the old ``[model]``/``[train]`` tables) and
the ``config.json`` of run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import train_config

from lmcli.config.files import (
    field_names,
    from_dict,
    load_config_file,
    replace_options,
    sections_of,
    stored_fields,
    to_dict,
)
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.train.run_folder import resolve_configs

OLD_RUN = Path(__file__).parents[1] / "fixtures" / "lmcli-0.1-run"

FLAT = """
tokenizer = "byte"
n-layer = 1
lr = 0.002
max-steps = 3
lora-rank = 0
eval-interval = 3
"""
TABLES = """
[model]
n-layer = 1
[train]
tokenizer = "byte"
lr = 0.002
max_steps = 3
lora_rank = 0
eval-interval = 3
"""
SECTIONS = """
[model]
n-layer = 1
[data]
tokenizer = "byte"
[optim]
lr = 0.002
[schedule]
max-steps = 3
[lora]
lora-rank = 0
[train.validation]
eval-interval = 3
"""


def test_sectioned_flat_and_old_table_files_give_the_same_configs(tmp_path: Path) -> None:
    resolved = []
    for name, text in (("flat", FLAT), ("tables", TABLES), ("sections", SECTIONS)):
        (tmp_path / f"{name}.toml").write_text(text)
        resolved.append(resolve_configs(load_config_file(tmp_path / f"{name}.toml"), {}))
    assert resolved[0] == resolved[1] == resolved[2]
    model, train = resolved[0]
    assert model.n_layer == 1 and train.data.tokenizer == "byte" and train.optim.lr == 0.002
    assert train.schedule.max_steps == 3 and train.validation.eval_interval == 3


def test_a_section_table_holds_only_its_own_options(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text('[optim]\nlr = 0.1\ntokenizer = "byte"\n')
    with pytest.raises(LmcliError, match=r"\[optim\] has no option\(s\) tokenizer"):
        load_config_file(tmp_path / "bad.toml")


def test_every_option_is_named_flat_once_and_round_trips() -> None:
    cfg = train_config(lr=3e-4, max_steps=7, lora_rank=0, source=None, ema=0.5, keep_last=2)
    flat = to_dict(cfg)
    assert set(flat) == field_names(TrainConfig) and all(not isinstance(v, dict) for v in flat.values())
    assert sum(len(field_names(s)) for s in sections_of(TrainConfig).values()) < len(flat)  # + its own
    assert from_dict(TrainConfig, json.loads(json.dumps(flat))) == cfg
    assert (cfg.optim.lr, cfg.schedule.max_steps, cfg.checkpoint.keep_last) == (3e-4, 7, 2)
    longer = replace_options(cfg, max_steps=9, lr=1e-3)
    assert (longer.schedule.max_steps, longer.optim.lr, longer.optim.ema) == (9, 1e-3, 0.5)
    with pytest.raises(LmcliError, match="unknown option"):
        replace_options(cfg, colour=3)


def test_a_run_folder_of_lmcli_0_1_names_only_options_that_still_exist() -> None:
    saved = json.loads((OLD_RUN / "config.json").read_text())["train"]
    assert set(saved) <= field_names(TrainConfig)
    cfg = from_dict(TrainConfig, stored_fields(TrainConfig, saved))
    # options it predates take the value they had then; paths lmcli writes to are never taken
    assert (cfg.optim.optimizer, cfg.schedule.schedule, cfg.data.cache_dir) == ("adamw", "cosine", None)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lora_dropout": 1.0}, "lora-dropout must be in [0, 1), got 1.0"),
        ({"max_time": "soon"}, "invalid duration 'soon'"),
        ({"select": "val_f1"}, "invalid select 'val_f1': choose one of"),
        ({"batch_size": "many"}, "batch-size must be an integer, got 'many'"),
        ({"warmup_steps": -1}, "warmup-steps must be >= 0, got -1"),
        ({"lora_rank": 2}, "--lora-rank needs --init-from"),
    ],
)
def test_a_bad_value_in_any_section_is_one_line_naming_its_flag(options: dict, message: str) -> None:
    with pytest.raises(LmcliError) as info:
        train_config(**options)
    assert message in str(info.value) and "\n" not in str(info.value)
