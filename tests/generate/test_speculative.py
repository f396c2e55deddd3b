"""Speculative decoding: greedy text identical to decoding without a draft; sampled text from
the model's own distribution (a chi-square test against the exact distribution, on a tiny
vocabulary); a draft with another tokenizer refused in one line."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import assert_one_line_error, make_run, run_cli, tiny_model, tiny_tokenizer

from lmcli.config.commands import SampleConfig
from lmcli.errors import LmcliError
from lmcli.generate.rules import penalize_seen, sampling_probs
from lmcli.generate.sampling import generate
from lmcli.generate.speculative import Draft, accept, check_draft

PROMPTS = ["the cat", "a bird sang", "", "the sun rose over the hill and"]


def sharp(model: torch.nn.Module, scale: float = 0.5) -> torch.nn.Module:
    """Weights drawn wide, so that greedy choices have clear margins."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, scale)
    return model


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize(
    "settings",
    [dict(), dict(repetition_penalty=1.3, min_new_tokens=5), dict(stop=("sat",), top_k=3)],
    ids=["plain", "penalty-min-tokens", "stop-topk"],
)
def test_greedy_output_is_the_output_without_a_draft(k: int, settings: dict) -> None:
    tok = tiny_tokenizer()
    model = sharp(tiny_model(tok.vocab_size, seed=1, block_size=96))
    draft = Draft(tiny_model(tok.vocab_size, seed=2, n_layer=1, block_size=96), tok, k)
    prompts = [tok.with_bos(tok.encode(t)) for t in PROMPTS]
    cfg = SampleConfig(max_new_tokens=40, temperature=0, **settings)
    plain = generate(model, tok, prompts, cfg)
    fast = generate(model, tok, prompts, cfg, draft=draft)
    for a, b in zip(plain, fast, strict=True):
        assert (a.ids, a.text, a.finish_reason) == (b.ids, b.text, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert sum(g.drafted for g in fast) > 0 and 0 < sum(g.accepted for g in fast) < sum(
        g.drafted for g in fast
    )


def test_the_model_as_its_own_draft_is_always_accepted() -> None:
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, seed=1, block_size=96)
    streamed: list[str] = []
    cfg = SampleConfig(max_new_tokens=20, temperature=0.8, seed=3)
    out = generate(
        model,
        tok,
        [tok.with_bos([])],
        cfg,
        draft=Draft(model, tok, 3),
        on_text=lambda _, t: streamed.append(t),
    )[0]
    assert out.accepted == out.drafted > 0 and "".join(streamed) == out.text


def test_a_row_too_long_for_speculation_is_decoded_without_the_draft() -> None:
    tok = tiny_tokenizer()
    model = sharp(tiny_model(tok.vocab_size, seed=1, block_size=32))
    draft = Draft(tiny_model(tok.vocab_size, seed=2, block_size=32), tok, 4)
    prompt = [tok.with_bos(tok.encode("the cat sat on the mat"))]
    cfg = SampleConfig(max_new_tokens=40, temperature=0)  # beyond the context: the window slides
    assert generate(model, tok, prompt, cfg, draft=draft)[0].ids == generate(model, tok, prompt, cfg)[0].ids


# ----------------------------------------------------------------------------- the distribution


def exact_distribution(model, tok, prompt: list[int], cfg: SampleConfig) -> dict[tuple, float]:
    """P(outcome) of 2-token continuations under the engine's rules: the model's own processed
    distribution at each step (an outcome ends early at <eos>, which it then holds as "eos")."""
    V = tok.vocab_size

    def step(seq: list[int], ids_so_far: int) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1:].float()  # (1, V)
        seen = torch.zeros(1, V, dtype=torch.bool)
        seen[0, torch.tensor(seq)] = True
        logits = penalize_seen(logits, seen, cfg.repetition_penalty)
        if ids_so_far < cfg.min_new_tokens:
            logits[0, tok.eos_id] = float("-inf")
        return sampling_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)[0].double()

    out: dict[tuple, float] = {}
    first = step(prompt, 0)
    for a in range(V):
        if first[a] == 0:
            continue
        if a == tok.eos_id:
            out[("eos",)] = first[a].item()
            continue
        second = step([*prompt, a], 1)
        for b in range(V):
            if second[b] > 0:
                out[(a, "eos") if b == tok.eos_id else (a, b)] = (first[a] * second[b]).item()
    return out


