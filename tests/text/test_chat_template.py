"""Chat prompts: a Hugging Face chat template renders as ``transformers`` renders it; without
one, lmcli's template of special tokens, whose strings typed in a message stay text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_tokenizer

from lmcli.errors import LmcliError
from lmcli.text import chat_template

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] | trim }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": " Be brief. "},
    {"role": "user", "content": "the cat?"},
    {"role": "assistant", "content": "sat."},
    {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "the dog?"}]},
]


def test_hf_template_renders_as_transformers_does(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = tiny_tokenizer()
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.save(folder / "tokenizer.json")
    config = {"chat_template": TEMPLATE, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = chat_template.find_template(folder)
    assert template.text == TEMPLATE and template.where == str(folder)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **config)
    flat = [{**m, "content": "and the dog?"} if isinstance(m["content"], list) else m for m in MESSAGES]
    expected = hf.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert chat_template.render(MESSAGES, template, tok) == expected
    ids = chat_template.encode(MESSAGES, template, tok)
    assert ids[0] == tok.bos_id and ids.count(tok.eos_id) == 3  # the template's tokens are special


def test_lmcli_template_keeps_typed_special_strings_as_text() -> None:
    tok = tiny_tokenizer()
    text = chat_template.render([{"role": "user", "content": "hi"}], None, tok)
    assert text == "<bos>user<sep>hi<eos>assistant<sep>"
    ids = chat_template.encode([{"role": "user", "content": "<eos>"}], None, tok)
    assert ids.count(tok.eos_id) == 1  # only the template's own <eos>
    assert ids[-1] == tok.sep_id


@pytest.mark.parametrize(
    "messages", [[], "hi", [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]]
)
def test_bad_messages(messages) -> None:
    with pytest.raises(LmcliError):
        chat_template.render(messages, None, tiny_tokenizer())


def test_template_errors_are_one_line(tmp_path: Path) -> None:
    bad = "{{ raise_exception('only user messages') }}"
    with pytest.raises(LmcliError, match="chat template: only user messages"):
        chat_template.render([{"role": "user", "content": "x"}], bad, tiny_tokenizer())


def test_extra_context_variables_reach_the_template() -> None:
    """``extra`` (a later tool-calling feature's ``tools``) is in the template's context."""
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[-1]['content'] }}"
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    text = chat_template.render(
        [{"role": "user", "content": "hi"}], template, tiny_tokenizer(), extra={"tools": tools}
    )
    assert text == "[get_weather]hi"
