"""The reference of post-training: with LoRA the adapters switched off give the base model's
log-probs exactly; a precomputed table equals the reference computed on the fly; the pair loss
of a model against itself is DPO's log 2; GRPO's rollouts are reproducible per seed, one
generator per reply, and their batch scores the reply alone."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer, train_config

from lmcli.config.commands import SampleConfig
from lmcli.data.preferences import PreferenceRows, PromptRows, collate_pairs, pair_set
from lmcli.data.windows import IGNORE
from lmcli.model import lora
from lmcli.train.post.dpo import PreferenceSettings, evaluate_pairs, pair_loss
from lmcli.train.post.grpo import group_loss
from lmcli.train.post.reference import Reference, frozen_copy, sequence_logprobs
from lmcli.train.post.rewards import Rewards
from lmcli.train.post.rollouts import make_group, sample_groups

TEXT = "the cat sat on the mat. who sat? yes no abc system user assistant 0123456789+="
PAIRS = [
    {"prompt": "who sat?", "chosen": "the cat.", "rejected": "no"},
    {"prompt": "1+2=", "chosen": "3", "rejected": "12"},
    {"prompt": "abc", "chosen": "yes", "rejected": "the mat."},
]


@pytest.fixture
def pairs(tmp_path: Path):
    tok = tiny_tokenizer(TEXT)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    sequences = pair_set(PreferenceRows(str(path)).pairs(tok, 48))
    return tok, collate_pairs(sequences, [0, 1, 2], tok.pad_id, 48)


def test_lora_reference_is_the_base_model(pairs) -> None:
    tok, batch = pairs
    base = tiny_model(tok.vocab_size)
    adapted = lora.add_adapters(copy.deepcopy(base), train_config(init_from="x", lora_rank=2))
    with torch.no_grad():
        for m in adapted.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_b.normal_()  # adapters that change the output
    adapted.train()
    with torch.no_grad():
        expected = sequence_logprobs(base, batch)
        trained = sequence_logprobs(adapted.eval(), batch)[2]
    reference = Reference("adapters", adapted.train())
    torch.testing.assert_close(reference.token_logprobs(batch), expected[0], rtol=0, atol=0)
    torch.testing.assert_close(reference.pair_logprobs(batch), expected[2], rtol=0, atol=0)
    assert not torch.allclose(trained, expected[2])  # the adapters are on again afterwards ...
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(adapted.eval(), batch)[2], trained, rtol=0, atol=0)
    assert adapted.training is False  # ... and the mode is the caller's


def test_a_precomputed_table_equals_the_reference_on_the_fly(pairs) -> None:
    tok, batch = pairs
    model = tiny_model(tok.vocab_size)
    live = Reference("copy", frozen_copy(model))
    table = Reference("table")
    table.fill_table(model, "train", iter([batch]), 3)
    torch.testing.assert_close(table.pair_logprobs(batch), live.pair_logprobs(batch))
    restored = Reference("table")
    restored.load_state_dict(table.state_dict())
    torch.testing.assert_close(restored.pair_logprobs(batch), live.pair_logprobs(batch))


def test_a_model_against_itself_has_dpo_loss_log_2_and_the_sums_are_the_replies(pairs) -> None:
    tok, batch = pairs
    model = tiny_model(tok.vocab_size)
    settings = PreferenceSettings("dpo", beta=0.1)
    out = evaluate_pairs(model, [batch], Reference("copy", frozen_copy(model)), settings, split="train")
    assert out["loss"] == pytest.approx(math.log(2), abs=1e-6) and out["margin"] == pytest.approx(0, abs=1e-6)
    # the summed log-probs are those of the reply tokens (and <eos>) alone, read directly
    logits = model(batch.x)  # (2B, T, V)
    logp = torch.log_softmax(logits.float(), -1)
    for row in range(batch.x.size(0)):
        keep = batch.y[row] != IGNORE
        direct = logp[row, keep].gather(-1, batch.y[row, keep].unsqueeze(-1)).sum()
        assert sequence_logprobs(model, batch)[2][row].item() == pytest.approx(direct.item(), rel=1e-5)
    # simpo needs no reference
    simpo = pair_loss(model, batch, Reference("none"), PreferenceSettings("simpo", beta=2.0, gamma=0.5))
    assert simpo.loss.item() > 0


def _prompts(tmp_path: Path, tok):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in [("1+2=", "3"), ("abc", "9")])
    )
    return PromptRows(str(path)).prompts(tok, 40)


def test_rollouts_are_reproducible_one_generator_per_reply(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TEXT)
    model = tiny_model(tok.vocab_size)
    prompts = _prompts(tmp_path, tok)
    cfg = SampleConfig(max_new_tokens=6, temperature=1.0, seed=5)
    rows = sample_groups(model, tok, [p.ids for p in prompts], 3, cfg)
    again = sample_groups(model, tok, [p.ids for p in prompts], 3, cfg)
    assert [r.ids for r in rows] == [r.ids for r in again]
    assert len({tuple(r.ids) for r in rows[:3]}) > 1  # the replies of a group differ
    # reply 1 of prompt 1 is row 4, seeded 5 + 4: alone, with that seed, it is the same reply
    alone = sample_groups(
        model, tok, [prompts[1].ids], 1, SampleConfig(max_new_tokens=6, temperature=1.0, seed=9)
    )
    assert alone[0].ids == rows[4].ids


def test_a_group_batch_scores_the_replies_and_its_loss_runs(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TEXT)
    model = tiny_model(tok.vocab_size)
    prompts = _prompts(tmp_path, tok)
    rewards = Rewards(["number"])
    group = make_group(model, tok, prompts, rewards, 4, SampleConfig(max_new_tokens=5, temperature=1.0))
    assert group.rewards.shape == (2, 4, 1) and group.advantages.shape == (8,)
    for k in range(8):
        prompt = prompts[k // 4]
        n = len(prompt.ids)
        assert group.batch.x[k, :n].tolist() == prompt.ids
        scored = (group.batch.y[k] != IGNORE).nonzero().squeeze(1)
        assert (
            scored[0].item() == n - 1 and len(scored) == group.reply_tokens[k]
        )  # the reply, from its first token
    model.train()
    out = group_loss(model, group, n_tokens=int(group.reply_tokens.sum()), clip=0.2, kl_coef=0.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.ratio.item() == pytest.approx(1.0)


def test_the_preflight_counts_the_reference_copy() -> None:
    model = tiny_model()
    params = sum(p.numel() * 4 for p in model.parameters())
    assert Reference("copy", frozen_copy(model)).nbytes == params
    assert Reference("adapters", model).nbytes == 0
    # GRPO's decoding cache and step: tests/system/test_posttrain.py (the pre-flight of a run)
