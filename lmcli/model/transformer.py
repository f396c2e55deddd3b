"""The decoder-only Transformer: embeddings, positions, masked self-attention, MLP, norms.

``Transformer.forward(idx, cache=None) -> logits``; no loss and no I/O live here. The default
configuration is GPT-2's architecture (learned positions, pre-LayerNorm, tanh-GELU, tied head).
Variants are small objects chosen once from the config: a position scheme (``lmcli.model.positions``),
an MLP class, a norm class and a norm placement.

One hook leads out of this file: ``Transformer.fast_step``, None unless ``lmcli.model.fastpath`` has
installed a device-specific one-token decoding step for the duration of an inference scope.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.config.model import ModelConfig
from lmcli.device import compute_dtype
from lmcli.model.documents import document_mask, document_positions, flex_attention
from lmcli.model.positions import Positions, make_positions

if TYPE_CHECKING:
    from lmcli.model.kv_cache import KVCache

Sublayer = Callable[[Tensor], Tensor]


# ----------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """Root-mean-square norm: x / rms(x) * weight (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


class RMSNorm1p(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in float32 and rounded back once (Gemma's): the
    weight starts at zero."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def multiplier(self) -> Tensor:
        """What the normalized rows are multiplied by: 1 + weight, in float32."""
        return 1.0 + self.weight.float()

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.multiplier()).type_as(x)


NORMS: dict[str, Callable[[int, ModelConfig], nn.Module]] = {  # (width, config) -> norm
    "layernorm": lambda dim, cfg: nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias),
    "rmsnorm": lambda dim, cfg: RMSNorm(dim, cfg.norm_eps),
    "rmsnorm1p": lambda dim, cfg: RMSNorm1p(dim, cfg.norm_eps),
}


class PreNorm:
    """Each sublayer reads a normalized copy of the residual stream (GPT-2); a final norm follows."""

    final_norm = True

    @staticmethod
    def residual(
        x: Tensor, attn: Sublayer, mlp: Sublayer, norm_1: Sublayer, norm_2: Sublayer, *post: Sublayer
    ) -> Tensor:
        x = x + attn(norm_1(x))
        return x + mlp(norm_2(x))


class PostNorm:
    """Each sublayer's sum with its input is normalized (the original Transformer)."""

    final_norm = False

    @staticmethod
    def residual(
        x: Tensor, attn: Sublayer, mlp: Sublayer, norm_1: Sublayer, norm_2: Sublayer, *post: Sublayer
    ) -> Tensor:
        x = norm_1(x + attn(x))
        return norm_2(x + mlp(x))


class SandwichNorm:
    """Pre-norm whose sublayer outputs are normalized too, before the residual sum (Gemma 2/3):
    ``post`` holds those two norms."""

    final_norm = True

    @staticmethod
    def residual(
        x: Tensor, attn: Sublayer, mlp: Sublayer, norm_1: Sublayer, norm_2: Sublayer, *post: Sublayer
    ) -> Tensor:
        post_1, post_2 = post
        x = x + post_1(attn(norm_1(x)))
        return x + post_2(mlp(norm_2(x)))


PLACEMENTS: dict[str, type[PreNorm] | type[PostNorm] | type[SandwichNorm]] = {
    "pre": PreNorm,
    "post": PostNorm,
    "sandwich": SandwichNorm,
}


# ----------------------------------------------------------------------------- attention


@dataclass
class Context:
    """What every layer's attention needs to know about the current forward."""

    pos: Tensor  # (B or 1, T) position ids of the new tokens
    # bool or additive (B or 1, 1 or H, T, S), or FlexAttention's BlockMask (packed documents on a
    # GPU, lmcli.model.documents); None: no mask beyond is_causal
    mask: Any
    is_causal: bool  # let SDPA apply plain causality itself
    cache: KVCache | None
    positions: Positions
    local_mask: Any = None  # the mask of sliding-window layers (``Transformer.local_mask``)
    local_is_causal: bool = False


def causal_mask(
    n_query: int, n_cached: int, start: Tensor | None, prefix_len: Tensor | None, device: torch.device
) -> Tensor:
    """Boolean mask (B or 1, 1, T, S), True where query column may attend to key column.

    Causal, minus left padding (columns before ``start[b]``), plus bidirectional attention among
    the first ``prefix_len[b]`` columns (prefix LM). Every query may see itself, so padded rows
    stay finite.
    """
    q = torch.arange(n_cached, n_cached + n_query, device=device)[:, None]  # (T, 1)
    k = torch.arange(n_cached + n_query, device=device)[None, :]  # (1, S)
    allowed = (k <= q)[None]  # (1, T, S)
    if prefix_len is not None:
        p = prefix_len.to(device)[:, None, None]  # (B, 1, 1)
        allowed = allowed | ((q[None] < p) & (k[None] < p))
    if start is not None:
        allowed = allowed & (k[None] >= start.to(device)[:, None, None])
        allowed = allowed | (k == q)[None]
    return allowed.unsqueeze(1)


class CausalSelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention through ``F.scaled_dot_product_attention``.

    With grouped-query attention (``n_kv_head < n_head``) each key/value head serves
    ``n_head / n_kv_head`` query heads; the KV cache holds only the key/value heads. A local layer
    (``cfg.is_local``) attends through the sliding window, with its own rotary base when the
    config gives one; a layer without rotary (``cfg.is_rotary``) turns nothing.
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # index into the KV cache
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.local, self.rotary = cfg.is_local(layer), cfg.is_rotary(layer)
        self.dropout = cfg.dropout
        self.scale = cfg.attn_scalar**-0.5 if cfg.attn_scalar else None  # None: SDPA's 1/sqrt(D)
        self.softcap = cfg.attn_softcap
        kv_width = cfg.n_kv_head * cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, cfg.q_width + 2 * kv_width, bias=cfg.attn_bias)  # q, k, v
        self.c_proj = nn.Linear(cfg.q_width, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # QK-norm: each head's queries and keys RMS-normalized (with a learned gain) before positions;
        # (1 + weight) RMSNorms when the model's norms are those
        qk_norm = "rmsnorm1p" if cfg.norm == "rmsnorm1p" else "rmsnorm"
        self.q_norm = NORMS[qk_norm](cfg.head_dim, cfg) if cfg.qk_norm else None
        self.k_norm = NORMS[qk_norm](cfg.head_dim, cfg) if cfg.qk_norm else None

    def split_heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C + 2 * KV * D) -> q (B, H, T, D), k and v (B, KV, T, D)."""
        B, T, _ = qkv.size()
        kv_width = self.n_kv_head * self.head_dim
        q, k, v = qkv.split([self.n_head * self.head_dim, kv_width, kv_width], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return q, k, v

    def share_heads(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Key/value heads repeated for their query heads: (B, KV, S, D) -> (B, H, S, D)."""
        if self.n_kv_head == self.n_head:
            return k, v
        group = self.n_head // self.n_kv_head
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def normalize_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """QK-norm of q (B, H, T, D) and k (B, KV, T, D) over D; unchanged without ``--qk-norm``."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        B, T, _ = x.size()
        q, k, v = self.split_heads(self.c_attn(x))
        q, k = self.normalize_qk(q, k)
        if self.rotary:
            q, k = ctx.positions.rotate(q, k, ctx.pos, local=self.local)
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer, k, v)  # (B, KV, S, D), S = cached + T
            k, v = k.to(q.dtype), v.to(q.dtype)  # a 16-bit cache (--kv-dtype) read in q's dtype
        k, v = self.share_heads(k, v)
        mask, is_causal = (ctx.local_mask, ctx.local_is_causal) if self.local else (ctx.mask, ctx.is_causal)
        dropout = self.dropout if self.training else 0.0
        if mask is not None and not isinstance(mask, Tensor):  # a BlockMask: FlexAttention
            y = flex_attention(q, k, v, mask)
        elif self.softcap:
            y = softcapped_attention(q, k, v, mask, is_causal, self.scale, self.softcap, dropout)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=self.scale
            )
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, H, T, D) -> (B, T, H * D)
        y = self.c_proj(y)
        return self.resid_dropout(y) if self.training else y


def softcapped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    cap: float,
    dropout: float,
) -> Tensor:
    """Attention of q (B, H, T, D) over k, v (B, H, S, D) whose scores are capped softly,
    cap * tanh(score / cap) (Gemma 2), before the mask; softmax in float32."""
    T, S = q.size(-2), k.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.size(-1) ** -0.5)  # (B, H, T, S)
    scores = torch.tanh(scores / cap) * cap
    if is_causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = F.dropout(scores.float().softmax(-1).to(q.dtype), dropout)
    return weights @ v


def window_mask(
    mask: Any, is_causal: bool, T: int, n_cached: int, window: int, device: torch.device
) -> Tensor:
    """``mask`` (None with ``is_causal``, boolean or additive (B or 1, 1 or H, T, S)) narrowed to
    the sliding window: query column q sees key column k only when q - k < ``window``."""
    q = torch.arange(n_cached, n_cached + T, device=device)[:, None]  # (T, 1)
    k = torch.arange(n_cached + T, device=device)[None, :]  # (1, S)
    near = q - k < window  # (T, S)
    if mask is None:
        return ((k <= q) & near if is_causal or T > 1 else near)[None, None]  # (1, 1, T, S)
    if mask.dtype == torch.bool:
        return mask & near
    return mask.masked_fill(~near, float("-inf"))


# ----------------------------------------------------------------------------- MLPs


class MLP(nn.Module):
    """Position-wise feed-forward: up-projection, a nonlinearity (``hidden``), down-projection."""

    gated = False  # SwiGLU: a second up-projection gates the first

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_dim, bias=cfg.bias)
        self.c_gate = nn.Linear(cfg.n_embd, cfg.ffn_dim, bias=cfg.bias) if self.gated else None
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_proj(self.hidden(x, self.c_fc, self.c_gate))
        return self.dropout(h) if self.training else h

    def hidden(self, x: Tensor, up: Sublayer, gate: Sublayer | None) -> Tensor:
        """The hidden activations (.., ffn_dim) of ``x`` through the given up (and gate) projections."""
        raise NotImplementedError


class GeluMLP(MLP):
    """GELU with GPT-2's tanh approximation."""

    def hidden(self, x: Tensor, up: Sublayer, gate: Sublayer | None) -> Tensor:
        return F.gelu(up(x), approximate="tanh")


