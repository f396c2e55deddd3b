# ruff: noqa: E501  (Qwen2.5's template is kept line for line as it is written)
"""Tool calling in chat completions, through the official `openai` client: `tools` and
`tool_choice` (required, a named function, auto, none), calls parsed into `tool_calls` whole and
streamed, `role: "tool"` messages back, bad tools as 400s; a Qwen2.5-style template with tools
renders as `transformers`' `apply_chat_template(tools=...)` does."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers import TINY_TEXT, make_run

openai = pytest.importorskip("openai")

from lmcli.config.commands import ServeConfig  # noqa: E402
from lmcli.formats.sources import load_model  # noqa: E402
from lmcli.serve import tools  # noqa: E402
from lmcli.serve.server import running  # noqa: E402
from lmcli.text import chat_template  # noqa: E402
from lmcli.text.tokenizer import Tokenizer  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": TIME | {"additionalProperties": False}},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TEXT = TINY_TEXT + (json.dumps(TOOLS) + "<tool_call>\n</tool_call> 0123456789\n") * 3

# Qwen2.5's chat template, tools and tool calls as Qwen2.5-Instruct's tokenizer_config.json has them
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    {"role": "tool", "tool_call_id": "call_1", "content": "snow"},
]


def qwen_folder(run: Path) -> Path:
    """The run's checkpoint with the Qwen2.5 template and its special tokens in its tokenizer."""
    folder = run / "last"
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**data, "chat_template": QWEN}))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tools")
    return {
        "lmcli": make_run(root / "plain", TEXT, "bpe", block_size=1024),
        "qwen": qwen_folder(make_run(root / "qwen", TEXT, "bpe", block_size=1024)),
    }


@pytest.fixture(scope="module", params=["lmcli", "qwen"])
def client(runs, request):
    cfg = ServeConfig(port=0, max_batch=8, grace=2)
    with running(load_model(runs[request.param]), cfg) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(client, messages=None, seed=0, **options):
    messages = messages or [{"role": "user", "content": "weather?"}]
    options = {"max_tokens": 120, "tools": TOOLS, **options}
    return client.chat.completions.create(model="m", messages=messages, seed=seed, **options)


def assert_valid(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_and_named_calls_follow_the_schema(client) -> None:
    for seed in range(6):
        r = ask(client, seed=seed, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert_valid(r.choices[0].message.tool_calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ask(client, seed=1, tool_choice=named, n=3).choices:
        assert_valid(choice.message.tool_calls, names=("get_time",))


def test_streamed_calls_arrive_in_openai_shape(client) -> None:
    whole = ask(client, seed=2, tool_choice="required").choices[0].message.tool_calls[0]
    chunks = list(ask(client, seed=2, tool_choice="required", stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0
    call = deltas[0][0]
    assert (call.function.name, call.function.arguments) == (whole.function.name, whole.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_messages_are_accepted_back_and_none_parses_nothing(client) -> None:
    r = ask(client, CONVERSATION, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = ask(client, CONVERSATION, tool_choice="auto", max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "options, param, message",
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name must be"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "must be {"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools",
            "schema of an object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "invalid grammar",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "names no function",
        ),
        ({"tool_choice": "always"}, "tool_choice", "tool_choice must be"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be given",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
            "messages",
            "function call with a name",
        ),
    ],
)
def test_bad_tools_are_400s(client, options, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, **options)
    assert message in err.value.body["message"] and err.value.body["param"] == param


def test_qwen_template_renders_tools_as_transformers_does(runs) -> None:
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.load(runs["qwen"])
    theirs_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, chat_template=QWEN)
    as_dicts = [  # what a transformers user passes: arguments as objects
        {
            **m,
            "tool_calls": [
                {
                    **CALL,
                    "function": {**CALL["function"], "arguments": json.loads(CALL["function"]["arguments"])},
                }
            ],
        }
        if m.get("tool_calls")
        else m
        for m in CONVERSATION
    ]
    for messages in (CONVERSATION[:2], CONVERSATION):
        expected = theirs_tok.apply_chat_template(
            [m for m in as_dicts[: len(messages)]], tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        spec = tools.parse_tools({"tools": TOOLS}, chat_template.find_template(runs["qwen"]))
        ours = chat_template.render(
            tools.for_template(chat_template.check_messages(messages), spec, hf=True),
            chat_template.find_template(runs["qwen"]),
            tok,
            extra={"tools": list(spec.functions)},
        )
        assert ours == expected
    assert "<tool_call>" in expected and '"name": "get_weather"' in expected and "<tool_response>" in expected


LLAMA = """{%- for message in messages %}{{ message.role }}: {{ message.content }}
{% endfor %}{%- if tools %}Respond with a JSON for a function call: {"name": function name, "parameters": dictionary of argument name and its value}. Use tools: {{ tools | tojson }}{% endif %}"""


def test_llama_json_calls() -> None:
    """A template that writes calls as bare JSON with "parameters" (Llama 3.1/3.2): its calls
    are read so, and a required call is constrained so."""
    from lmcli.generate.constrain import Grammars
    from lmcli.text.template_render import Template

    spec = tools.parse_tools({"tools": TOOLS, "tool_choice": "required"}, Template(LLAMA, "test"))
    assert spec.format == "json"
    content, calls = tools.parse_reply(' {"name": "get_time", "parameters": {"zone": "utc"}}', "json")
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
    assert tools.parse_reply("It is sunny.", "json") == ("It is sunny.", [])
    tok = Tokenizer.train("bpe", [TEXT], vocab_size=300)
    mask = Grammars(tok).processor(tools.constraint(spec))
    for t in tok.encode(tools.call_text("get_time", {"zone": "cet"}, "json")):
        mask.accept(t)
    assert mask.ends


def test_a_streamed_reply_reads_as_the_whole_reply() -> None:
    text = 'Let me see. <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call> <tool_call>{bad}</tool_call>'
    whole_content, whole_calls = tools.parse_reply(text, "hermes")
    stream = tools.CallStream("hermes")
    pieces = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)] + [stream.finish()]
    content = "".join(c for c, _ in pieces).strip()
    calls = [call for _, cs in pieces for call in cs]
    assert content == whole_content == "Let me see.  <tool_call>{bad}</tool_call>"
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert len(calls) == 1


def test_a_required_call_keeps_the_parameters_references() -> None:
    """Parameters with `$defs` (as pydantic writes them) constrain the call as written."""
    from lmcli.generate.constrain import Grammars

    params = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Place"}},
        "required": ["where"],
        "$defs": {
            "Place": {
                "type": "object",
                "properties": {"city": {"enum": ["oslo", "rome"]}},
                "required": ["city"],
            }
        },
    }
    spec = tools.parse_tools(
        {
            "tools": [{"type": "function", "function": {"name": "go", "parameters": params}}],
            "tool_choice": "required",
        },
        None,
    )
    tok = Tokenizer.train("bpe", [TEXT + '"where" "city" "oslo" "rome" go'], vocab_size=300)
    grammars = Grammars(tok)
    mask = grammars.processor(tools.constraint(spec))
    for t in tok.encode(tools.call_text("go", {"where": {"city": "rome"}})):
        mask.accept(t)
    assert mask.ends
    with pytest.raises(Exception, match="grammar"):  # a city the enum does not have
        mask = grammars.processor(tools.constraint(spec))
        for t in tok.encode(tools.call_text("go", {"where": {"city": "paris"}})):
            mask.accept(t)
