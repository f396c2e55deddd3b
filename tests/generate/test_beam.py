"""Beam search: size 1 is greedy, exhaustive beams find the brute-force best, parity with HF."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from lmcli.config.commands import BeamConfig
from lmcli.generate.beam import banned_ngram_tokens, beam_search
from lmcli.model.transformer import Transformer


def peaky(vocab: int, seed: int) -> Transformer:
    """A random model with distinct, confident predictions (no near-ties between candidates)."""
    model = tiny_model(vocab, seed, block_size=16, n_embd=16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    return model


def test_beam_size_one_is_greedy() -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    prompts = [[tok.bos_id, 5, 6], [tok.bos_id, 9]]
    hyps = beam_search(
        model, prompts, BeamConfig(beam_size=1, max_new_tokens=12), eos_id=tok.eos_id, pad_id=tok.pad_id
    )
    for prompt, h in zip(prompts, hyps, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
                if nxt == tok.eos_id:
                    break
                ids.append(nxt)
        assert h[0].ids == ids[len(prompt) :]


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_exhaustive_beams_find_the_brute_force_best(alpha: float) -> None:
    vocab, eos, limit = 4, 3, 3
    model = peaky(vocab, seed=1)
    prompt = [0, 1]

    def score(seq: tuple[int, ...]) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + list(seq)]))[0], -1)
        total = sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(seq))
        return total / len(seq) ** alpha

    candidates = [
        s
        for n in range(1, limit + 1)
        for s in itertools.product(range(vocab), repeat=n)
        if eos not in s[:-1] and (s[-1] == eos or n == limit)
    ]
    best = max(candidates, key=score)
    cfg = BeamConfig(beam_size=vocab**limit, nbest=1, max_new_tokens=limit, length_penalty=alpha)
    hyp = beam_search(model, [prompt], cfg, eos_id=eos, pad_id=0)[0][0]
    found = tuple(hyp.ids) + ((eos,) if hyp.ended else ())
    assert found == best
    assert hyp.score == pytest.approx(score(best), abs=1e-4)


@pytest.mark.parametrize("k,alpha", [(3, 1.0), (4, 0.6), (5, 2.0)])
def test_same_best_hypothesis_and_score_as_hugging_face(k: int, alpha: float) -> None:
    transformers = pytest.importorskip("transformers")
    from lmcli.formats.families import FAMILIES
    from lmcli.formats.weights import load_state

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=30,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = tiny_model(30, seed=None, block_size=32, n_embd=32, n_layer=2, n_head=4)  # the GPT-2's shape
    state = FAMILIES["gpt2"].from_hf(hf.state_dict(), ours.config)
    state.setdefault("lm_head.weight", state["wte.weight"])
    load_state(ours, state, "HF GPT-2")
    for prompt in ([0, 5, 7], [0, 12], [0, 3, 3, 9, 2]):
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k,
            length_penalty=alpha,
            early_stopping=True,
            max_new_tokens=10,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        hf_ids = out.sequences[0, len(prompt) :].tolist()
        hf_ids = hf_ids[: hf_ids.index(1)] if 1 in hf_ids else hf_ids
        hyp = beam_search(
            ours,
            [prompt],
            BeamConfig(beam_size=k, length_penalty=alpha, max_new_tokens=10),
            eos_id=1,
            pad_id=1,
        )[0][0]
        assert hyp.ids == hf_ids
        assert hyp.score == pytest.approx(out.sequences_scores[0].item(), abs=1e-4)


def test_nbest_is_sorted_and_limits_hold() -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    cfg = BeamConfig(beam_size=4, nbest=4, max_new_tokens=50, max_len_a=1.0, max_len_b=2, min_new_tokens=3)
    hyps = beam_search(
        model, [[tok.bos_id, 5, 6, 7]], cfg, eos_id=tok.eos_id, pad_id=tok.pad_id, input_lens=[3]
    )[0]
    assert len(hyps) == 4 and [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    assert all(3 <= len(h.ids) + h.ended <= 5 for h in hyps)  # min-new 3, limit 1.0 * 3 + 2
    assert all(math.isfinite(h.logprob) for h in hyps)


def test_no_repeat_ngram() -> None:
    assert banned_ngram_tokens([1, 2, 3, 1, 2], 3) == {3}
    assert banned_ngram_tokens([1, 2, 3], 1) == {1, 2, 3}
    model, tok = tiny_model(), tiny_tokenizer()
    hyp = beam_search(
        model,
        [[tok.bos_id]],
        BeamConfig(beam_size=3, max_new_tokens=30, no_repeat_ngram_size=2),
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
    )[0][0]
    pairs = list(zip(hyp.ids, hyp.ids[1:], strict=False))
    assert len(pairs) == len(set(pairs))
