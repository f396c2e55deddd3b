"""Gemma 3 (text models, ``Gemma3ForCausalLM``: gemma-3-270m, gemma-3-1b): Llama's attention with
every variant lmcli has for it. Four norms a block (``sandwich``), each an RMSNorm scaled by
(1 + weight) in float32 (``rmsnorm1p``), query/key norms of the same kind, a GeGLU MLP with
tanh-GELU, embeddings scaled by sqrt(hidden) in the weights' dtype, attention scaled by
``query_pre_attn_scalar``, soft-capping when the config sets it, and a layer pattern: five local
layers (sliding window, their own rotary base ``rope_local_base_freq``, unscaled) then a global one.

``config.json`` comes in two dialects, both read: as published (transformers 4: ``rope_theta``,
``rope_local_base_freq``, ``sliding_window_pattern``, ``rope_scaling`` of the global layers) and
as transformers 5 writes it (``rope_parameters`` keyed by layer type, ``layer_types``); export
writes the installed transformers' (the second). llama.cpp's ``gemma3`` turns halves, as lmcli.

GGUF (llama.cpp's ``gemma3``): the norm weights stored with the 1 of (1 + weight) added, as
llama.cpp's converter writes them; ``head_dim`` as ``attention.key_length``; the window as
``attention.sliding_window``. llama.cpp fixes the rest in code, not metadata: every sixth layer
global (``i % 6 == 5``), the others local with rotary base 10,000 unscaled; attention scaled by
1/sqrt(head_dim) (by 1/sqrt(hidden/heads) for a 62-layer model, the 27B); no attention
soft-capping. A file reads so; export writes a model only where it computes the same, and a
model without a window with a window as long as its context (a window that never cuts).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families.adapter import (
    GGUF_BLOCK,
    GGUF_HEAD,
    GLOBAL,
    LOCAL,
    Format,
    Rename,
    SplitQKV,
    layer_types,
    shortest_period,
)
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.families.llama import HF_LAYER, Llama, rope_scaling_dict, rope_settings
from lmcli.formats.families.qwen3 import GGUF_QK_NORMS, QK_NORMS

DEFAULT_THETA = {GLOBAL: 1_000_000.0, LOCAL: 10_000.0}  # transformers' Gemma3TextConfig.default_theta


class Gemma3(Llama):
    name = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    gguf_arch = "gemma3"
    export_rank = 20
    norm, mlp, placement = "rmsnorm1p", "geglu", "sandwich"
    activation = "gelu_pytorch_tanh"
    hf_extra = {"attention_bias": False, "use_bidirectional_attention": False}
    hf_names = (
        Rename("wte", "model.embed_tokens"),
        Rename("ln_f", "model.norm"),
        Rename("lm_head", "lm_head"),
        Rename("h.{i}.ln_1", HF_LAYER + "input_layernorm"),
        Rename("h.{i}.post.0", HF_LAYER + "post_attention_layernorm"),
        Rename("h.{i}.ln_2", HF_LAYER + "pre_feedforward_layernorm"),
        Rename("h.{i}.post.1", HF_LAYER + "post_feedforward_layernorm"),
        SplitQKV("h.{i}.attn.c_attn", tuple(f"{HF_LAYER}self_attn.{x}_proj" for x in "qkv")),  # type: ignore[arg-type]
        *QK_NORMS,
        Rename("h.{i}.attn.c_proj", HF_LAYER + "self_attn.o_proj"),
        Rename("h.{i}.mlp.c_gate", HF_LAYER + "mlp.gate_proj"),
        Rename("h.{i}.mlp.c_fc", HF_LAYER + "mlp.up_proj"),
        Rename("h.{i}.mlp.c_proj", HF_LAYER + "mlp.down_proj"),
    )
    gguf_needs = (
        "Gemma 3's variants as llama.cpp fixes them: five local layers (rotary base 10000) then a "
        "global one, attention scaled by 1/sqrt(head size), no rope scaling or soft-capping"
    )
    # (llama.cpp's converter stores the norms' weights with the 1 added: ``from_gguf`` and
    # ``to_gguf`` take it off and put it on)
    gguf_names = (
        Rename("wte", "token_embd"),
        SplitQKV("h.{i}.attn.c_attn", tuple(f"blk.{{i}}.attn_{x}" for x in "qkv")),  # type: ignore[arg-type]
        *GGUF_QK_NORMS,
        *GGUF_BLOCK,
        Rename("h.{i}.post.0", "blk.{i}.post_attention_norm"),
        Rename("h.{i}.post.1", "blk.{i}.post_ffw_norm"),
        Rename("h.{i}.mlp.c_gate", "blk.{i}.ffn_gate"),
        *GGUF_HEAD,
    )
    expresses = frozenset(
        {
            "qk-norm",
            "a head size apart from n-embd/n-head",
            "a sliding window",
            "a layer pattern",
            "a local rotary base",
            "scaled embeddings",
            "an attention scale",
            "attention soft-capping",
            "logit soft-capping",
        }
    )
    gguf_expresses = None  # GGUF's gemma3 holds the same (the window and the layer pattern its own way)

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        return cfg.norm_placement == "sandwich" or cfg.norm == "rmsnorm1p" or cfg.mlp == "geglu"

    def gguf_context(self, cfg: ModelConfig) -> int:
        return cfg.block_size

    def window(self, hf: HFConfig) -> int | None:
        if hf.get("use_bidirectional_attention"):
            raise LmcliError(f"{hf.where}: use_bidirectional_attention (an encoder) is not supported")
        return hf.get("sliding_window")

    def default_layer_types(self, hf: HFConfig, n_layer: int, window: int) -> list[str]:
        every = hf.get("sliding_window_pattern", 6)
        return [LOCAL if (i + 1) % every else GLOBAL for i in range(n_layer)]

    def own_settings(self, hf: HFConfig, n_layer: int) -> dict[str, Any]:
        params = hf.section("rope_parameters")
        if GLOBAL in params.named() or LOCAL in params.named():  # transformers 5: by layer type
            full, local = params.section(GLOBAL), params.section(LOCAL)
            rope = rope_settings(hf, full)
            rope["rope_base"] = float(full.get("rope_theta", DEFAULT_THETA[GLOBAL]))
            local_base = local.get("rope_theta", DEFAULT_THETA[LOCAL])
            if local.get("rope_type", "default") != "default":
                raise LmcliError(
                    f"{hf.where}: unsupported rope_parameters.{LOCAL}.rope_type {local.get('rope_type')!r} "
                    "(lmcli's local layers turn unscaled)"
                )
        else:  # as published: rope_theta and rope_scaling of the global layers
            rope = rope_settings(hf)
            rope["rope_base"] = float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA[GLOBAL])))
            local_base = hf.get("rope_local_base_freq", DEFAULT_THETA[LOCAL])
        return {
            **rope,
            "rope_local_base": float(local_base),
            "qk_norm": True,
            "scale_embeddings": True,
            "norm_placement": self.placement,
            "attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            "attn_softcap": float(hf.get("attn_logit_softcapping", 0.0)),
            "logit_softcap": float(hf.get("final_logit_softcapping", 0.0)),
        }

    def own_problems(self, cfg: ModelConfig, fmt: Format) -> list[str]:
        found = ["biases"] if cfg.bias or cfg.qkv_bias else []
        found += [] if cfg.qk_norm else ["no qk-norm"]
        found += [] if cfg.scale_embeddings else ["unscaled embeddings"]
        if cfg.sliding_window and not cfg.rope_local_base and cfg.rope_scaling != "none":
            found.append("rope scaling on local layers")
        return found + (gguf_problems(cfg) if fmt == "gguf" else [])

    def gguf_metadata(self, writer: Any, cfg: ModelConfig) -> None:
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_base)  # the global layers'
        writer.add_sliding_window(cfg.sliding_window or cfg.block_size)

    def gguf_settings(self, meta: HFConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        arch = self.gguf_arch
        out = super().gguf_settings(meta, shapes)
        n_layer, width = meta.require(f"{arch}.block_count"), meta.require(f"{arch}.embedding_length")
        heads = meta.require(f"{arch}.attention.head_count")
        head_dim = out["head_size"] or width // heads
        window = meta.get(f"{arch}.attention.sliding_window", 0)
        pattern = "".join("L" if gguf_local(i) else "G" for i in range(n_layer))
        if window:
            out.update(
                sliding_window=window,
                layer_pattern="" if "G" not in pattern else shortest_period(pattern),
                rope_local_base=GGUF_LOCAL_BASE,
            )
        return out | {
            "qk_norm": True,
            "scale_embeddings": True,
            "attn_scalar": float(width // heads if n_layer == GGUF_27B_LAYERS else head_dim),
            "logit_softcap": float(meta.get(f"{arch}.final_logit_softcapping", 0.0)),
        }

    def from_gguf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        return _shift_norms(super().from_gguf(state, cfg), -1.0)

    def to_gguf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        return super().to_gguf(_shift_norms(state, 1.0), cfg)

    def hf_settings(self, cfg: ModelConfig) -> dict[str, Any]:
        full = {"rope_type": "default", **(rope_scaling_dict(cfg) or {}), "rope_theta": cfg.rope_base}
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_base or cfg.rope_base}
        scalar = cfg.attn_scalar or float(cfg.head_dim)
        return {
            "head_dim": cfg.head_dim,
            "hidden_activation": self.activation,
            "query_pre_attn_scalar": int(scalar) if scalar.is_integer() else scalar,  # (an int if it is one)
            "sliding_window": cfg.sliding_window or None,
            "layer_types": layer_types(cfg) if cfg.sliding_window else [GLOBAL] * cfg.n_layer,
            "rope_parameters": {GLOBAL: full, LOCAL: local},
            "attn_logit_softcapping": cfg.attn_softcap or None,
            "final_logit_softcapping": cfg.logit_softcap or None,
            "attention_dropout": 0.0,
        }


GGUF_PATTERN = 6  # llama.cpp's gemma3: layer i is local unless i % 6 == 5
GGUF_LOCAL_BASE = 10_000.0  # and its local layers turn by this base, unscaled
GGUF_27B_LAYERS = 62  # the model whose attention llama.cpp scales by 1/sqrt(hidden / heads)
_NORMS = ("ln_1", "ln_2", "post.0", "post.1", "attn.q_norm", "attn.k_norm")


def gguf_local(layer: int) -> bool:
    """Whether llama.cpp's gemma3 attends through the window in ``layer``."""
    return layer % GGUF_PATTERN < GGUF_PATTERN - 1


