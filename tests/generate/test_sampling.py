"""The next-token rule: filtering, temperature, seeds, stop strings, repetition penalty."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from lmcli.config.commands import SampleConfig
from lmcli.errors import LmcliError
from lmcli.generate.rules import filter_logits, penalize_seen, sample_next, seen_mask
from lmcli.generate.sampling import sample_texts


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_keeps_exactly_k_even_with_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.5, 3.0]])
    out = filter_logits(logits, top_k=2)
    assert len(kept(out[0])) == 2 and set(kept(out[0])) <= {1, 2, 3, 5}
    assert kept(filter_logits(logits, top_k=10)[0]) == list(range(6))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.7, 0.9, 0.99, 1.0])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float) -> None:
    probs = torch.tensor([0.4, 0.05, 0.3, 0.2, 0.05])
    out = filter_logits(probs.log()[None], top_p=p)[0]
    keep = kept(out)
    order = torch.argsort(probs, descending=True).tolist()
    assert keep == sorted(order[: len(keep)])  # the most likely ones
    assert probs[keep].sum() >= p - 1e-6  # reach p ...
    if len(keep) > 1:  # ... and without the least likely kept one they would not
        assert probs[keep].sum() - probs[keep].min() < p


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert kept(filter_logits(probs.log()[None], min_p=0.25)[0]) == [0, 1, 2]


def test_temperature_zero_is_greedy_and_logprobs_are_the_models() -> None:
    logits = torch.tensor([[0.1, 2.0, 0.3]])
    tokens, logprobs = sample_next(logits, temperature=0)
    assert tokens.tolist() == [1]
    assert logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_sampling_follows_the_filtered_distribution() -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 5.0]]).repeat(2000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(2000)]
    tokens, _ = sample_next(logits, temperature=1.0, top_k=2, generators=gens)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[0] == counts[1] == 0 and 800 < counts[2] < 1200


def test_repetition_penalty_lowers_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.0]])
    out = penalize_seen(logits, seen_mask([[0, 1]], 3), 2.0)
    assert out.tolist() == [[1.0, -2.0, 1.0]]


def test_same_seed_same_text_whatever_the_batch() -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    cfg = SampleConfig(temperature=1.0, max_new_tokens=25, num_samples=2, seed=11)
    alone, _ = sample_texts(model, tok, ["the cat"], cfg)
    batched, _ = sample_texts(model, tok, ["a bird sang", "the cat"], cfg)
    assert [g.text for g in alone] == [g.text for g in batched[2:]]
    other, _ = sample_texts(
        model, tok, ["the cat"], SampleConfig(temperature=1.0, max_new_tokens=25, seed=12)
    )
    assert other[0].text != alone[0].text


def test_stop_strings_cut_the_text() -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    free, _ = sample_texts(model, tok, ["the"], SampleConfig(temperature=1.0, max_new_tokens=40, seed=3))
    stop = free[0].text[5:7]
    cut, _ = sample_texts(
        model, tok, ["the"], SampleConfig(temperature=1.0, max_new_tokens=40, seed=3, stop=(stop,))
    )
    assert cut[0].finish_reason == "stop" and cut[0].text == free[0].text[: free[0].text.index(stop)]


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top-k"),
        (dict(top_p=0.0), "top-p"),
        (dict(top_p=1.5), "top-p"),
        (dict(num_samples=0), "num-samples"),
    ],
)
def test_bad_settings_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(LmcliError, match=message):
        SampleConfig(**kw)
