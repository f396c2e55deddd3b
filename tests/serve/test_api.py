"""The OpenAI-compatible API, driven by the official ``openai`` client against a live server."""

from __future__ import annotations

import concurrent.futures
import json

import httpx2 as httpx
import pytest
from helpers import run_cli, train_config

openai = pytest.importorskip("openai")

from lmcli.config.commands import SampleConfig, ServeConfig  # noqa: E402
from lmcli.generate.sampling import sample_texts  # noqa: E402
from lmcli.serve.server import running  # noqa: E402


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_run(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["run"]


def test_completion_streamed_equals_whole(client: openai.OpenAI) -> None:
    args = dict(model="run", prompt="the cat", max_tokens=12, seed=3, temperature=0.9)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage.prompt_tokens == len("the cat") + 1  # <bos> and one token per character
    assert 1 <= whole.usage.completion_tokens <= 12


def test_chat_streamed_equals_whole_with_usage(client: openai.OpenAI) -> None:
    args = dict(model="run", messages=[{"role": "user", "content": "the dog"}], max_tokens=10, seed=5)
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert stream[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_and_seeds(client: openai.OpenAI) -> None:
    args = dict(model="run", prompt="a bird", max_tokens=15, n=3, seed=11, temperature=1.0)
    first, again = client.completions.create(**args), client.completions.create(**args)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]  # the same seed, the same choices
    assert len(set(texts)) > 1  # each choice draws its own stream
    other = client.completions.create(**{**args, "seed": 12})
    assert [c.text for c in other.choices] != texts


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    free = client.completions.create(model="run", prompt="the", max_tokens=30, seed=2, temperature=0)
    text = free.choices[0].text
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = client.completions.create(
        model="run", prompt="the", max_tokens=30, seed=2, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="run", prompt="the", max_tokens=30, seed=2, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text  # no part of the stop


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="run", prompt="the sun", max_tokens=8, seed=4, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) == 3
        assert max(top.values()) >= value - 1e-6  # the top 3 include the best


def test_seeded_output_equals_lmcli_sample(client: openai.OpenAI, served_run, checkpoint, capsys) -> None:
    """The same prompt, seed and settings give `lmcli sample`'s text, also while batched."""
    code, out, _ = run_cli(
        [
            "sample",
            str(served_run),
            "-p",
            "the cat",
            "--json",
            "--max-new-tokens",
            "20",
            "--temperature",
            "0.7",
            "--top-k",
            "10",
            "--top-p",
            "0.9",
            "--seed",
            "42",
            "--num-samples",
            "2",
        ],
        capsys,
    )
    assert code == 0
    expected = [json.loads(line)["text"] for line in out.splitlines()]
    got = client.completions.create(
        model="run",
        prompt="the cat",
        max_tokens=20,
        temperature=0.7,
        top_p=0.9,
        seed=42,
        n=2,
        extra_body={"top_k": 10},
    )
    assert [c.text for c in got.choices] == expected
    # eight requests at once, each in a batch with the others: each still equals its lone run
    prompts = ["the cat", "a bird sang", "the sun", "", "the dog sat", "over", "a", "the hill"]
    cfgs = [SampleConfig(max_new_tokens=16, temperature=0.8, seed=s, min_p=0.05) for s in range(8)]
    alone = [
        sample_texts(checkpoint.model, checkpoint.tokenizer, [p], c)[0][0].text
        for p, c in zip(prompts, cfgs, strict=True)
    ]

    def ask(i: int) -> str:
        r = client.completions.create(
            model="run", prompt=prompts[i], max_tokens=16, temperature=0.8, seed=i, extra_body={"min_p": 0.05}
        )
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == alone


def test_chat_with_repetition_penalty_and_min_tokens_equals_lmcli_chat(
    client: openai.OpenAI, served_run, capsys, monkeypatch
) -> None:
    """Every sampling option of `lmcli chat` (those of `lmcli sample`) works in a chat completion
    with the same result for the same seed; the server ignored repetition_penalty and min_tokens."""
    messages = [{"role": "user", "content": "the cat"}]

    def served(seed: int, temperature: float, **extra) -> tuple[str, str, int]:
        r = client.chat.completions.create(
            model="run",
            messages=messages,
            max_tokens=36,
            seed=seed,
            temperature=temperature,
            extra_body=extra,
        )
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    def chat(seed: int, temperature: float, *flags: str) -> tuple[str, str, int]:
        settings = ["--max-new-tokens", "36", "--seed", str(seed), "--temperature", str(temperature)]
        stdin = json.dumps({"messages": messages})
        code, out, _ = run_cli(
            ["chat", str(served_run), "--json", *settings, *flags], capsys, stdin, monkeypatch
        )
        assert code == 0
        got = json.loads(out)
        return got["message"]["content"], got["finish_reason"], got["usage"]["completion_tokens"]

    plain = served(1, 0.3)
    penalized = served(1, 0.3, repetition_penalty=3.0)
    assert penalized != plain  # the penalty changes the reply ...
    assert penalized == chat(1, 0.3, "--repetition-penalty", "3.0")  # ... as it changes lmcli chat's
    text, reason, tokens = served(0, 1.0)
    assert reason == "stop" and tokens < 30  # <eos> early ...
    longer = served(0, 1.0, min_tokens=30)
    assert longer[2] >= 30 and longer[0].startswith(text)  # ... not before min_tokens
    assert longer == chat(0, 1.0, "--min-new-tokens", "30")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1000}, "max_tokens"),  # beyond the context
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 9}, "n"),  # more rows than the server has
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "logprobs": 9}, "logprobs"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "x" * 100}, "prompt"),  # longer than the context
    ],
)
def test_invalid_values_are_400s(server: str, body: dict, param: str) -> None:
    r = httpx.post(server + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_parameters_are_ignored(server: str) -> None:
    r = httpx.post(
        server + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": [1], "user": "u"}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_messages_and_endpoints(server: str) -> None:
    r = httpx.post(server + "/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(server + "/v1/nothing").status_code == 404
    r = httpx.get(server + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_guards_everything_but_health(checkpoint) -> None:
    with running(checkpoint, ServeConfig(port=0, api_key="s3cret", grace=1)) as (url, _):
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        bad = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="run", prompt="a", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_cli_errors_are_one_line(served_run, capsys) -> None:
    from helpers import assert_one_line_error

    code, _, err = run_cli(["serve", str(served_run), "--port", "70000"], capsys)
    assert_one_line_error(code, err, "port must be in [0, 65535]")
    code, _, err = run_cli(["serve", str(served_run), "--max-batch", "0"], capsys)
    assert_one_line_error(code, err, "max-batch must be positive")
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, _, err = run_cli(["serve", str(served_run), "--port", str(port)], capsys)
    assert_one_line_error(code, err, f"cannot listen on 127.0.0.1:{port}")


def test_translation_model_reads_the_prompt_as_a_source(tmp_path) -> None:
    from helpers import tiny_model, tiny_tokenizer

    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.formats.sources import load_model
    from lmcli.tasks import make_task

    tok = tiny_tokenizer()
    save_checkpoint(
        tmp_path / "mt" / "best", tiny_model(tok.vocab_size), train_config(task="translation"), tok, meta={}
    )
    ckpt = load_model(tmp_path / "mt")
    cfg = SampleConfig(max_new_tokens=10, temperature=0.9, seed=4)
    form = make_task(ckpt.train_config).prompt  # <bos> source <sep>
    expected = sample_texts(ckpt.model, ckpt.tokenizer, ["the cat"], cfg, form=form)[0][0].text
    with running(ckpt, ServeConfig(port=0, grace=1)) as (url, _):
        body = {"prompt": "the cat", "max_tokens": 10, "temperature": 0.9, "seed": 4}
        assert httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == expected
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 400 and "translation model" in chat.json()["error"]["message"]
