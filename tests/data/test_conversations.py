"""SFT data: rows become conversations; only assistant replies (and their end token) carry loss,
under lmcli's template and under a Hugging Face ChatML template, as transformers marks them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_tokenizer, train_config

from lmcli.data.conversations import ConversationRows, conversation
from lmcli.data.examples import collate, tokenize_examples
from lmcli.data.windows import IGNORE
from lmcli.errors import LmcliError
from lmcli.text.chat_template import encode_conversation
from lmcli.text.tokenizer import Tokenizer

TEXT = "the cat sat on the mat. the dog sat on the log. who sat? be brief. yes no abc system user assistant"

CHAT = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "who sat?"},
    {"role": "assistant", "content": "the cat."},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "the dog."},
]

# ChatML as Qwen2 writes it: a default system turn, <|im_start|>ROLE\nCONTENT<|im_end|>\n per message
CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# the same layout, the replies marked as Hugging Face marks them for return_assistant_tokens_mask
CHATML_MARKED = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def scored_text(tok: Tokenizer, ids: list[int], scored: list[bool]) -> list[str]:
    """The scored runs of tokens, each decoded with its special tokens."""
    runs: list[list[int]] = []
    for i, (t, s) in enumerate(zip(ids, scored, strict=True)):
        if s:
            if i == 0 or not scored[i - 1]:
                runs.append([])
            runs[-1].append(t)
    return ["".join(tok.token(t) if t == tok.eos_id else tok.decode([t]) for t in run) for run in runs]


def test_lmcli_template_scores_replies_and_their_eos_for_both_row_formats(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TEXT)
    for row in (
        {"prompt": "who sat?", "response": "the cat.", "system": "be brief."},
        {"messages": CHAT[:3]},
    ):
        ids, scored = encode_conversation(conversation(row, "row"), None, tok)
        assert scored_text(tok, ids, scored) == ["the cat.<eos>"]
        context = [t for t, s in zip(ids, scored, strict=True) if not s]
        assert tok.decode(context) == "systembe brief.userwho sat?assistant"  # specials decode to ""
    ids, scored = encode_conversation(CHAT, None, tok)
    assert scored_text(tok, ids, scored) == ["the cat.<eos>", "the dog.<eos>"]
    # through the cache and collate, the loss reads exactly those tokens
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    examples = tokenize_examples(ConversationRows(str(tmp_path / "d.jsonl")), tok, 200, tmp_path / "cache")
    batch = collate(examples, [0], tok.pad_id, 200)
    targets = batch.y[0][batch.y[0] != IGNORE].tolist()
    assert targets == [t for t, s in zip(ids, scored, strict=True) if s]
    assert int(batch.prefix_len[0]) == scored.index(True)


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory) -> Path:
    """A tiny byte-level BPE with Qwen2's special tokens and a ChatML template, saved by transformers."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raw = HFTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator([TEXT * 5], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_MARKED
    folder = tmp_path_factory.mktemp("chatml")
    fast.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("template", [CHATML, CHATML_MARKED], ids=["plain", "generation-tags"])
def test_a_jinja_chat_template_scores_what_transformers_marks_as_assistant(
    chatml_folder: Path, template: str
) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(chatml_folder)
    marked = hf.apply_chat_template(
        CHAT[1:], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    tok = Tokenizer.load(chatml_folder)
    assert tok.chat_template == CHATML_MARKED
    ids, scored = encode_conversation(CHAT[1:], template, tok)
    assert ids == marked["input_ids"]  # the same text, the same tokens
    assert scored == [bool(m) for m in marked["assistant_masks"]]
    assert scored_text(tok, ids, scored) == ["the cat.<|im_end|>", "the dog.<|im_end|>"]
    # the prompt for the next reply is the scored conversation's prefix: training sees what serving sends
    from lmcli.text.chat_template import encode

    assert ids[: scored.index(True)] == encode(CHAT[1:2], template, tok)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "hi"}, 'expected "prompt" and "response", or "messages"'),
        ({"question": "hi", "answer": "yo"}, "found: question, answer"),
        (
            {"messages": [{"role": "assistant", "content": "hi"}]},
            "roles out of order: message 0 is 'assistant'",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            "roles out of order: message 1 is 'user'",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]},
            "empty assistant",
        ),
        ({"prompt": "hi", "response": ""}, "message 1 is an empty assistant turn"),
        ({"messages": [{"role": "user", "content": "a"}]}, "ends with a user turn"),
        ({"messages": [{"role": "robot", "content": "a"}]}, "role 'robot'"),
        ({"messages": "hi"}, "messages must be a non-empty list"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_rows_are_named_in_one_line(row: object, message: str) -> None:
    with pytest.raises(
        LmcliError, match="^data.jsonl:3: .*" + message.replace("(", r"\(").replace("?", r"\?")
    ):
        conversation(row, "data.jsonl:3")


def test_a_template_that_fails_to_render_is_one_line(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TEXT)
    for bad in ("{{ raise_exception('no system role') }}", "{{ messages | nosuchfilter }}", "{{ 1 + 'a' }}"):
        with pytest.raises(LmcliError, match="chat template"):
            encode_conversation(CHAT, bad, tok)
    # a template that renders the last reply differently from earlier ones has no reply spans
    shifting = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(LmcliError, match="is not a prefix"):
        encode_conversation(CHAT[1:], shifting, tok)


def test_long_conversations_are_truncated_or_skipped_and_counted(tmp_path: Path) -> None:
    from lmcli.data.train_data import load_train_data

    rows = [{"prompt": "who sat?", "response": "the cat."}] * 18
    rows += [{"prompt": "who sat?", "response": "the cat sat on the mat. " * 3}]  # the reply is cut
    rows += [{"prompt": "the dog sat on the log. " * 4, "response": "yes"}]  # no reply within the context
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = train_config(
        task="sft", corpus=(str(tmp_path / "d.jsonl"),), cache_dir=str(tmp_path / "c"), val_fraction=0.1
    )
    said: list[str] = []
    data = load_train_data(cfg, block_size=47, progress=False, info=said.append)
    assert said == [
        "warning: skipped 1 conversation(s) with no reply within the context (48 tokens)",
        "warning: truncated 1 conversation(s) longer than the context (48 tokens)",
    ]
    assert (data.info["examples"], data.info["truncated"], data.info["beyond"]) == (18, 1, 1)
    assert len(data.val) == 1 and data.val.length.tolist() == [48]  # the cut one, last in the file
