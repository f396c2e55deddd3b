"""Llama: rotary positions, pre-RMSNorm, SwiGLU, no biases; any number of key/value heads, a tied
or untied head, linear, llama3 or yarn rope scaling. Qwen2 and Mistral are Llama with a difference
each (``qwen2.py``, ``mistral.py``).

Hugging Face keeps separate query, key and value projections (lmcli fuses them into one
``c_attn``, q then k then v rows, so the map concatenates or splits them) and already turns the
two halves of each head against each other, as lmcli does: no row is permuted. llama.cpp's
``llama`` turns adjacent pairs instead, so the GGUF map reorders each head's query and key rows
(``pairs_from_halves``; attention scores do not change) and reads them back the same way.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families.adapter import (
    GGUF_BLOCK,
    GGUF_HEAD,
    FamilyAdapter,
    Field,
    Format,
    Rename,
    SplitQKV,
)
from lmcli.formats.families.hf_config import HFConfig

# rope_scaling keys lmcli reads, by scaling type (any other key with a value is refused)
_ROPE_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"},
}
HF_LAYER = "model.layers.{i}."  # Hugging Face's names of a block's modules start so


def gguf_names(pairs: bool) -> tuple[Rename | SplitQKV, ...]:
    """The GGUF map of the Llama family; ``pairs``: the architecture turns adjacent rotary pairs
    (llama.cpp's ``llama``) rather than halves (its ``qwen2``)."""
    qkv = tuple(f"blk.{{i}}.attn_{x}" for x in "qkv")
    return (
        Rename("wte", "token_embd"),
        SplitQKV("h.{i}.attn.c_attn", qkv, pairs=pairs),  # type: ignore[arg-type]
        *GGUF_BLOCK,
        Rename("h.{i}.mlp.c_gate", "blk.{i}.ffn_gate"),
        *GGUF_HEAD,
    )


class Llama(FamilyAdapter):
    name = "llama"
    architecture = "LlamaForCausalLM"
    gguf_arch = "llama"
    export_rank = 100  # asked last: it writes every model no other family claims
    position, norm, mlp = "rope", "rmsnorm", "swiglu"
    activation: ClassVar[str] = "silu"  # config.json's hidden_act of the MLP
    qkv_bias: ClassVar[bool] = False  # biases on the query/key/value projections (Qwen2)
    hf_extra: ClassVar[dict[str, Any]] = {"attention_bias": False, "mlp_bias": False}
    expresses = frozenset({"a head size apart from n-embd/n-head"})
    # GGUF's llama has no window: a window over every layer is written as a context capped at it
    # (exact for every sequence that fits in it)
    gguf_expresses = frozenset({"a sliding window", "a head size apart from n-embd/n-head"})
    hf_names = (
        Rename("wte", "model.embed_tokens"),
        Rename("ln_f", "model.norm"),
        Rename("lm_head", "lm_head"),
        Rename("h.{i}.ln_1", HF_LAYER + "input_layernorm"),
        Rename("h.{i}.ln_2", HF_LAYER + "post_attention_layernorm"),
        SplitQKV("h.{i}.attn.c_attn", tuple(f"{HF_LAYER}self_attn.{x}_proj" for x in "qkv")),  # type: ignore[arg-type]
        Rename("h.{i}.attn.c_proj", HF_LAYER + "self_attn.o_proj"),
        Rename("h.{i}.mlp.c_gate", HF_LAYER + "mlp.gate_proj"),
        Rename("h.{i}.mlp.c_fc", HF_LAYER + "mlp.up_proj"),
        Rename("h.{i}.mlp.c_proj", HF_LAYER + "mlp.down_proj"),
    )
    hf_fields = (
        Field("max_position_embeddings", "block_size", 2048),
        Field("hidden_size", "n_embd"),
        Field("intermediate_size", "d_ff"),
        Field("num_hidden_layers", "n_layer"),
        Field("num_attention_heads", "n_head"),
        Field("num_key_value_heads", "n_kv_head", None),
        Field("rms_norm_eps", "norm_eps", 1e-6),
        Field("tie_word_embeddings", "tie_embeddings", False),
    )
    hf_buffers = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)  # kept by old checkpoints
    gguf_names = gguf_names(pairs=True)
    hf_refusal = (
        "no Hugging Face family expresses this model ({}): GPT-2 needs learned positions, pre-LayerNorm, "
        "a GELU MLP and biases; Llama/Qwen2/Qwen3/Mistral/SmolLM3 need rope, pre-RMSNorm, SwiGLU and no "
        "biases (Qwen2: query/key/value biases only); Gemma 3 needs rope, sandwich (1+w) RMSNorms, GeGLU, "
        "qk-norm and scaled embeddings"
    )
    gguf_needs = "rotary positions without scaling, pre-RMSNorm and a SwiGLU MLP"

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        return True  # (what it cannot express, ``problems`` names)

    def own_problems(self, cfg: ModelConfig, fmt: Format) -> list[str]:
        if fmt == "hf":
            return ["biases outside the query/key/value projection"] if cfg.bias else []
        return [f"rope scaling {cfg.rope_scaling!r}"] if cfg.rope_scaling != "none" else []

    def gguf_context(self, cfg: ModelConfig) -> int:
        if cfg.sliding_window and not cfg.layer_pattern:  # (a layer pattern is refused)
            return min(cfg.block_size, cfg.sliding_window)
        return cfg.block_size

    def config_from_hf(self, hf: HFConfig) -> tuple[ModelConfig, list[str]]:
        width, heads = hf.require("hidden_size"), hf.require("num_attention_heads")
        head_dim = hf.get("head_dim", width // heads)
        if width % heads and "head_dim" not in hf.named():
            raise LmcliError(
                f"{hf.where}: hidden_size is not a multiple of num_attention_heads and no head_dim"
            )
        act_key = "hidden_activation" if "hidden_activation" in hf.named() else "hidden_act"
        if hf.get(act_key, self.activation) != self.activation:
            raise LmcliError(
                f"{hf.where}: unsupported {act_key} {hf.get(act_key)!r} "
                f"(lmcli's {self.mlp} uses {self.activation})"
            )
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise LmcliError(f"{hf.where}: attention_bias/mlp_bias are not supported for {self.name}")
        fields = self.read_fields(hf)
        fields.update(
            n_kv_head=fields["n_kv_head"] or heads,
            tie_embeddings=bool(fields["tie_embeddings"]),
            head_size=head_dim if head_dim * heads != width else 0,
        )
        n_layer = fields["n_layer"]
        settings = {"bias": False, "qkv_bias": self.qkv_bias, **rope_settings(hf)}
        settings |= self.window_settings(hf, n_layer) | self.own_settings(hf, n_layer)
        try:
            cfg = ModelConfig(
                **fields,
                vocab_multiple=1,  # the imported shapes as they are
                position=self.position,
                mlp=self.mlp,
                norm=self.norm,
                **settings,
            )
        except LmcliError as exc:
            raise LmcliError(f"{hf.where}: {exc}") from None
        return cfg, []

    def hf_settings(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "head_dim": cfg.head_dim,
            "hidden_act": self.activation,
            "rope_theta": cfg.rope_base,
            "rope_scaling": rope_scaling_dict(cfg),
            "attention_dropout": 0.0,
            **self.window_config(cfg),
        }

    gguf_head_lengths: ClassVar[bool] = False  # key_length/value_length always written (else when needed)

    def gguf_metadata(self, writer: Any, cfg: ModelConfig) -> None:
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_base)
        if self.gguf_head_lengths or cfg.q_width != cfg.n_embd:  # llama.cpp's default: n_embd / n_head
            writer.add_key_length(cfg.head_dim)
            writer.add_value_length(cfg.head_dim)

    def gguf_settings(self, meta: HFConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """Norm epsilon, head size, rope base and scaling, and the biases the tensors hold; one
        line for what lmcli's rope cannot compute (a partial rotary dimension, frequency
        factors, yarn)."""
        arch = self.gguf_arch
        width, heads = meta.require(f"{arch}.embedding_length"), meta.require(f"{arch}.attention.head_count")
        head_dim = meta.get(f"{arch}.attention.key_length", width // heads)
        for key in (f"{arch}.rope.dimension_count", f"{arch}.attention.value_length"):
            if meta.get(key, head_dim) != head_dim:
                raise LmcliError(f"{meta.where}: {key} {meta.get(key)} is not the head size {head_dim}")
        out: dict[str, Any] = {
            "head_size": head_dim if head_dim * heads != width else 0,
            "norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            "rope_base": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            "bias": "blk.0.attn_output.bias" in shapes,
            "qkv_bias": "blk.0.attn_q.bias" in shapes,
        }
        if "rope_freqs.weight" in shapes:
            raise LmcliError(
                f"{meta.where}: rope frequency factors (rope_freqs.weight, Llama 3.1's long-context "
                "scaling) are not supported: import the model's Hugging Face folder instead"
            )
        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling == "linear":
            out.update(rope_scaling="linear", rope_factor=float(meta.require(f"{arch}.rope.scaling.factor")))
        elif scaling not in ("none", None):
            raise LmcliError(f"{meta.where}: unsupported rope scaling {scaling!r} (lmcli reads none, linear)")
        return out


def rope_settings(hf: HFConfig, params: HFConfig | None = None) -> dict[str, Any]:
    """lmcli's rope fields from a config's ``rope_theta``/``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5; ``params``: the table to read instead, a layer type's);
    an unsupported scaling type is refused."""
    params = params if params is not None else hf.section("rope_parameters")
    scaling = hf.section("rope_scaling") if hf.get("rope_scaling") else params
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {"rope_base": float(theta)}
    if kind in ("default", None):
        return out
    if kind not in _ROPE_KEYS:
        raise LmcliError(
            f"{hf.where}: unsupported rope_scaling type {kind!r} (lmcli implements linear, llama3 and yarn)"
        )
    extra = scaling.named() - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta"}
    if kind == "yarn" and (
        scaling.get("beta_fast", 32) != 32
        or scaling.get("beta_slow", 1) != 1
        or not scaling.get("truncate", True)
    ):
        extra.add("beta_fast/beta_slow/truncate")
    if extra:
        raise LmcliError(
            f"{hf.where}: unsupported rope_scaling field(s) {', '.join(sorted(extra))} for {kind}"
        )
    out.update(rope_scaling=kind, rope_factor=float(scaling.require("factor")))
    if kind in ("llama3", "yarn"):
        out["rope_original_context"] = int(scaling.require("original_max_position_embeddings"))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(scaling.require("low_freq_factor")),
            rope_high_freq_factor=float(scaling.require("high_freq_factor")),
        )
    return out


def rope_scaling_dict(cfg: ModelConfig) -> dict[str, Any] | None:
    """``rope_scaling`` as Hugging Face configs write it (None: no scaling)."""
    if cfg.rope_scaling == "none":
        return None
    out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = cfg.rope_original_context
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    return out