class ReluMLP(MLP):
    def hidden(self, x: Tensor, up: Sublayer, gate: Sublayer | None) -> Tensor:
        return F.relu(up(x))


class ReluSquaredMLP(MLP):
    """relu(x)^2 (So et al. 2021, Primer; the modded-nanoGPT speedrun)."""

    def hidden(self, x: Tensor, up: Sublayer, gate: Sublayer | None) -> Tensor:
        return F.relu(up(x)).square()


class SwiGLU(MLP):
    """silu(gate(x)) * up(x) (Shazeer 2020; Llama)."""

    gated = True

    def hidden(self, x: Tensor, up: Sublayer, gate: Sublayer | None) -> Tensor:
        assert gate is not None
        return F.silu(gate(x)) * up(x)


class GeGLU(MLP):
    """gelu(gate(x)) * up(x) with the tanh-approximate GELU (Shazeer 2020; Gemma)."""

    gated = True

    def hidden(self, x: Tensor, up: Sublayer, gate: Sublayer | None) -> Tensor:
        assert gate is not None
        return F.gelu(gate(x), approximate="tanh") * up(x)


MLPS: dict[str, type[MLP]] = {
    "gelu": GeluMLP,
    "relu": ReluMLP,
    "relu2": ReluSquaredMLP,
    "swiglu": SwiGLU,
    "geglu": GeGLU,
}


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    """Attention and MLP sublayers with residuals; norms placed before or after them."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.placement = PLACEMENTS[cfg.norm_placement]
        self.ln_1 = NORMS[cfg.norm](cfg.n_embd, cfg)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = NORMS[cfg.norm](cfg.n_embd, cfg)
        self.mlp = MLPS[cfg.mlp](cfg)
        # sandwich norms: the attention's and the MLP's outputs normalized as well
        self.post = (
            nn.ModuleList(NORMS[cfg.norm](cfg.n_embd, cfg) for _ in range(2))
            if cfg.norm_placement == "sandwich"
            else None
        )

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        post = () if self.post is None else tuple(self.post)
        return self.placement.residual(x, lambda h: self.attn(h, ctx), self.mlp, self.ln_1, self.ln_2, *post)


class Transformer(nn.Module):
    """Decoder-only Transformer language model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the tokenizer)")
        self.config = cfg
        # padded_vocab_size rows (vocab_size rounded up to --vocab-multiple); the rows past
        # vocab_size are never looked up, and forward drops their logits
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.positions = make_positions(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = (
            NORMS[cfg.norm](cfg.n_embd, cfg) if PLACEMENTS[cfg.norm_placement].final_norm else nn.Identity()
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # a one-token decoding step installed by lmcli.model.fastpath for an inference scope, else None
        self.fast_step: Callable[[Tensor, KVCache], Tensor] | None = None
        # the dtype a decoding command's KV cache holds (--kv-dtype), else None: the compute dtype
        self.kv_dtype: torch.dtype | None = None
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections, GPT-2 scaling (or zero)
                if cfg.zero_init:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights once, padded vocabulary rows included: what is stored);
        optionally without the embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel() + sum(p.numel() for p in self.positions.parameters())
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def forward(
        self,
        idx: Tensor,
        cache: KVCache | None = None,
        *,
        prefix_len: Tensor | None = None,
        last_only: bool = False,
        output_index: Tensor | None = None,
        document: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, V) for token ids ``idx`` (B, T); (B, 1, V) with ``last_only``; V is the
        logical vocabulary (``vocab_size``), never the padded rows.

        With a ``cache``, ``idx`` continues the cached columns and the cache advances by T.
        ``prefix_len`` (B,) makes the first columns attend to each other bidirectionally.
        ``output_index`` (N,) computes logits only at those flat positions of the (B * T) grid, as
        (N, V): the vocabulary projection is skipped for positions no loss reads (prompt, padding).
        ``document`` (B, T) numbers the documents packed in each row (training, no cache): each
        token attends only within its document, whose positions start at 0.
        """
        B, T = idx.size()
        n_cached = cache.length if cache is not None else 0
        limit = self.positions.max_len
        if limit is not None and n_cached + T > limit:
            raise ValueError(f"sequence of {n_cached + T} tokens exceeds the context {limit}")
        self.positions.reach(n_cached + T)  # the position tables as far as this forward goes
        if self.fast_step is not None and cache is not None and T == 1 and not self.training:
            if prefix_len is None and output_index is None:
                return self.fast_step(idx, cache)  # lmcli.model.fastpath: the same arithmetic, fewer calls
        if cache is not None:
            pos = cache.positions(T)  # (B or 1, T)
        elif document is not None:
            pos = document_positions(document)  # (B, T)
        else:
            pos = torch.arange(T, device=idx.device)[None, :]  # (1, T)
        x = self.embed(idx, pos)  # (B, T, C)
        if self.training:
            x = self.drop(x)
        # one mask per forward, in the dtype attention computes in (autocast's): no cast per layer
        mask, is_causal = self.attention_mask(
            T, cache, prefix_len, compute_dtype(idx.device, x.dtype), idx.device, document
        )
        ctx = Context(pos, mask, is_causal, cache, self.positions, mask, is_causal)
        if self.config.sliding_window:  # local layers see less than the whole context
            if prefix_len is not None and cache is not None and cache.ring is not None:
                raise ValueError("a prefix LM's prompt attends both ways: its cache keeps every column")
            ctx.local_mask, ctx.local_is_causal = self.local_mask(mask, is_causal, T, cache, idx.device)
        for block in self.h:
            x = block(x, ctx)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:, :]
        elif output_index is not None:
            x = x.reshape(B * T, -1).index_select(0, output_index)  # (B, T, C) -> (N, C)
        return self.cap_logits(self.vocab_logits(self.lm_head(self.ln_f(x))))

    def local_mask(
        self, mask: Any, is_causal: bool, T: int, cache: KVCache | None, device: torch.device
    ) -> tuple[Any, bool]:
        """The sliding-window layers' mask of a forward of T new tokens whose other layers' is
        ``mask`` (``is_causal``): the cache's ring's when it keeps only the window, else ``mask``
        narrowed to the window once the sequence is longer than it."""
        ring = cache.window_mask(T) if cache is not None else None
        if ring is not None:
            return ring, False
        n_cached = cache.length if cache is not None else 0
        if n_cached + T <= self.config.sliding_window:
            return mask, is_causal
        return window_mask(mask, is_causal, T, n_cached, self.config.sliding_window, device), False

    def embed(self, idx: Tensor, pos: Tensor) -> Tensor:
        """The input of the first block (B, T, C): token embeddings (times sqrt(C) in the weights'
        dtype with ``--scale-embeddings``) and position embeddings."""
        x = self.wte(idx)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        return self.positions.embed(x, pos)

    def vocab_logits(self, logits: Tensor) -> Tensor:
        """The head's output (.., padded V) over the logical vocabulary (.., V): a view without
        the padded rows (the loss gives them no gradient, sampling never sees them)."""
        V = self.config.vocab_size
        return logits if logits.size(-1) == V else logits[..., :V]

    def cap_logits(self, logits: Tensor) -> Tensor:
        """cap * tanh(logits / cap) with ``--logit-softcap`` (Gemma 2), else the logits unchanged."""
        cap = self.config.logit_softcap
        if not cap:
            return logits
        return torch.tanh(logits / cap) * cap

    def attention_mask(
        self,
        T: int,
        cache: KVCache | None,
        prefix_len: Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        document: Tensor | None = None,
    ) -> tuple[Any, bool]:
        """The attention mask of a forward of T new tokens (or None) and whether SDPA should apply
        causality itself."""
        n_cached = cache.length if cache is not None else 0
        padded = cache is not None and cache.padding.has_padding
        scored = self.positions.biases_scores
        if document is not None:  # packed documents, each attending within itself
            if cache is not None or prefix_len is not None:
                raise ValueError("document ids are for training windows: no cache, no prefix")
            dropout = self.training and self.config.dropout > 0
            # (a FlexAttention BlockMask is not narrowed to a sliding window: the plain mask is)
            allowed = document_mask(document, plain=scored or dropout or bool(self.config.sliding_window))
            return (self.positions.bias(allowed, 0, dtype) if scored else allowed), False
        if not (scored or padded or prefix_len is not None):
            if T == 1 or n_cached == 0:
                return None, T > 1  # plain causal attention, or one query seeing all
            return causal_mask(T, n_cached, None, None, device), False
        if T == 1 and padded and not scored and prefix_len is None and n_cached >= cache.padding.max_start:
            # a decoding step: every filled column but each row's left padding (and itself)
            return cache.padding.bias(n_cached + 1, dtype), False
        start = cache.padding.start if padded else None
        allowed = causal_mask(T, n_cached, start, prefix_len, device)
        return (self.positions.bias(allowed, n_cached, dtype) if scored else allowed), False