def gguf_problems(cfg: ModelConfig) -> list[str]:
    """What of ``cfg`` llama.cpp's gemma3 computes otherwise (see the module doc)."""
    found = []
    cut = 0 < cfg.sliding_window < cfg.block_size  # a window as long as the context never cuts
    if cut and any(cfg.is_local(i) != gguf_local(i) for i in range(cfg.n_layer)):
        pattern = cfg.layer_pattern or "L"
        found.append(f"a layer pattern other than five local layers then a global one ({pattern!r})")
    for i in range(cfg.n_layer):  # each layer's rotary base: llama.cpp's local layers turn by 10,000
        ours = cfg.rope_local_base or cfg.rope_base if cfg.is_local(i) else cfg.rope_base
        theirs = GGUF_LOCAL_BASE if gguf_local(i) else cfg.rope_base
        if ours != theirs:
            found.append(f"a rotary base of {ours:g} on layer {i}, where llama.cpp turns by {theirs:g}")
            break
    if cfg.rope_scaling != "none":
        found.append(f"rope scaling {cfg.rope_scaling!r}")
    scalar = float(cfg.n_embd // cfg.n_head if cfg.n_layer == GGUF_27B_LAYERS else cfg.head_dim)
    if (cfg.attn_scalar or cfg.head_dim) != scalar:
        found.append(f"an attention scale of 1/sqrt({cfg.attn_scalar:g}) (llama.cpp's: 1/sqrt({scalar:g}))")
    found += ["attention soft-capping"] if cfg.attn_softcap else []
    return found + (["logit soft-capping"] if cfg.logit_softcap else [])


def _shift_norms(state: dict[str, Tensor], by: float) -> dict[str, Tensor]:
    """``state`` (lmcli's names) with ``by`` added to every norm weight: GGUF's (1 + weight)."""
    ends = tuple(f".{n}.weight" for n in _NORMS)
    return {k: v + by if k == "ln_f.weight" or k.endswith(ends) else v for k, v in state.items()}


# transformers' Gemma3TextConfig defaults: a published multimodal folder's text_config names only
# what differs from them (gemma-3-4b-it's: hidden_size, intermediate_size, num_hidden_layers,
# rope_scaling, sliding_window)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}
# the text tower's tensors under a multimodal folder's names: as published (transformers 4) and
# as transformers 5 saves them
TOWER_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


class Gemma3Multimodal(Gemma3):
    """A multimodal Gemma 3 folder (``Gemma3ForConditionalGeneration``: gemma-3-4b and larger)
    read as its text tower, a ``Gemma3ForCausalLM``: the ``text_config`` (transformers' defaults
    for what it leaves out) and the tower's tensors; the vision tower and its projector are left
    unread. Import only: what export writes is the text model (``gemma3_text``)."""

    name = "gemma3"
    architecture = "Gemma3ForConditionalGeneration"
    export_rank = None  # read only: export writes the text model (gemma3_text)
    reads_gguf = False  # a GGUF file of gemma3 is the text model's
    hf_buffers = (r"(model\.)?vision_tower\..*", r"(model\.)?multi_modal_projector\..*")

    def config_from_hf(self, hf: HFConfig) -> tuple[ModelConfig, list[str]]:
        text = {**TEXT_DEFAULTS, **hf.get("text_config", {})}
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
        cfg, notices = super().config_from_hf(HFConfig(text, hf.where, hf.schema, "text_config."))
        return cfg, [
            *notices,
            "a multimodal Gemma 3 model: its text tower is read, its vision tower left out",
        ]

    def from_hf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        return super().from_hf({tower_name(k): v for k, v in state.items()}, cfg)


def tower_name(key: str) -> str:
    """A multimodal folder's tensor name as the text model's (others unchanged)."""
    for theirs, ours in TOWER_PREFIXES:
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    return key
