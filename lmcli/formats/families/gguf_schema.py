"""A GGUF file's metadata read as a ``config.json`` is: each architecture's key checked by the rule
of the ``config.json`` field it stands for (``hf_config.SCHEMA``), so a crafted header is one line
naming the file, the key and what it must hold, as a crafted ``config.json`` is.

The adapters read the keys (``FamilyAdapter.config_from_gguf``, ``gguf_settings``);
``lmcli.formats.gguf.check.config_from_gguf`` opens the metadata through ``GgufSchema``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from lmcli.formats.families.hf_config import ROPE_SCHEMA, SCHEMA, Rule

# GGUF metadata keys ("{arch}." + key) and the config.json field each stands for
GGUF_FIELDS = {
    "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "rope.dimension_count": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
GGUF_ROPE = {"rope.scaling.type": "type", "rope.scaling.factor": "factor"}


class GgufSchema(Mapping[str, Rule]):
    """The rules of a GGUF file's metadata, read through ``HFConfig`` as ``config.json`` is: an
    architecture's key (``llama.block_count``) has the rule of the field it stands for
    (``GGUF_FIELDS``); ``general.*`` and ``tokenizer.*`` keys are checked by their readers (the
    tokenizer's rebuild); any other key is a bug (``KeyError``)."""

    def __getitem__(self, key: str) -> Rule:
        group, _, rest = key.partition(".")
        if group in ("general", "tokenizer"):
            return Rule("any")
        if rest in GGUF_FIELDS:
            return SCHEMA[GGUF_FIELDS[rest]]
        if rest in GGUF_ROPE:
            return ROPE_SCHEMA[GGUF_ROPE[rest]]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())  # the keys depend on the architecture: looked up, never listed

    def __len__(self) -> int:
        return 0