def chi_square_p(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``expected`` probabilities
    (cells expecting fewer than 5 pooled; an outcome outside ``expected`` fails at once)."""
    if set(counts) - set(expected):
        return 0.0
    big = [o for o, p in expected.items() if p * n >= 5]
    small = [o for o in expected if o not in big]
    cells = [(counts.get(o, 0), expected[o] * n) for o in big]
    if small:
        cells.append((sum(counts.get(o, 0) for o in small), sum(expected[o] for o in small) * n))
    chi2 = sum((c - e) ** 2 / e for c, e in cells if e > 0)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2)))


def outcomes(generated) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for g in generated:
        key = tuple(g.ids) + (("eos",) if g.finish_reason == "eos" else ())
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.5, min_new_tokens=1),
    ],
    ids=["t1", "t0.7-topk-topp-minp-penalty-min"],
)
def test_sampled_output_follows_the_models_distribution(settings: dict) -> None:
    """2,000 seeded rows of 2 tokens, a draft that disagrees often: the outcomes fit the model's
    exact distribution (p > 0.001); sampled from the draft alone they do not."""
    tok = tiny_tokenizer("abab aab bba\n" * 20, "char")  # 9 tokens
    model = sharp(tiny_model(tok.vocab_size, seed=1, n_layer=1, n_embd=16, block_size=16), 0.7)
    small = sharp(tiny_model(tok.vocab_size, seed=5, n_layer=1, n_embd=16, block_size=16), 0.7)
    prompt = tok.with_bos(tok.encode("ab"))
    n = 2000
    cfg = SampleConfig(max_new_tokens=2, num_samples=n, seed=11, **settings)
    expected = exact_distribution(model, tok, prompt, cfg)
    drafted = generate(model, tok, [prompt], cfg, draft=Draft(small, tok, 2))
    accepted = sum(g.accepted for g in drafted) / sum(g.drafted for g in drafted)
    assert 0.1 < accepted < 0.95  # the draft is often wrong: the residual draws are exercised
    assert chi_square_p(outcomes(drafted), expected, n) > 1e-3
    plain_draft = generate(small, tok, [prompt], cfg)  # the test can fail: the draft's own text
    assert chi_square_p(outcomes(plain_draft), expected, n) < 1e-6


def test_the_accept_rule_gives_p_for_any_q() -> None:
    """The rule alone, one proposal from q over 4 tokens: the token taken is distributed as p."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        taken, token = accept(p, q, [x], g, greedy=False)
        counts[x if taken else token] += 1
    expected = {(i,): float(p[0, i]) for i in range(4)}
    assert chi_square_p({(i,): int(c) for i, c in enumerate(counts)}, expected, n) > 1e-3


# ----------------------------------------------------------------------------- refusal


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(tmp_path, capsys) -> None:
    run = make_run(tmp_path / "run", kind="char")
    other = make_run(tmp_path / "other", text="completely different letters: xyz qvw\n" * 30)
    with pytest.raises(LmcliError, match="another tokenizer than the model: its vocabulary"):
        check_draft(tiny_tokenizer(), tiny_tokenizer("xyz qvw\n" * 30), "X")
    for command in (["sample", str(run), "--max-new-tokens", "2"], ["chat", str(run), "--json"]):
        code, _, err = run_cli(
            [*command, "--draft", str(other)],
            capsys,
            '{"messages": [{"role": "user", "content": "hi"}]}',
            pytest.MonkeyPatch(),
        )
        assert_one_line_error(code, err, f"the draft model {other} has another tokenizer than the model")


def test_sample_and_chat_take_a_draft(tmp_path, capsys, monkeypatch) -> None:
    run = make_run(tmp_path / "run", kind="char")
    draft = make_run(tmp_path / "draft", kind="char", seed=7, n_layer=1)
    argv = ["sample", str(run), "-p", "the", "--temperature", "0", "--max-new-tokens", "12", "--json"]
    code, plain, err = run_cli(argv, capsys)
    assert code == 0, err
    code, fast, err = run_cli([*argv, "--draft", str(draft), "--draft-tokens", "3"], capsys)
    assert code == 0, err
    import json

    a, b = json.loads(plain), json.loads(fast)
    assert a["tokens"] == b["tokens"] and b["draft"]["tokens"] == 3 and b["draft"]["proposed"] > 0
    stdin = '{"messages": [{"role": "user", "content": "the cat"}]}'
    chat = ["chat", str(run), "--json", "--temperature", "0", "--max-new-tokens", "8"]
    code, plain, _ = run_cli(chat, capsys, stdin, monkeypatch)
    code2, fast, err = run_cli([*chat, "--draft", str(draft)], capsys, stdin, monkeypatch)
    assert code == code2 == 0, err
    assert json.loads(plain)["message"] == json.loads(fast)["message"]


def test_combinations_of_two_tokens_are_all_counted() -> None:  # the helper above, checked
    expected = {(a, b): 0.25 for a, b in itertools.product((0, 1), (0, 1))}
    assert chi_square_p({k: 250 for k in expected}, expected, 1000) == pytest.approx(1.0)
    assert math.isclose(chi_square_p({(0, 0): 1000}, expected, 1000), 0.0, abs_tol=1e-12)
