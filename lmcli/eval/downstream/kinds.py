"""The three kinds of downstream task: how a row becomes a prompt, how it is scored, what it reports.

Scores follow lm-evaluation-harness (``api/task.py``, ``process_results`` and its aggregations):

- multiple choice: each choice is scored as the continuation ``" " + choice`` of the context (the
  harness's ``target_delimiter``); ``acc`` is 1 when the choice of the highest summed
  log-likelihood is the answer, ``acc_norm`` when the highest log-likelihood divided by the
  choice's length in characters is (the harness's ``completion_len``, the delimiter not
  counted); ties go to the first choice (``numpy.argmax``);
- cloze: the target is scored as the continuation of the context; ``acc`` is 1 when greedy
  decoding produces it, ``perplexity`` is exp(-mean over rows of its summed log-likelihood);
- generation: greedy decoding from the prompt until a stop string, ``<eos>`` or
  ``--max-gen-tokens``; ``exact_match`` is 1 when the prediction equals the answer.

A few-shot prompt is the solved examples, each ``context + delimiter + answer + "\\n\\n"``,
then the row's context (the harness's ``fewshot_delimiter``); for generation with a chat
template, the examples are user and assistant turns and the row's context the last user turn.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from lmcli.config.commands import SampleConfig
from lmcli.data.corpus import batched
from lmcli.eval.downstream.formats import Item
from lmcli.eval.downstream.scoring import encode_pairs, score_groups
from lmcli.generate.sampling import BATCH_ROWS, generate
from lmcli.model.transformer import Transformer
from lmcli.text import chat_template
from lmcli.text.tokenizer import Tokenizer

FEWSHOT_DELIMITER = "\n\n"  # after each solved example
DEFAULT_STOP = ("\n\n",)  # a generation without a chat template and without its own stop strings


@dataclass(frozen=True)
class Chat:
    """A model that answers in chat turns: its Hugging Face template, or lmcli's (None)."""

    template: str | None


@dataclass
class Scorer:
    """What scoring needs besides the rows: the model, how it reads prompts, and the progress."""

    model: Transformer
    tokenizer: Tokenizer
    batch_size: int = 8
    chat: Chat | None = None  # generation tasks are asked in chat turns
    max_gen_tokens: int = 256
    advance: Callable[[int], None] = lambda n: None  # n more rows scored


class Kind:
    """A kind of task: its metrics, the one the combined score reads, and how rows are scored."""

    name: ClassVar[str]
    metrics: ClassVar[tuple[str, ...]]
    main: ClassVar[str]  # the metric of the combined score
    delimiter: ClassVar[str] = " "  # between a context and its answer

    def prompt(self, item: Item, shots: list[Item]) -> str:
        """The text the model reads: the solved examples, then the row's context."""
        solved = "".join(s.context + self.delimiter + s.shown + FEWSHOT_DELIMITER for s in shots)
        return solved + item.context

    def score(self, scorer: Scorer, items: list[Item], shots: list[Item]) -> list[dict[str, float]]:
        """Each row's scores (``metrics``, or what ``aggregate`` needs for them)."""
        raise NotImplementedError

    def aggregate(self, rows: list[dict[str, float]]) -> dict[str, float]:
        """The task's scores: the mean of each row's."""
        return {m: sum(r[m] for r in rows) / len(rows) for m in self.metrics}


class MultipleChoice(Kind):
    name = "multiple_choice"
    metrics = ("acc", "acc_norm")
    main = "acc_norm"

    def score(self, scorer: Scorer, items: list[Item], shots: list[Item]) -> list[dict[str, float]]:
        tok = scorer.tokenizer
        groups = [encode_pairs(tok, self.prompt(it, shots), [" " + c for c in it.choices]) for it in items]
        out = []
        for item, scored in zip(
            items, score_groups(scorer.model, groups, scorer.batch_size, scorer.advance), strict=True
        ):
            lls = [ll for ll, _ in scored]
            norm = [ll / len(choice) for ll, choice in zip(lls, item.choices, strict=True)]
            out.append(
                {"acc": float(argmax(lls) == item.answer), "acc_norm": float(argmax(norm) == item.answer)}
            )
        return out


class Cloze(Kind):
    name = "cloze"
    metrics = ("acc", "perplexity")
    main = "acc"
    delimiter = ""  # the target holds its own leading space

    def score(self, scorer: Scorer, items: list[Item], shots: list[Item]) -> list[dict[str, float]]:
        groups = [encode_pairs(scorer.tokenizer, self.prompt(it, shots), [it.target]) for it in items]
        scored = score_groups(scorer.model, groups, scorer.batch_size, scorer.advance)
        return [{"acc": float(greedy), "loglikelihood": ll} for [(ll, greedy)] in scored]

    def aggregate(self, rows: list[dict[str, float]]) -> dict[str, float]:
        mean_ll = sum(r["loglikelihood"] for r in rows) / len(rows)
        return {"acc": sum(r["acc"] for r in rows) / len(rows), "perplexity": math.exp(min(-mean_ll, 700.0))}


class Generation(Kind):
    name = "generation"
    metrics = ("exact_match",)
    main = "exact_match"

    def prompt_ids(self, scorer: Scorer, item: Item, shots: list[Item]) -> list[int]:
        """The prompt's ids: ``<bos>`` and the text, or the chat template's turns."""
        tok = scorer.tokenizer
        if scorer.chat is None:
            ids = [tok.bos_id, *tok.encode(self.prompt(item, shots))]
        else:
            messages = [m for s in shots for m in _turns(s.context, s.shown)]
            messages.append({"role": "user", "content": item.context})
            ids = chat_template.encode(messages, scorer.chat.template, tok)
        return ids[-(scorer.model.config.block_size - 1) :]  # the end of a prompt longer than the context

    def score(self, scorer: Scorer, items: list[Item], shots: list[Item]) -> list[dict[str, float]]:
        out: list[dict[str, float]] = [{} for _ in items]
        by_stop: dict[tuple[str, ...], list[int]] = {}
        for i, item in enumerate(items):
            stop = item.stop if item.stop or scorer.chat is not None else DEFAULT_STOP
            by_stop.setdefault(stop, []).append(i)
        for stop, indices in by_stop.items():
            cfg = SampleConfig(temperature=0.0, max_new_tokens=scorer.max_gen_tokens, stop=stop)
            for chunk in batched(indices, BATCH_ROWS):
                prompts = [self.prompt_ids(scorer, items[i], shots) for i in chunk]
                for i, g in zip(chunk, generate(scorer.model, scorer.tokenizer, prompts, cfg), strict=True):
                    out[i] = {"exact_match": float(prediction(g.text, items[i]) == answer(items[i]))}
                scorer.advance(len(chunk))
        return out


KIND_OF: dict[str, Kind] = {k.name: k for k in (MultipleChoice(), Cloze(), Generation())}


def argmax(values: list[float]) -> int:
    """The index of the largest value, the first of equals (``numpy.argmax``)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _turns(question: str, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]


def _number(text: str) -> str:
    """A number as the harness's gsm8k compares it: without ``,``, ``$`` and a final ``.``."""
    return re.sub(r"\.$", "", text.replace(",", "").replace("$", "").strip())


def prediction(text: str, item: Item) -> str:
    """What a generation answers: its ``extract`` group (a number, compared as ``_number``), or the
    generated text, stripped."""
    if item.extract is None:
        return text.strip()
    found = re.search(item.extract, text)
    return _number(found.group(1)) if found else ""


def answer(item: Item) -> str:
    """The answer a prediction must equal."""
    return _number(item.target) if item.extract is not None else item.target.strip()
