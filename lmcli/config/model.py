"""``ModelConfig``: the architecture of a Transformer, stored in every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from lmcli.config.fields import VOCAB_MULTIPLE_MAX, check_fields, option, parse_vocab_multiple
from lmcli.errors import LmcliError

Position = Literal["learned", "sinusoidal", "rope", "alibi"]


Mlp = Literal["gelu", "relu", "relu2", "swiglu"]


Norm = Literal["layernorm", "rmsnorm"]


NormPlacement = Literal["pre", "post"]


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
    norm: Norm = option("layernorm", "Normalization.")
    norm_placement: NormPlacement = option("pre", "Norm before (pre) or after (post) each sublayer.")
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
        if self.n_embd % self.n_head != 0:
            raise LmcliError(f"n-embd ({self.n_embd}) must be divisible by n-head ({self.n_head})")
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise LmcliError(f"rope needs an even head size, got n-embd/n-head = {self.head_dim}")
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
        return self.n_embd // self.n_head

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
