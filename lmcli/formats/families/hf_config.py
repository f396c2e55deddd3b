"""A Hugging Face ``config.json`` as the family adapters read it, every value checked on the way.

Every value an adapter takes from a config goes through ``HFConfig``: ``require`` for a field the
family cannot do without (one line naming it when absent), ``get`` for one with a default,
``section`` for a nested table (``rope_scaling``, ``rope_parameters``). Each field read has a
``Rule`` in ``SCHEMA`` (``ROPE_SCHEMA`` for the rope tables): its type and its range, checked
before the value is used, so a config from anywhere (a string for a number, a zero head count, a
context of 10^12) is one line naming the file, the field and what it must be. A field read
without a rule is a bug (``KeyError``). GGUF metadata is read through the same rules, as the
``config.json`` fields it stands for (``gguf_schema.GgufSchema``).

The ranges bound what a config alone can make lmcli do; whether the weights agree with the
config is checked after (``lmcli.formats.hf.weights.check_weights``), before anything is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcli.errors import LmcliError

MAX_VOCAB = 1 << 24  # vocabularies hold up to a few hundred thousand tokens
MAX_WIDTH = 1 << 16  # hidden sizes: up to ~25,000 in the largest models
MAX_FFN = 1 << 20
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 26  # 67M positions; the tables it sizes are checked against the weights


@dataclass(frozen=True)
class Rule:
    """What a field may hold: ``kind`` int, number, bool, text, table (a JSON object), names (a
    list of text), ids (a token id or a list of them) or any (checked by its reader); numbers
    within [lo, hi] (``above``: lo excluded)."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    above: bool = False

    def check(self, value: Any, name: str, where: str) -> Any:
        """``value`` if it follows the rule; one line naming ``where`` and ``name`` if not."""
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, int | float) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "text": isinstance(value, str),
            "table": isinstance(value, dict),
            "names": isinstance(value, list) and all(isinstance(v, str) for v in value),
            "ids": _ids(value),
            "any": True,
        }[self.kind]
        if not ok:
            raise LmcliError(f"{where}: {name} must be {_KINDS[self.kind]}, got {_short(value)}")
        for v in value if isinstance(value, list) and self.kind == "ids" else [value]:
            if self.kind in ("int", "number", "ids") and not self._in_range(v):
                low = "(" if self.above else "["
                raise LmcliError(
                    f"{where}: {name} must be in {low}{_num(self.lo)}, {_num(self.hi)}], got {_short(v)}"
                )
        return value

    def _in_range(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.above else v < self.lo):
            return False
        return self.hi is None or v <= self.hi


_KINDS = {
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "text": "text",
    "table": "a table (a JSON object)",
    "names": "a list of names",
    "ids": "a token id or a list of them",
    "any": "any value",
}


def _ids(value: Any) -> bool:
    items = value if isinstance(value, list) else [value]
    return all(isinstance(v, int) and not isinstance(v, bool) for v in items)


def _num(x: float | None) -> str:
    """A bound as it reads best: 67108864, not 6.71089e+07."""
    return str(int(x)) if x is not None and float(x).is_integer() else f"{x:g}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


