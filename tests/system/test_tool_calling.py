"""A tiny model fine-tuned with `lmcli train --task sft` on tool-call conversations (the tools in
the system message as `lmcli serve` shows them under lmcli's template, the calls as its replies)
answers with tool calls the official `openai` client parses: on its own (`tool_choice: auto`),
and with arguments valid against the tool's schema when a call is required (constrained).

In the test's budget (80 steps, about 30 s) the model learns the form of a call; which tool and
which city take a few hundred steps more (300 steps of batch 16 picked the right tool in a trial), so the test
asserts the form and the schema, not the choice."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
from helpers import run_cli

openai = pytest.importorskip("openai")

from lmcli.config.commands import ServeConfig  # noqa: E402
from lmcli.formats.sources import load_model  # noqa: E402
from lmcli.serve.server import running  # noqa: E402
from lmcli.serve.tools import call_text, system_text  # noqa: E402

LETTERS = "abcdefgh"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-h]{4}$"}},
    "required": ["city"],
}
SCHEMAS = {"weather": CITY, "clock": CITY}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
ASKS = {"weather": "rain in", "clock": "time in"}


def cities(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(4)) for _ in range(n)]


def rows(names: list[str]) -> list[dict]:
    """Conversations: the tools in the system message, a question, the call that answers it."""
    out = []
    for i, city in enumerate(names):
        tool = "weather" if i % 2 == 0 else "clock"
        out.append(
            {
                "messages": [
                    {"role": "system", "content": system_text(TOOLS)},
                    {"role": "user", "content": f"{ASKS[tool]} {city}"},
                    {"role": "assistant", "content": call_text(tool, {"city": city})},
                ]
            }
        )
    return out


@pytest.mark.slow
def test_a_fine_tuned_model_calls_tools_the_openai_client_parses(tmp_path: Path, capsys) -> None:
    train = cities(1200, 0)  # four letters of a-h: 4,096 cities, a fourth of them seen
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(train)))
    # a char model: copying a city letter by letter is learned in far fewer steps than BPE pieces
    options = (
        "--tokenizer char --n-layer 2 --n-head 4 --n-embd 64 --block-size 544 --batch-size 16 --lr 6e-3 "
        "--warmup-steps 10 --max-steps 80 --eval-interval 80 --eval-batches 1 --val-fraction 0.02 -q"
    ).split()
    command = [
        "train",
        "--task",
        "sft",
        str(data),
        "-o",
        str(tmp_path / "run"),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    command += options
    code, _, err = run_cli(command, capsys)
    assert code == 0, err
    held_out = [c for c in dict.fromkeys(cities(40, 99)) if c not in set(train)][:10]
    called = 0
    with running(load_model(tmp_path / "run"), ServeConfig(port=0, max_batch=4, grace=2)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for i, city in enumerate(held_out):
            tool = "weather" if i % 2 == 0 else "clock"
            for choice in ("required", "auto"):
                r = client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"{ASKS[tool]} {city}"}],
                    tools=TOOLS,
                    tool_choice=choice,
                    temperature=0,
                    max_tokens=80,
                )
                message = r.choices[0].message
                if choice == "required":  # constrained: always one valid call
                    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
                    call = message.tool_calls[0]
                    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                elif message.tool_calls:  # the model's own choice: a call in the form it learned
                    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
                    assert message.tool_calls[0].function.name in SCHEMAS
                    called += 1
    assert called >= 0.8 * len(held_out), f"{called} of {len(held_out)} replies called a tool"
