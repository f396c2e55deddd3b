"""Verifiable rewards for ``--task grpo``: what a reply earns, from its text and its prompt's row.

``--reward SPEC`` (repeatable; a reply's reward is the sum of its verifiers', each logged too):

- ``number``: 1 when the reply's final number equals the row's ``answer`` (its final number,
  so a GSM8K solution ``... #### 72`` works as the answer), else 0. The reply's final number is
  the one after its last ``####`` (GSM8K's form), else after its last "the answer is", else its
  last number; ``1,000``, ``$5`` and ``72.0`` read as 1000, 5 and 72;
- ``exact``: 1 when the reply, stripped, equals the row's ``answer`` (a string), stripped;
- ``regex:PATTERN``: 1 when the whole reply, stripped, matches the regular expression;
- ``json``: 1 when the reply parses as JSON;
- ``json_schema[:FILE]``: 1 when the reply parses as JSON and the value matches the schema
  (FILE's, else the row's ``schema``), checked by llguidance, the structured-output engine's
  grammar compiler (``generate/constrain.py``): object keys are put in the schema's order first,
  as that engine writes them;
- ``length:N``: a penalty, 0 up to N characters, then falling linearly to -1 at 2N;
- ``path/to/file.py:fn``: the user's own function ``fn(prompt: str, reply: str, row: dict) ->
  float`` (trusted code: the user's), run in a process of its own (``reward_worker.py``), so a
  function that calls ``sys.exit`` or ends its process cannot end training silently. ``prompt``
  is the row's ``prompt``, or its last user message.

A reward that cannot be computed (a row without ``answer``, a user function that raises, returns
no number or exits) is one line naming the row; so is a reward that a float32 tensor cannot hold
(above 3.4e38). ``check`` reads every row before training, so a row a verifier cannot score
fails then, not hours in.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import weakref
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from lmcli.errors import LmcliError
from lmcli.train.post import reward_worker
from lmcli.train.post.reward_worker import one_line

NUMBER = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"  # 1,234.5 or 1234.5 or -7
MARKED = (r"####\s*\$?\s*(" + NUMBER + ")", r"answer is\s*:?\s*\$?\s*(" + NUMBER + ")")
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: rewards are float32 tensors


def final_number(text: str) -> Decimal | None:
    """The number a text ends on: after its last ``####``, else its last "the answer is", else
    its last number; None when it has none."""
    for pattern in MARKED:
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if found:
            return _decimal(found[-1])
    found = re.findall(NUMBER, text)
    return _decimal(found[-1]) if found else None


def _decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def answer_number(value: Any) -> Decimal | None:
    """A row's ``answer`` as a number: a JSON number, or a text's final number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) and math.isfinite(value):
        return Decimal(str(value))
    return final_number(value) if isinstance(value, str) else None


class Verifier:
    """One ``--reward`` spec: ``check`` a row once, then ``__call__`` scores a reply."""

    penalty = False  # a penalty (at most 0) is no check a reply passes or fails

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.name = spec.split(":", 1)[0]  # what the logs call it

    def check(self, row: dict[str, Any], where: str) -> None:
        """Refuse a row this verifier cannot score (one line naming ``where``)."""

    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        raise NotImplementedError


class NumberReward(Verifier):
    def check(self, row: dict[str, Any], where: str) -> None:
        if answer_number(row.get("answer")) is None:
            raise LmcliError(f'{where}: --reward number needs an "answer" holding a number')

    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        got = final_number(reply)
        try:
            return float(got is not None and got == answer_number(row["answer"]))
        except InvalidOperation:
            return 0.0


class ExactReward(Verifier):
    def check(self, row: dict[str, Any], where: str) -> None:
        if not isinstance(row.get("answer"), str):
            raise LmcliError(f'{where}: --reward exact needs an "answer" string')

    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        return float(reply.strip() == row["answer"].strip())


class RegexReward(Verifier):
    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        try:
            self.pattern = re.compile(spec.split(":", 1)[1])
        except re.error as exc:
            raise LmcliError(f"--reward {spec}: not a regular expression ({exc})") from None

    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        return float(self.pattern.fullmatch(reply.strip()) is not None)


class JsonReward(Verifier):
    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        return float(parse_json(reply) is not _INVALID)


