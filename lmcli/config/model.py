"""``ModelConfig``: the architecture of a Transformer, stored in every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from lmcli.config.fields import VOCAB_MULTIPLE_MAX, check_fields, option, parse_vocab_multiple
from lmcli.errors import LmcliError

Position = Literal["learned", "sinusoidal", "rope", "alibi"]


Mlp = Literal["gelu", "relu", "relu2", "swiglu", "geglu"]


Norm = Literal["layernorm", "rmsnorm", "rmsnorm1p"]


NormPlacement = Literal["pre", "post", "sandwich"]


RopeScaling = Literal["none", "linear", "llama3", "yarn"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only Transformer. Travels inside every checkpoint."""

    TITLE: ClassVar[str] = "Model"  # the heading of its flags in `lmcli train --help`

    vocab_size: int = option(0, "Vocabulary size (from the tokenizer).", ge=0, cli=False, resume="derived")
    block_size: int = option(128, "Context length in tokens.", gt=0)
    n_layer: int = option(4, "Transformer blocks.", gt=0)
    n_head: int = option(4, "Attention heads.", gt=0)
    n_embd: int = option(128, "Embedding width.", gt=0)
    d_ff: int = option(0, "MLP width.", ge=0, default_help="4*n-embd, ~8/3*n-embd for swiglu")
    dropout: float = option(0.0, "Dropout rate.", ge=0, lt=1, resume="free")
    bias: bool = option(True, "Biases in linear layers and LayerNorm.", flag="--bias/--no-bias")
    position: Position = option("learned", "Position encoding.")
    mlp: Mlp = option("gelu", "Feed-forward network.")
    norm: Norm = option(
        "layernorm", "Normalization (rmsnorm1p: RMSNorm scaled by 1 + weight, in float32, as Gemma's)."
    )
    norm_placement: NormPlacement = option(
        "pre",
        "Norm before (pre) or after (post) each sublayer; sandwich: before each sublayer and on its "
        "output too (Gemma 2/3's four norms a block).",
    )
    tie_embeddings: bool = option(
        True, "Share input and output embeddings.", flag="--tie-embeddings/--untie-embeddings"
    )
    norm_eps: float = option(1e-5, "Epsilon of the norms.", gt=0)
    rope_base: float = option(10000.0, "Base of the rotary position frequencies (rope_theta).", gt=0)
    rope_scaling: RopeScaling = option(
        "none", "Rotary frequency scaling for long contexts: linear, llama3 (Llama 3.x) or yarn (Qwen2.5)."
    )
    rope_factor: float = option(1.0, "Rope scaling: how many times the original context.", gt=0)
    rope_original_context: int = option(
        0, "Rope scaling (llama3, yarn): the context the model was pretrained with.", ge=0
    )
    rope_low_freq_factor: float = option(1.0, "Rope scaling llama3: low-frequency factor.", gt=0)
    rope_high_freq_factor: float = option(4.0, "Rope scaling llama3: high-frequency factor.", gt=0)
    n_kv_head: int = option(
        0, "Key/value heads (grouped-query attention); must divide n-head.", ge=0, default_help="n-head"
    )
    qkv_bias: bool = option(
        False, "Query/key/value biases even with --no-bias (Qwen2).", flag="--qkv-bias/--no-qkv-bias"
    )
    qk_norm: bool = option(
        False,
        "RMS-normalize each head's queries and keys before attention (QK-norm).",
        flag="--qk-norm/--no-qk-norm",
    )
    head_size: int = option(
        0, "Size of each attention head (query/key/value width per head).", ge=0, default_help="n-embd/n-head"
    )
    sliding_window: int = option(
        0, "Local layers attend to the last this many positions, themselves included (0: no window).", ge=0
    )
    layer_pattern: str = option(
        "",
        "Which layers are local (L: sliding window) and which global (G), repeated over the layers "
        "(Gemma 3: LLLLLG); empty: every layer local when there is a window.",
    )
    rope_local_base: float = option(
        0.0, "Rotary base of the local layers, without rope scaling (Gemma 3: 10000; 0: rope-base).", ge=0
    )
    rope_pattern: str = option(
        "",
        "Which layers turn queries and keys by rotary positions (R) and which have none (N), repeated "
        "over the layers (SmolLM3: RRRN); empty: every layer.",
    )
    scale_embeddings: bool = option(
        False,
        "Multiply the token embeddings by sqrt(n-embd), rounded to the weights' dtype (Gemma).",
        flag="--scale-embeddings/--no-scale-embeddings",
    )
    attn_scalar: float = option(
        0.0, "Scale attention scores by 1/sqrt(this) (Gemma's query_pre_attn_scalar; 0: the head size).", ge=0
    )
    attn_softcap: float = option(
        0.0, "Cap the attention scores softly: cap * tanh(score / cap) (0: off; Gemma 2 uses 50).", ge=0
    )
    logit_softcap: float = option(
        0.0, "Cap the logits softly: cap * tanh(logits / cap) (0: off; Gemma 2 uses 30).", ge=0
    )
    zero_init: bool = option(
        False,
        "Start every residual output projection at zero (each block begins as the identity).",
        flag="--zero-init/--no-zero-init",
        resume="free",
    )
    vocab_multiple: int = option(
        0,
        "Round the embedding table and vocabulary projection up to a multiple of this many rows "
        "(fast GPU matmuls); outputs and exports keep the tokenizer's vocabulary. auto or 0: "
        "decided where the run trains.",
        ge=0,
        le=VOCAB_MULTIPLE_MAX,
        parse=parse_vocab_multiple,
        default_help="auto: 64 when training on CUDA, 1 elsewhere",
        absent=1,  # run folders written before the option: no padding
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.head_size and self.n_embd % self.n_head != 0:
            raise LmcliError(f"n-embd ({self.n_embd}) must be divisible by n-head ({self.n_head})")
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise LmcliError(f"rope needs an even head size, got {self.head_dim}")
        for name, letters in (("layer-pattern", "LG"), ("rope-pattern", "RN")):
            pattern = getattr(self, name.replace("-", "_"))
            if set(pattern) - set(letters) or len(pattern) > self.n_layer:
                raise LmcliError(
                    f"invalid {name} {pattern!r}: use the letters {' and '.join(letters)}, "
                    f"at most one per layer ({self.n_layer})"
                )
        if self.layer_pattern and not self.sliding_window:
            raise LmcliError("layer-pattern needs --sliding-window")
        if (self.rope_local_base or self.rope_pattern) and self.position != "rope":
            raise LmcliError("rope-local-base and rope-pattern need --position rope")
        if self.n_kv_head == 0:  # the default: one key/value head per query head
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_head % self.n_kv_head != 0:
            raise LmcliError(f"n-kv-head ({self.n_kv_head}) must divide n-head ({self.n_head})")
        if self.rope_scaling in ("llama3", "yarn") and not self.rope_original_context:
            raise LmcliError(f"rope-scaling {self.rope_scaling} needs --rope-original-context")
        if self.rope_scaling != "none" and self.position != "rope":
            raise LmcliError(f"rope-scaling {self.rope_scaling} needs --position rope")

    @property
    def head_dim(self) -> int:
        """Width of each attention head: ``head_size``, by default n_embd / n_head."""
        return self.head_size or self.n_embd // self.n_head

    @property
    def q_width(self) -> int:
        """Width of all query heads together (n_embd unless ``head_size`` says otherwise)."""
        return self.n_head * self.head_dim

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window (``layer_pattern``, repeated)."""
        if not self.sliding_window:
            return False
        return not self.layer_pattern or self.layer_pattern[layer % len(self.layer_pattern)] == "L"

    def is_rotary(self, layer: int) -> bool:
        """Whether ``layer`` turns its queries and keys (``rope_pattern``, repeated)."""
        return not self.rope_pattern or self.rope_pattern[layer % len(self.rope_pattern)] == "R"

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table and the vocabulary projection: ``vocab_size`` rounded up
        to ``vocab_multiple`` (0, auto not yet resolved by training: no padding). The rows past
        ``vocab_size`` are never an input, never scored and never exported."""
        multiple = max(self.vocab_multiple, 1)
        return -(-self.vocab_size // multiple) * multiple

    @property
    def attn_bias(self) -> bool:
        """Whether the query/key/value projection has biases (the output projection: ``bias``)."""
        return self.bias or self.qkv_bias

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP; SwiGLU keeps the parameter count of a 4x GELU MLP."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            return 8 * ((8 * self.n_embd // 3 + 7) // 8)
        return 4 * self.n_embd

    @classmethod
    def on_resume(cls, kind: Literal["fixed", "free", "derived"]) -> tuple[str, ...]:
        """The fields a resumed run must keep (``fixed``: all that define what the weights
        compute), may change (``free``), or takes from its data (``derived``)."""
        return tuple(f.name for f in fields(cls) if (f.metadata.get("resume") or "fixed") == kind)