COUNT = Rule("number", 0, 1e6, above=True)  # a positive scale factor
SCHEMA: dict[str, Rule] = {
    "model_type": Rule("text"),
    "architectures": Rule("names"),
    "vocab_size": Rule("int", 1, MAX_VOCAB),
    "hidden_size": Rule("int", 1, MAX_WIDTH),
    "n_embd": Rule("int", 1, MAX_WIDTH),
    "intermediate_size": Rule("int", 1, MAX_FFN),
    "n_inner": Rule("int", 1, MAX_FFN),
    "num_hidden_layers": Rule("int", 1, MAX_LAYERS),
    "n_layer": Rule("int", 1, MAX_LAYERS),
    "num_attention_heads": Rule("int", 1, MAX_HEADS),
    "n_head": Rule("int", 1, MAX_HEADS),
    "num_key_value_heads": Rule("int", 1, MAX_HEADS),
    "head_dim": Rule("int", 1, MAX_WIDTH),
    "max_position_embeddings": Rule("int", 1, MAX_CONTEXT),
    "n_positions": Rule("int", 1, MAX_CONTEXT),
    "sliding_window": Rule("int", 1, MAX_CONTEXT),
    "use_sliding_window": Rule("bool"),
    "rms_norm_eps": Rule("number", 0, 1, above=True),
    "layer_norm_epsilon": Rule("number", 0, 1, above=True),
    "rope_theta": Rule("number", 0, 1e15, above=True),
    "tie_word_embeddings": Rule("bool"),
    "hidden_act": Rule("text"),
    "activation_function": Rule("text"),
    "attention_bias": Rule("bool"),
    "mlp_bias": Rule("bool"),
    "rope_scaling": Rule("table"),
    "rope_parameters": Rule("table"),
    "layer_types": Rule("names"),
    "max_window_layers": Rule("int", 0, MAX_LAYERS),
    "sliding_window_pattern": Rule("int", 1, MAX_LAYERS),
    "rope_local_base_freq": Rule("number", 0, 1e15, above=True),
    "no_rope_layers": Rule("ids", 0, 1),
    "no_rope_layer_interval": Rule("int", 1, MAX_LAYERS),
    "query_pre_attn_scalar": Rule("number", 0, 1e9, above=True),
    "attn_logit_softcapping": Rule("number", 0, 1e9, above=True),
    "final_logit_softcapping": Rule("number", 0, 1e9, above=True),
    "hidden_activation": Rule("text"),
    "use_bidirectional_attention": Rule("bool"),
    "text_config": Rule("table"),
    "bos_token_id": Rule("ids", 0, MAX_VOCAB),
    "eos_token_id": Rule("ids", 0, MAX_VOCAB),
    "pad_token_id": Rule("ids", 0, MAX_VOCAB),
}
ROPE_SCHEMA: dict[str, Rule] = {
    "rope_type": Rule("text"),
    "type": Rule("text"),
    "rope_theta": SCHEMA["rope_theta"],
    "factor": COUNT,
    "original_max_position_embeddings": Rule("int", 1, MAX_CONTEXT),
    "low_freq_factor": COUNT,
    "high_freq_factor": COUNT,
    "beta_fast": COUNT,
    "beta_slow": COUNT,
    "truncate": Rule("bool"),
    "full_attention": Rule("table"),  # transformers 5: rope_parameters by layer type (Gemma 3)
    "sliding_attention": Rule("table"),
}


class HFConfig:
    """The fields of one ``config.json`` (or of a table inside it); ``where`` names the file,
    ``schema`` holds the rule of every field read, ``prefix`` names a table's fields."""

    def __init__(
        self,
        data: Mapping[str, Any],
        where: str,
        schema: Mapping[str, Rule] = SCHEMA,
        prefix: str = "",
    ) -> None:
        self.data = data
        self.where = where
        self.schema, self.prefix = schema, prefix

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, checked; ``default`` when the config does not name it (or null)."""
        value = self.data.get(key)
        if value is None:
            return default
        return self.schema[key].check(value, self.prefix + key, self.where)

    def require(self, key: str) -> Any:
        """The value of ``key``, checked; one line naming it when the config lacks it."""
        if self.data.get(key) is None:
            raise LmcliError(f"{self.where} has no {self.prefix + key}")
        return self.get(key)

    def section(self, key: str) -> HFConfig:
        """The table ``key`` (empty when absent or null), its fields read by ``ROPE_SCHEMA``."""
        return HFConfig(self.get(key) or {}, self.where, ROPE_SCHEMA, f"{self.prefix}{key}.")

    def named(self) -> set[str]:
        """The keys whose value is not null."""
        return {k for k, v in self.data.items() if v is not None}

    def __bool__(self) -> bool:
        return bool(self.data)
