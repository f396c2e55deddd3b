"""Constrained decoding: every row's text follows its own constraint (a JSON schema, any JSON
object, a regular expression, a Lark grammar) under every kind of tokenizer lmcli has, rows with
different constraints in one batch; bad constraints are one-line errors; compiled grammars are
bounded."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from helpers import TINY_TEXT, tiny_model, tiny_tokenizer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from lmcli.config.commands import SampleConfig
from lmcli.generate.constrain import Constraint, ConstraintError, GrammarMask, Grammars
from lmcli.generate.sampling import generate
from lmcli.text.tokenizer import Tokenizer

# A nested schema: objects, arrays, enums, numbers, required keys (bounded, so a random model ends).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "floor": {"type": "integer", "maximum": 9},
            },
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "home"],
    "additionalProperties": False,
}
TEXT = (
    TINY_TEXT + (json.dumps(SCHEMA) + '{"}[],:0123456789.-eE+ Ünï 日本') * 4
)  # every character the JSON needs


def sentencepiece_like() -> Tokenizer:
    """A Llama-2-like tokenizer: BPE over words that start with U+2581, bytes as <0xNN>."""
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    return Tokenizer(tok)


TOKENIZERS = {
    "char": lambda: tiny_tokenizer(TEXT, "char"),
    "byte": lambda: tiny_tokenizer(TEXT, "byte"),
    "bpe": lambda: tiny_tokenizer(TEXT, "bpe", vocab_size=400),
    "hf-sentencepiece": sentencepiece_like,
}


def sample(tok: Tokenizer, constraint: Constraint, n: int = 8, **settings) -> list[str]:
    model = tiny_model(tok.vocab_size + 3, block_size=320)  # wider than the tokenizer, as Qwen's
    grammars = Grammars(tok)
    cfg = SampleConfig(max_new_tokens=300, num_samples=n, temperature=1.0, **settings)
    out = generate(model, tok, [[tok.bos_id]], cfg, processors=lambda: (grammars.processor(constraint),))
    assert all(g.finish_reason == "eos" for g in out), [g.text for g in out]
    return [g.text for g in out]


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_json_schema_every_tokenizer(kind):
    tok = TOKENIZERS[kind]()
    for text in sample(tok, Constraint.json_schema(SCHEMA)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_bytes_of_tokens_decode_as_the_tokenizer_does():
    for make in TOKENIZERS.values():
        tok = make()
        tokens, specials = tok.token_bytes()
        ids = tok.encode('{"x": [1.5, "Ünï 日本"]} the cat')
        assert b"".join(tokens[i] for i in ids).decode() == tok.decode(ids)
        assert tok.eos_id in specials


def test_regex_grammar_and_json_object():
    tok = TOKENIZERS["bpe"]()
    for text in sample(tok, Constraint("regex", r"(cat|dog) [0-9]{2,3}")):
        assert re.fullmatch(r"(cat|dog) [0-9]{2,3}", text)
    lark = 'start: "the " ANIMAL " sat on the " THING "."\nANIMAL: "cat" | "dog"\nTHING: "mat" | "log"'
    for text in sample(tok, Constraint("grammar", lark)):
        assert re.fullmatch(r"the (cat|dog) sat on the (mat|log)\.", text)
    mask = Grammars(tok).processor(Constraint("json_object"))  # any object: the first token opens it
    allowed = torch.isfinite(GrammarMask.apply(torch.zeros(1, tok.vocab_size), [mask])[0]).nonzero()
    tokens, _ = tok.token_bytes()
    assert allowed.numel() and all(tokens[i].startswith(b"{") for i in allowed.flatten().tolist())
    for t in tok.encode('{"a": [1, {"b": null}], "c": "x"}'):
        mask.accept(t)
    assert mask.complete


def test_rows_with_different_constraints_share_a_batch():
    """One engine: a schema row, a regex row and a free row; each follows its own, and the
    constrained rows give what they give alone."""
    tok = TOKENIZERS["bpe"]()
    model = tiny_model(tok.vocab_size)
    grammars = Grammars(tok)
    kinds = iter([Constraint.json_schema(SCHEMA), Constraint("regex", "[a-z]{5}"), None])
    cfg = SampleConfig(max_new_tokens=80, num_samples=3, temperature=1.0)

    def processors():
        c = next(kinds)
        return (grammars.processor(c),) if c is not None else ()

    together = generate(model, tok, [[tok.bos_id]], cfg, processors=processors)
    jsonschema.validate(json.loads(together[0].text), SCHEMA)
    assert re.fullmatch("[a-z]{5}", together[1].text)
    alone = generate(
        model,
        tok,
        [[tok.bos_id]],
        cfg,
        samples=range(1, 2),
        processors=lambda: (grammars.processor(Constraint("regex", "[a-z]{5}")),),
    )
    assert alone[0].text == together[1].text


def test_a_grammar_the_vocabulary_cannot_spell_is_an_error():
    tok = tiny_tokenizer()  # no "y" in its characters
    with pytest.raises(ConstraintError, match="no token of the vocabulary"):
        sample(tok, Constraint("regex", "the yak"), n=1)


def test_a_complete_grammar_allows_only_the_end():
    tok = TOKENIZERS["char"]()
    mask = Grammars(tok).processor(Constraint("regex", "cat"))
    for t in tok.encode("cat"):
        mask.accept(t)
    assert mask.complete
    logits = GrammarMask.apply(torch.zeros(1, tok.vocab_size), [mask])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tok.eos_id]
    # min_new_tokens cannot keep a finished grammar going: the row ends with <eos>
    assert sample(tok, Constraint("regex", "cat"), n=2, min_new_tokens=10) == ["cat", "cat"]


@pytest.mark.parametrize(
    "constraint, message",
    [
        (Constraint.json_schema({"type": "nonsense"}), "invalid JSON schema: "),
        (Constraint("json_schema", "{not json"), "invalid JSON schema: "),
        (Constraint("regex", "a(b"), "invalid regex: "),
        (Constraint("grammar", "start: foo"), "invalid grammar: "),
        (Constraint("regex", "a" * 300_000), "the regex is 300,000 characters: more than 262,144"),
        (
            Constraint("json_schema", '{"type": "array", "items": ' * 200 + "{}" + "}" * 200),
            "invalid JSON schema: ",
        ),
    ],
)
def test_bad_constraints_are_one_line_errors(constraint, message):
    with pytest.raises(ConstraintError) as err:
        Grammars(TOKENIZERS["bpe"]()).compile(constraint)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_compiled_grammars_are_bounded():
    grammars = Grammars(TOKENIZERS["char"](), cache=2)
    first = grammars.compile(Constraint("regex", "a"))
    grammars.compile(Constraint("regex", "b"))
    assert grammars.compile(Constraint("regex", "a")) is first  # kept: used last
    grammars.compile(Constraint("regex", "c"))
    assert len(grammars) == 2
    assert grammars.compile(Constraint("regex", "b")) is not None and len(grammars) == 2
