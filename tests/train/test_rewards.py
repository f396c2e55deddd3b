"""Verifiable rewards: final numbers in GSM8K's forms, exact and regex matches, JSON and JSON
schemas (against the jsonschema library), the length penalty, and a user's own function whose
errors are one line naming the row."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from lmcli.errors import LmcliError
from lmcli.train.post.rewards import Rewards, canonical_schema, final_number, make_verifier, matches_schema

ROW = {"prompt": "q", "answer": "Natalia sold 48/2 = 24 clips in May.\n#### 72"}


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("so she has 5 + 3 = 8 apples.\n#### 8", "8"),
        ("#### 1,000 then 7", "1000"),  # the marked number wins over a later one
        ("The answer is $1,234.50.", "1234.50"),
        ("first 3, then the answer is: -7, checked with 12", "-7"),
        ("48 then 24 then 72.", "72"),  # no mark: the last number
        ("no digits here", None),
    ],
)
def test_final_number(text: str, number: str | None) -> None:
    assert final_number(text) == (None if number is None else Decimal(number))


def test_number_reward_reads_a_gsm8k_answer() -> None:
    reward = make_verifier("number")
    assert reward("q", "She sold 24, so 48 + 24 = 72.", ROW) == 1.0
    assert reward("q", "the answer is 72.0", ROW) == 1.0
    assert reward("q", "#### 71", ROW) == 0.0
    assert reward("q", "I do not know", ROW) == 0.0
    assert reward("q", "12", {"answer": 12}) == 1.0  # a JSON number as the answer


def test_exact_regex_json_and_length() -> None:
    assert make_verifier("exact")("q", "  Paris\n", {"answer": "Paris"}) == 1.0
    assert make_verifier("exact")("q", "paris", {"answer": "Paris"}) == 0.0
    regex = make_verifier(r"regex:\d+ apples")
    assert regex("q", " 12 apples ", {}) == 1.0 and regex("q", "12 apples, no", {}) == 0.0
    assert make_verifier("json")("q", ' {"a": [1, 2]} ', {}) == 1.0
    assert make_verifier("json")("q", "{'a': 1}", {}) == 0.0
    assert make_verifier("json")("q", "NaN", {}) == 0.0
    length = make_verifier("length:10")
    assert [length("q", "x" * n, {}) for n in (5, 10, 15, 20, 40)] == [0.0, 0.0, -0.5, -1.0, -1.0]


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"x": {"enum": ["a", "b"]}, "n": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["x"],
    },
    {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]},
    },
]
DOCUMENTS = [
    '{"a": 1}',
    '{"b": "x", "a": 1}',
    '{"b": "x"}',
    '{"a": "1"}',
    '{"a": 1, "c": 2}',
    '{"a": 1.0}',
    '{"name": "bob", "tags": ["x"]}',
    '{"tags": ["x"], "name": "bob"}',
    '{"name": "bobbyyy", "tags": ["x"]}',
    '{"name": "bob", "tags": []}',
    '{"name": "bob", "tags": ["x"], "z": 1}',
    '{"x": "a", "n": 3.5}',
    '{"x": "c"}',
    '{"n": 11, "x": "b"}',
    '{"n": -1, "x": "a"}',
    '[{"k": true}, {"k": false}]',
    '[{"k": 1}]',
    "[]",
    '"text"',
]


def test_schema_check_agrees_with_jsonschema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for schema in SCHEMAS:
        for doc in DOCUMENTS:
            value = json.loads(doc)
            expected = jsonschema.Draft202012Validator(schema).is_valid(value)
            assert matches_schema(value, canonical_schema(schema)) == expected, (schema, doc)


def test_schema_reward_from_a_file_or_the_row(tmp_path: Path) -> None:
    file = tmp_path / "schema.json"
    file.write_text(json.dumps(SCHEMAS[0]))
    from_file = make_verifier(f"json_schema:{file}")
    assert from_file("q", '{"b": "x", "a": 2}', {}) == 1.0
    assert from_file("q", '{"b": "x"}', {}) == 0.0 and from_file("q", "not json", {}) == 0.0
    from_row = Rewards(["json_schema"])
    assert from_row.score("q", '{"x": "b"}', {"schema": SCHEMAS[2]}, "f:1") == [1.0]
    with pytest.raises(LmcliError, match=r'^f:3: --reward json_schema needs a "schema" object'):
        from_row.check({"prompt": "q"}, "f:3")
    file.write_text("{not json")
    with pytest.raises(LmcliError, match="cannot read a JSON schema"):
        make_verifier(f"json_schema:{file}")


def test_rewards_add_up_per_verifier_and_check_rows() -> None:
    rewards = Rewards(["number", "length:4", r"regex:.*\d"])
    assert rewards.names == ["number", "length", "regex"]
    assert rewards.score("q", "it is 72", ROW, "f:1") == [1.0, -1.0, 1.0]
    with pytest.raises(LmcliError, match=r'^f:2: --reward number needs an "answer" holding a number$'):
        rewards.check({"prompt": "q", "answer": "none"}, "f:2")
    with pytest.raises(LmcliError, match="--task grpo needs --reward"):
        Rewards([])


@pytest.mark.parametrize("spec", ["nope", "regex", "regex:(", "length:0", "length:x"])
def test_bad_reward_specs_are_one_line(spec: str) -> None:
    with pytest.raises(LmcliError, match=r"^--reward "):
        make_verifier(spec)


def test_a_users_function(tmp_path: Path) -> None:
    file = tmp_path / "my_reward.py"
    file.write_text(
        "def brevity(prompt, reply, row):\n"
        "    return 1.0 if len(reply) < row['limit'] else 0.0\n"
        "def broken(prompt, reply, row):\n"
        "    return row['missing']\n"
        "def wrong_type(prompt, reply, row):\n"
        "    return 'yes'\n"
    )
    rewards = Rewards([f"{file}:brevity"])
    assert rewards.names == ["brevity"]
    assert rewards.score("q", "ok", {"limit": 5}, "f:1") == [1.0]
    assert rewards.score("q", "too long", {"limit": 5}, "f:1") == [0.0]
    with pytest.raises(LmcliError) as exc:
        Rewards([f"{file}:broken"]).score("q", "r", {"limit": 5}, "prompts.jsonl:7")
    assert str(exc.value) == f"prompts.jsonl:7: --reward {file}:broken: KeyError: 'missing'"
    with pytest.raises(LmcliError, match=r"^prompts.jsonl:7: .*returned 'yes', not a finite number$"):
        Rewards([f"{file}:wrong_type"]).score("q", "r", {}, "prompts.jsonl:7")
    with pytest.raises(LmcliError, match="defines no function 'absent'"):
        make_verifier(f"{file}:absent")
    with pytest.raises(LmcliError, match="no such file"):
        make_verifier(f"{tmp_path / 'none.py'}:fn")
    (tmp_path / "bad.py").write_text("import does_not_exist_anywhere\n")
    with pytest.raises(LmcliError, match=r"importing .*bad.py failed: ModuleNotFoundError"):
        make_verifier(f"{tmp_path / 'bad.py'}:fn")


def test_a_users_function_runs_apart_and_cannot_end_the_process(tmp_path: Path, capfd) -> None:
    """Issue 48, finding 9: a function that calls sys.exit or os._exit (at import or in a call)
    is one line, never the end of the training process; what it prints or reads never reaches
    the answers."""
    file = tmp_path / "rude.py"
    file.write_text(
        "import os, sys\n"
        "def chatty(prompt, reply, row):\n    print('hello'); sys.stdin.read(); return 0.5\n"
        "def leaves(prompt, reply, row):\n    sys.exit(0)\n"
        "def dies(prompt, reply, row):\n    os._exit(3)\n"
    )
    assert Rewards([f"{file}:chatty"]).score("q", "r", {}, "f:1") == [0.5]
    assert capfd.readouterr().out == ""  # printed to stderr, as the answers use stdout
    with pytest.raises(LmcliError) as exc:
        Rewards([f"{file}:leaves"]).score("q", "r", {}, "prompts.jsonl:7")
    assert str(exc.value) == f"prompts.jsonl:7: --reward {file}:leaves: called sys.exit(0)"
    with pytest.raises(LmcliError) as exc:
        Rewards([f"{file}:dies"]).score("q", "r", {}, "prompts.jsonl:8")
    assert str(exc.value) == (
        f"prompts.jsonl:8: --reward {file}:dies: the function ended its process (exit code 3) instead "
        "of returning a number"
    )
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(1)\n")
    with pytest.raises(LmcliError, match=r"importing .*exits.py failed: called sys.exit\(1\)$"):
        make_verifier(f"{tmp_path / 'exits.py'}:fn")
    (tmp_path / "dies.py").write_text("import os\nos._exit(4)\n")
    with pytest.raises(LmcliError, match=r"importing .*dies.py ended its process \(exit code 4\)$"):
        make_verifier(f"{tmp_path / 'dies.py'}:fn")


def test_a_reward_a_float32_cannot_hold_is_one_line(tmp_path: Path) -> None:
    file = tmp_path / "big.py"
    file.write_text("def r(prompt, reply, row):\n    return -1e39\n")
    with pytest.raises(
        LmcliError, match=r"^f:2: --reward .*:r: returned -1e\+39, beyond what a float32 holds"
    ):
        Rewards([f"{file}:r"]).score("q", "r", {}, "f:2")


def test_a_reply_passes_when_every_check_but_the_penalties_does() -> None:
    rewards = Rewards(["number", "json", "length:5"])
    assert rewards.passed([1.0, 1.0, -0.5]) and not rewards.passed([1.0, 0.0, 0.0])
    assert Rewards(["length:5"]).passed([0.0]) and not Rewards(["length:5"]).passed([-0.2])
