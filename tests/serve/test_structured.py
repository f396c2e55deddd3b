"""Structured output through the official `openai` client: `response_format` with a JSON schema
(100 seeded requests, batched together with free ones, all parse and validate), `json_object`,
streaming; a schema that does not compile is a 400 naming `response_format`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from helpers import TINY_TEXT, make_run

openai = pytest.importorskip("openai")

from lmcli.config.commands import ServeConfig  # noqa: E402
from lmcli.formats.sources import load_model  # noqa: E402
from lmcli.serve.server import running  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "cast": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "lead": {"type": "boolean"}},
                "required": ["name", "lead"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    },
    "required": ["title", "year", "genre", "cast"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}
TEXT = TINY_TEXT + (json.dumps(SCHEMA) + " 0123456789.-+eE truefalsenull\n") * 3


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("structured") / "run", TEXT, "bpe", block_size=256)
    cfg = ServeConfig(port=0, max_batch=32, max_queue=128, grace=2)
    with running(load_model(run), cfg) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(client, seed: int, **options):
    messages = [{"role": "user", "content": f"a movie {seed}"}]
    options = {"max_tokens": 150, **options}
    return client.chat.completions.create(model="m", messages=messages, seed=seed, **options)


def test_100_seeded_requests_validate(client) -> None:
    """100 requests at once (rows of different requests with and without a schema in one
    batch): every constrained reply parses and validates, and ends by itself."""
    with ThreadPoolExecutor(16) as pool:
        constrained = [pool.submit(ask, client, seed, response_format=FORMAT) for seed in range(100)]
        free = [pool.submit(ask, client, seed) for seed in range(8)]
        replies = [f.result() for f in constrained]
        assert all(f.result().choices[0].finish_reason for f in free)
    for r in replies:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert (
        ask(client, 7, response_format=FORMAT).choices[0].message.content
        == replies[7].choices[0].message.content
    )


def test_streamed_and_n(client) -> None:
    stream = ask(client, 3, response_format=FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ask(client, 3, response_format=FORMAT).choices[0].message.content
    for choice in ask(client, 4, response_format=FORMAT, n=3).choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object(client) -> None:
    """``json_object``: replies that end by themselves are JSON objects; a reply cut at
    ``max_tokens`` is the start of one (the decoder never left the grammar); unconstrained, the
    same seeds do not write JSON."""
    fmt = {"type": "json_object"}
    replies = [ask(client, seed, response_format=fmt, max_tokens=120).choices[0] for seed in range(6)]
    ended = [r for r in replies if r.finish_reason == "stop"]
    assert ended, "no json_object reply ended within 120 tokens"
    for r in ended:
        assert isinstance(json.loads(r.message.content), dict)
    for r in replies:
        assert r.message.content.lstrip().startswith("{")
    free = [ask(client, seed, max_tokens=120).choices[0].message.content for seed in range(6)]
    assert not all(_is_json_object(text) for text in free)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@pytest.mark.parametrize(
    "response_format, message",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "invalid JSON schema",
        ),
        ({"type": "xml"}, "response_format must be"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON object"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"items": "x"}}},
            "invalid JSON schema",
        ),
    ],
)
def test_bad_response_format_is_a_400(client, response_format, message) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, 1, response_format=response_format)
    assert message in err.value.body["message"] and err.value.body["param"] == "response_format"