class SchemaReward(Verifier):
    """``json_schema:FILE`` (one schema) or ``json_schema`` (each row's ``schema``)."""

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        self.schema: str | None = None
        if ":" in spec:
            path = Path(spec.split(":", 1)[1]).expanduser()
            try:
                self.schema = canonical_schema(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                raise LmcliError(f"--reward {spec}: cannot read a JSON schema from {path}: {exc}") from None
            schema_matcher(self.schema, spec)  # compiled now: a bad schema fails before training

    def check(self, row: dict[str, Any], where: str) -> None:
        if self.schema is None:
            if not isinstance(row.get("schema"), dict):
                raise LmcliError(
                    f'{where}: --reward json_schema needs a "schema" object (or json_schema:FILE)'
                )
            schema_matcher(canonical_schema(row["schema"]), where)

    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        value = parse_json(reply)
        if value is _INVALID:
            return 0.0
        schema = self.schema if self.schema is not None else canonical_schema(row["schema"])
        return float(matches_schema(value, schema))


class LengthPenalty(Verifier):
    penalty = True

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        arg = spec.split(":", 1)[1] if ":" in spec else ""
        if not arg.isdigit() or int(arg) < 1:
            raise LmcliError(f"--reward {spec}: expected length:N, N a number of characters above 0")
        self.limit = int(arg)

    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        return -min(1.0, max(0, len(reply) - self.limit) / self.limit)


class UserReward(Verifier):
    """``path/to/file.py:fn``, the user's own function (trusted code), run in its own process."""

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        path_text, fn_name = spec.rsplit(":", 1)
        self.name = fn_name
        self.worker = RewardWorker(Path(path_text).expanduser(), fn_name, spec)

    def __call__(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        return self.worker.call(prompt, reply, row)

    def close(self) -> None:
        self.worker.close()


class Refused(Exception):
    """A user's reward function failed: the words say how (its exception, its exit)."""


class RewardWorker:
    """The process one user function runs in (``reward_worker.py``): started, its file imported
    (a failure is one line), then one call a request; ``close`` (or the object's end) stops it."""

    def __init__(self, path: Path, fn_name: str, spec: str) -> None:
        if not path.is_file():
            raise LmcliError(f"--reward {spec}: no such file: {path}")
        self.spec = spec
        self.process = subprocess.Popen(
            [sys.executable, reward_worker.__file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._stop = weakref.finalize(self, _stop_worker, self.process)
        try:
            kind, why = self._ask((str(path), fn_name, list(sys.path)))
        except Refused:  # the file ended the process as it was imported
            kind, why = "error", f"importing {path} ended its process (exit code {self.process.returncode})"
        if kind != "ok":
            self.close()
            raise LmcliError(f"--reward {spec}: {why}")

    def call(self, prompt: str, reply: str, row: dict[str, Any]) -> float:
        kind, value = self._ask((prompt, reply, row))
        if kind != "ok":
            raise Refused(value)
        return value

    def _ask(self, request: Any) -> tuple[str, Any]:
        """The worker's answer to ``request``; a worker that is gone is a ``Refused`` saying so."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        try:
            reward_worker.send(stdin, request)
            answer = reward_worker.receive(stdout)
        except (OSError, ValueError):  # its pipe broken, or closed already
            answer = None
        if answer is None:
            self.close()
            code = self.process.returncode
            raise Refused(f"the function ended its process (exit code {code}) instead of returning a number")
        return answer

    def close(self) -> None:
        self._stop()


def _stop_worker(process: subprocess.Popen[bytes]) -> None:
    """End a worker: its requests closed (it exits at their end), then waited for."""
    pipes: list[IO[bytes] | None] = [process.stdin, process.stdout]
    for pipe in pipes:
        if pipe is not None:
            pipe.close()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # a function still running: the training is over anyway
        process.kill()
        process.wait()


BUILTIN: dict[str, type[Verifier]] = {
    "number": NumberReward,
    "exact": ExactReward,
    "regex": RegexReward,
    "json": JsonReward,
    "json_schema": SchemaReward,
    "length": LengthPenalty,
}


def make_verifier(spec: str) -> Verifier:
    """The verifier of one ``--reward`` spec (a built-in name, or ``file.py:fn``)."""
    name = spec.split(":", 1)[0]
    if ".py:" in spec:
        return UserReward(spec)
    if name not in BUILTIN or (name == "regex" and ":" not in spec):
        raise LmcliError(
            f"--reward {spec!r}: choose from number, exact, regex:PATTERN, json, json_schema[:FILE], "
            "length:N, or path/to/file.py:function"
        )
    return BUILTIN[name](spec)


class Rewards:
    """Every ``--reward`` of a run: checks rows, scores replies (total and per verifier)."""

    def __init__(self, specs: list[str] | tuple[str, ...]) -> None:
        if not specs:
            raise LmcliError("--task grpo needs --reward (e.g. --reward number)")
        self.verifiers = [make_verifier(spec) for spec in specs]
        names = [v.name for v in self.verifiers]
        self.names = [n if names.count(n) == 1 else f"{n}{i}" for i, n in enumerate(names)]

    def check(self, row: dict[str, Any], where: str) -> None:
        for verifier in self.verifiers:
            verifier.check(row, where)

    def passed(self, scores: list[float]) -> bool:
        """Whether a reply passes: every verifier but the penalties gives it a positive reward."""
        checks = [s for v, s in zip(self.verifiers, scores, strict=True) if not v.penalty]
        return all(s > 0 for s in checks) if checks else sum(scores) >= 0

    def score(self, prompt: str, reply: str, row: dict[str, Any], where: str) -> list[float]:
        """Each verifier's reward of ``reply``; a failure is one line naming ``where`` (the row)."""
        out = []
        for verifier in self.verifiers:
            try:
                value = verifier(prompt, reply, row)
            except Refused as exc:
                raise LmcliError(f"{where}: --reward {verifier.spec}: {exc}") from None
            except Exception as exc:  # a verifier may fail on odd input: one line naming the row
                raise LmcliError(f"{where}: --reward {verifier.spec}: {one_line(exc)}") from None
            if abs(value) > FLOAT32_MAX:
                raise LmcliError(
                    f"{where}: --reward {verifier.spec}: returned {value:g}, beyond what a float32 "
                    f"holds ({FLOAT32_MAX:.4g}): rewards are float32 tensors, scale it down"
                )
            out.append(value)
        return out

    def close(self) -> None:
        """Stop the processes the user's functions run in."""
        for verifier in self.verifiers:
            if isinstance(verifier, UserReward):
                verifier.close()


# ----------------------------------------------------------------------------- JSON and schemas

_INVALID = object()  # what parse_json returns for text that is not JSON


def parse_json(text: str) -> Any:
    """The JSON value of the stripped text, or ``_INVALID``."""
    try:
        return json.loads(text.strip(), parse_constant=_not_json)
    except (ValueError, RecursionError):
        return _INVALID


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def canonical_schema(schema: Any) -> str:
    """A schema's JSON text, the key of its compiled matcher."""
    return json.dumps(schema, sort_keys=False)


def matches_schema(value: Any, schema_text: str) -> bool:
    """Whether a JSON value matches a schema: its keys put in the schema's property order, the
    text fed byte by byte to llguidance's matcher of the schema."""
    text = json.dumps(_in_schema_order(value, json.loads(schema_text)), ensure_ascii=False)
    matcher = schema_matcher(schema_text, "the schema").deep_copy()
    return matcher.consume_tokens(list(text.encode("utf-8"))) and matcher.is_accepting()


def _in_schema_order(value: Any, schema: Any) -> Any:
    """``value`` with each object's keys in its schema's ``properties`` order (others after),
    integral floats written as integers."""
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        return {k: _in_schema_order(value[k], props.get(k)) for k in keys}
    if isinstance(value, list):
        return [_in_schema_order(v, schema.get("items")) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)  # 1.0 is an integer to JSON Schema
    return value


@lru_cache(maxsize=64)
def schema_matcher(schema_text: str, where: str) -> Any:
    """llguidance's matcher of a JSON schema over a byte vocabulary (free whitespace), compiled
    once per schema; a schema it refuses is one line naming ``where``."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_text, overrides={"whitespace_flexible": True})
    except (ValueError, TypeError) as exc:
        raise LmcliError(f"{where}: invalid JSON schema: {one_line(exc)}") from None
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise LmcliError(f"{where}: invalid JSON schema: {' '.join(matcher.get_error().split())[:300]}")
    return matcher


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, as llguidance's ``TokenizerWrapper`` reads it."""

    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [256]
    eos_token_id, bos_token_id = 256, None

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=len(_Bytes.tokens))
