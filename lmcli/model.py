"""The decoder-only Transformer: embeddings, positions, masked self-attention, MLP, norms.

``Transformer.forward(idx, cache=None) -> logits``; no loss and no I/O live here. The default
configuration is GPT-2's architecture (learned positions, pre-LayerNorm, tanh-GELU, tied head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.config import ModelConfig
from lmcli.kv_cache import KVCache


class RMSNorm(nn.Module):
    """Root-mean-square norm: x / rms(x) * weight (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.n_embd, cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


def sinusoidal_table(n_pos: int, dim: int) -> Tensor:
    """The fixed sin/cos position table of "Attention Is All You Need", (n_pos, dim)."""
    pos = torch.arange(n_pos, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : dim // 2]
    return table


def alibi_slopes(n_head: int) -> Tensor:
    """Per-head ALiBi slopes (Press et al.), geometric from 2^(-8/n); non-powers of 2 interleave."""

    def power_of_2(n: int) -> list[float]:
        first = 2.0 ** (-8.0 / n)
        return [first ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        return torch.tensor(power_of_2(n_head))
    closest = 2 ** math.floor(math.log2(n_head))
    extra = power_of_2(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(power_of_2(closest) + extra)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half layout, as in Llama)."""

    def __init__(self, head_dim: int, n_pos: int, base: float) -> None:
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv)  # (n_pos, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (n_pos, D)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        """Rotate x (B, H, T, D) by positions pos (B or 1, T)."""
        cos = self.cos[pos].unsqueeze(1).to(x.dtype)  # (B, 1, T, D)
        sin = self.sin[pos].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        rotary: Rotary | None,
        cache: KVCache | None,
    ) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, H, T, D)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if rotary is not None:
            q, k = rotary(q, pos), rotary(k, pos)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, H, S, D), S = cached + T
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, H, T, D) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: GELU (tanh, as GPT-2), ReLU, or SwiGLU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_dim, bias=cfg.bias)
        self.c_gate = nn.Linear(cfg.n_embd, cfg.ffn_dim, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.c_gate is not None:
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        elif self.kind == "relu":
            h = F.relu(self.c_fc(x))
        else:
            h = F.gelu(self.c_fc(x), approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Attention and MLP sublayers with residuals; norms before (pre) or after (post) them."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, *attn_args) -> Tensor:
        if self.pre_norm:
            x = x + self.attn(self.ln_1(x), *attn_args)
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.attn(x, *attn_args))
        return self.ln_2(x + self.mlp(x))


def attention_mask(
    n_query: int,
    n_cached: int,
    start: Tensor | None,
    prefix_len: Tensor | None,
    device: torch.device,
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


class Transformer(nn.Module):
    """Decoder-only Transformer language model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the tokenizer)")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.position == "learned" else None
        if cfg.position == "sinusoidal":
            self.register_buffer("sinusoid", sinusoidal_table(cfg.block_size, cfg.n_embd), persistent=False)
        self.rotary = Rotary(cfg.head_dim, cfg.block_size, cfg.rope_base) if cfg.position == "rope" else None
        if cfg.position == "alibi":
            self.register_buffer("slopes", alibi_slopes(cfg.n_head), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = make_norm(cfg) if cfg.norm_placement == "pre" else nn.Identity()
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections, GPT-2 scaling
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
        """Parameter count (tied weights once); optionally without the embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel()
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
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
        output_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, V) for token ids ``idx`` (B, T); (B, 1, V) with ``last_only``.

        With a ``cache``, ``idx`` continues the cached columns and the cache advances by T.
        ``prefix_len`` (B,) makes the first columns attend to each other bidirectionally.
        ``output_mask`` (B, T) bool computes logits only where it is True, as (N, V): the
        vocabulary projection is skipped for positions no loss reads (source, padding).
        """
        cfg = self.config
        B, T = idx.size()
        n_cached = cache.length if cache is not None else 0
        if n_cached + T > cfg.block_size and cfg.position != "alibi":
            raise ValueError(f"sequence of {n_cached + T} tokens exceeds the context {cfg.block_size}")
        if cache is not None:
            pos = cache.positions(T)  # (B, T)
        else:
            pos = torch.arange(T, device=idx.device)[None, :]  # (1, T)

        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(pos)
        elif cfg.position == "sinusoidal":
            x = x + self.sinusoid[pos].to(x.dtype)
        x = self.drop(x)

        padded = cache is not None and cache.has_padding
        start = cache.start if padded else None
        if cfg.position == "alibi" or padded or prefix_len is not None:
            mask = attention_mask(T, n_cached, start, prefix_len, idx.device)
            is_causal = False
            if cfg.position == "alibi":
                mask = self._alibi_bias(T, n_cached, mask, x.dtype)
        elif T == 1 or cache is None or n_cached == 0:
            mask, is_causal = None, T > 1  # plain causal attention, or one query seeing all
        else:
            mask, is_causal = attention_mask(T, n_cached, None, None, idx.device), False

        for block in self.h:
            x = block(x, pos, mask, is_causal, self.rotary, cache)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:, :]
        elif output_mask is not None:
            x = x[output_mask]  # (B, T, C) -> (N, C)
        return self.lm_head(self.ln_f(x))

    def _alibi_bias(self, T: int, n_cached: int, allowed: Tensor, dtype: torch.dtype) -> Tensor:
        """Float mask (B or 1, H, T, S): -slope * |distance|, -inf where not allowed."""
        q = torch.arange(n_cached, n_cached + T, device=allowed.device)[:, None]
        k = torch.arange(n_cached + T, device=allowed.device)[None, :]
        dist = (q - k).abs().to(dtype)  # (T, S)
        bias = -self.slopes.to(dtype)[:, None, None] * dist  # (H, T, S)
        return bias[None].masked_fill(~allowed, float("-inf"))
