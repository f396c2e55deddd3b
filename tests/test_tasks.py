"""Tasks as objects: the one place that knows lm, translation, sft, dpo, grpo and distill apart."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest
from helpers import tiny_tokenizer, train_config

from lmcli.config.train import Task
from lmcli.generate.decoding import make_prompt
from lmcli.tasks import TASKS, SourcePrompt, TextPrompt, make_task

LMCLI = Path(__file__).resolve().parents[1] / "lmcli"


def imports(path: Path) -> set[str]:
    """The lmcli modules a file imports, wherever the import stands (local ones included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmcli"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lmcli")}
    return found


NEEDS = {
    "dpo": dict(init_from="m"),
    "grpo": dict(init_from="m", reward=("number",)),
    "distill": dict(teacher="t"),
}  # post-training's and distillation's own


def test_every_task_option_has_its_class() -> None:
    assert set(TASKS) == set(get_args(Task))
    for name, cls in TASKS.items():
        assert cls.name == name and isinstance(make_task(train_config(task=name, **NEEDS.get(name, {}))), cls)


def test_the_task_module_sits_below_everything_and_decoders_read_no_data_module() -> None:
    assert imports(LMCLI / "tasks.py") == {"lmcli.errors"}  # config.py imports it: no cycle
    for path in (LMCLI / "generate").glob("*.py"):
        assert not any(m.startswith("lmcli.data") for m in imports(path)), path


@pytest.mark.parametrize("name", ["lm", "sft"])
def test_text_prompts(name: str) -> None:
    tok = tiny_tokenizer()
    form = make_task(train_config(task=name)).prompt
    assert type(form) is TextPrompt and not form.prefix_lm and form.shows_text
    p = make_prompt("the cat", tok, 32, form)
    assert p.ids == [tok.bos_id, *tok.encode("the cat")] and not p.truncated
    long = make_prompt("the cat sat " * 5, tok, 32, form)  # keeps its end, as the context allows
    assert long.truncated and long.ids == [tok.bos_id, *tok.encode("the cat sat " * 5)][-31:]
    assert form.decodes("") and form.input_length(p.ids) == len(p.ids)


@pytest.mark.parametrize("prefix_lm", [False, True])
def test_a_translation_prompt_is_a_source_cut_to_half_the_context(prefix_lm: bool) -> None:
    tok = tiny_tokenizer()
    cfg = train_config(task="translation", source="s", target="t", prefix_lm=prefix_lm)
    task = make_task(cfg)
    form = task.prompt
    assert isinstance(form, SourcePrompt) and form.prefix_lm == task.prefix_lm == prefix_lm
    p = make_prompt("the cat sat on the mat", tok, 32, form)
    assert p.ids == [tok.bos_id, *tok.encode("the cat sat on the mat")[:14], tok.sep_id] and p.truncated
    assert form.input_length(p.ids) == 14 and not form.decodes(" ") and not form.shows_text
    assert not task.chat and task.refusal("use X") == "this is a translation model: use X"


def test_defaults_and_the_bleu_hook_follow_the_task() -> None:
    lm, tr = make_task(train_config()), make_task(train_config(task="translation", bleu_interval=3))
    assert (lm.default_optimizer(), lm.default_schedule(), lm.default_metric()) == ("muon", "wsd", "val_loss")
    assert (tr.default_optimizer(), tr.default_schedule(), tr.default_metric()) == (
        "adamw",
        "cosine",
        "val_bleu",
    )
    assert not lm.wants_bleu(3) and tr.wants_bleu(3) and not tr.wants_bleu(4)
    assert not make_task(train_config(task="translation", bleu_samples=0)).wants_bleu(3)
    assert make_task(train_config(task="sft")).examples == "conversations" and lm.examples is None


def test_post_training_tasks_read_their_own_options_only() -> None:
    dpo, grpo = (
        make_task(train_config(task="dpo", **NEEDS["dpo"])),
        make_task(train_config(task="grpo", **NEEDS["grpo"])),
    )
    assert (dpo.sequences(), grpo.sequences(), make_task(train_config()).sequences()) == (2, 8, 1)
    assert (dpo.default_metric(), grpo.default_metric()) == ("val_loss", "val_reward")
    assert dpo.chat and grpo.chat and not dpo.own_split and type(grpo.prompt) is TextPrompt


def test_a_task_gives_its_defaults_unless_told_otherwise() -> None:
    """--task translation takes a BPE vocabulary over both languages unless a tokenizer is given;
    the language model keeps the config's default."""
    from lmcli.train.run_folder import resolve_configs

    def tokenizer(file: dict, cli: dict) -> str:
        return resolve_configs(file, cli)[1].data.tokenizer

    assert tokenizer({}, {"task": "translation"}) == "bpe"
    assert tokenizer({}, {"task": "translation", "tokenizer": "char"}) == "char"
    assert tokenizer({"tokenizer": "char"}, {"task": "translation"}) == "char"
    assert tokenizer({}, {}) == train_config().data.tokenizer != "bpe"
