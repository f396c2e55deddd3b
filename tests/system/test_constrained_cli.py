"""`lmcli sample` and `lmcli chat` with a constraint (`--json-schema`, `--regex`, `--grammar`):
every sample follows it; a bad constraint is a one-line error, exit 2, before any decoding."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from helpers import TINY_TEXT, assert_one_line_error, make_run
from helpers import run_cli as run

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "kind": {"enum": ["cat", "dog"]},
        "sizes": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "owner"],
    "additionalProperties": False,  # (as OpenAI's strict schemas): else any key may follow
}
TEXT = TINY_TEXT + (json.dumps(SCHEMA) + " 0123456789.-+eE truefalsenull\n") * 3


@pytest.fixture(scope="module")
def json_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("structured") / "run", TEXT, "bpe", block_size=128)


def test_sample_json_schema_every_sample_validates(json_run: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    args = ["sample", str(json_run), "-p", "", "--json-schema", str(tmp_path / "schema.json"), "--json"]
    code, out, err = run(
        [*args, "--num-samples", "40", "--max-new-tokens", "100", "--temperature", "1"], capsys
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 40 and all(r["finish_reason"] == "eos" for r in records)
    for r in records:
        jsonschema.validate(json.loads(r["text"]), SCHEMA)


def test_sample_regex_and_grammar(json_run: Path, tmp_path: Path, capsys) -> None:
    code, out, _ = run(
        ["sample", str(json_run), "-p", "", "--regex", "(cat|dog)-[0-9]{3}", "--num-samples", "4"], capsys
    )
    texts = [line for line in out.splitlines() if not line.startswith("---")]
    assert code == 0 and len(texts) == 4 and all(re.fullmatch("(cat|dog)-[0-9]{3}", t) for t in texts)
    (tmp_path / "g.lark").write_text('start: "the " ("cat" | "dog") " sat."')
    code, out, _ = run(["sample", str(json_run), "-p", "", "--grammar", str(tmp_path / "g.lark")], capsys)
    assert code == 0 and re.fullmatch(r"the (cat|dog) sat\.", out.strip())


def test_chat_json_schema(json_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    stdin = json.dumps({"messages": [{"role": "user", "content": "a cat"}]})
    args = ["chat", str(json_run), "--json", "--json-schema", str(tmp_path / "schema.json")]
    code, out, err = run([*args, "--max-new-tokens", "90"], capsys, stdin=stdin, monkeypatch=monkeypatch)
    assert code == 0, err
    jsonschema.validate(json.loads(json.loads(out)["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--json-schema", "{schema}"], "invalid JSON schema: "),
        (["--json-schema", "{missing}"], "cannot read JSON schema "),
        (["--regex", "[0-9"], "invalid regex: "),
        (["--regex", "a", "--grammar", "g.lark"], "give one constraint at most: --regex and --grammar"),
    ],
)
def test_bad_constraints(json_run: Path, tmp_path: Path, capsys, flags, message) -> None:
    (tmp_path / "bad.json").write_text('{"type": "object", "properties": {"a": {"type": "nope"}}}')
    flags = [f.format(schema=tmp_path / "bad.json", missing=tmp_path / "none.json") for f in flags]
    code, out, err = run(["sample", str(json_run), "-p", "", *flags], capsys)
    assert_one_line_error(code, err, message)
    assert out == ""
