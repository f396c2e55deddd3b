"""The decoder-only Transformer: embeddings, positions, masked self-attention, MLP, norms.

``Transformer.forward(idx, cache=None) -> logits``; no loss and no I/O live here. The default
configuration is GPT-2's architecture (learned positions, pre-LayerNorm, tanh-GELU, tied head).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.config import ModelConfig
from lmcli.kv_cache import KVCache
from lmcli.packed import LinearFn, PackableLinear, PackCache


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

    def __init__(self, cfg: ModelConfig, layer: int, packs: PackCache) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = PackableLinear(cfg.n_embd, 3 * cfg.n_embd, cfg.bias, packs)
        self.c_proj = PackableLinear(cfg.n_embd, cfg.n_embd, cfg.bias, packs)
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
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, H, T, D) -> (B, T, C)
        y = self.c_proj(y)
        return self.resid_dropout(y) if self.training else y


SQRT_8_OVER_PI = math.sqrt(8.0 / math.pi)
SIGMOID_GELU_MIN = 8192  # elements; below this, one op beats five whatever their speed


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's tanh-approximate GELU, 0.5 x (1 + tanh u) with u = sqrt(2/pi) (x + 0.044715 x^3).

    Without autograd on a CPU, for a large enough ``x``, it is computed as the equal
    x * sigmoid(2u), in place on one temporary: 1.5-2x faster there than ``F.gelu``'s tanh
    (outputs agree to float32 rounding).
    """
    if (
        torch.is_grad_enabled()
        or x.numel() < SIGMOID_GELU_MIN
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or torch.compiler.is_compiling()
    ):
        return F.gelu(x, approximate="tanh")
    t = x * x
    t.mul_(0.044715 * SQRT_8_OVER_PI).add_(SQRT_8_OVER_PI).mul_(x)  # 2u
    return torch.sigmoid_(t).mul_(x)


class MLP(nn.Module):
    """Position-wise feed-forward: GELU (tanh, as GPT-2), ReLU, or SwiGLU."""

    def __init__(self, cfg: ModelConfig, packs: PackCache) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.c_fc = PackableLinear(cfg.n_embd, cfg.ffn_dim, cfg.bias, packs)
        swiglu = cfg.mlp == "swiglu"
        self.c_gate = PackableLinear(cfg.n_embd, cfg.ffn_dim, cfg.bias, packs) if swiglu else None
        self.c_proj = PackableLinear(cfg.ffn_dim, cfg.n_embd, cfg.bias, packs)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.c_gate is not None:
            h = F.silu(self.c_gate(x)) * self.c_fc(x)
        elif self.kind == "relu":
            h = F.relu(self.c_fc(x))
        else:
            h = gelu_tanh(self.c_fc(x))
        h = self.c_proj(h)
        return self.dropout(h) if self.training else h


class Block(nn.Module):
    """Attention and MLP sublayers with residuals; norms before (pre) or after (post) them."""

    def __init__(self, cfg: ModelConfig, layer: int, packs: PackCache) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer, packs)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg, packs)

    def forward(self, x: Tensor, *attn_args: Any) -> Tensor:
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


# ----------------------------------------------------------------------------- decoding steps
# A decoding step (one token per row, eval mode) runs each layer through a ``LayerStep``: the
# layer's parameters gathered once per KV cache, then used in plain functional calls. It is the
# modules' arithmetic, op for op; on a CPU the module calls and attribute look-ups it skips
# would otherwise cost more than the arithmetic of a small model.

NormSpec = tuple[str, tuple[int, ...], Tensor | None, Tensor | None, float]


def norm_spec(norm: nn.Module) -> NormSpec:
    if isinstance(norm, nn.LayerNorm):
        return ("layer", tuple(norm.normalized_shape), norm.weight, norm.bias, norm.eps)
    if isinstance(norm, RMSNorm):
        return ("rms", (norm.weight.numel(),), norm.weight, None, norm.eps)
    return ("none", (), None, None, 0.0)  # nn.Identity (post-norm models have no final norm)


def apply_norm(spec: NormSpec, x: Tensor) -> Tensor:
    kind, shape, weight, bias, eps = spec
    if kind == "layer":
        return F.layer_norm(x, shape, weight, bias, eps)
    if kind == "rms":
        return F.rms_norm(x, shape, weight, eps)
    return x


@dataclass(frozen=True, slots=True)
class LayerStep:
    """One block's parameters, for ``Block.forward``'s arithmetic on x (B, C) without modules."""

    layer: int
    n_head: int
    pre_norm: bool
    mlp: str
    norm_1: NormSpec
    norm_2: NormSpec
    qkv: LinearFn
    attn_out: LinearFn
    fc: LinearFn
    gate: LinearFn | None
    mlp_out: LinearFn

    @classmethod
    def of(cls, block: Block, linear: Callable[[nn.Linear], LinearFn]) -> LayerStep:
        """The step of ``block``, its products made by ``linear`` (plain or packed weights)."""
        attn, mlp = block.attn, block.mlp
        return cls(
            attn.layer,
            attn.n_head,
            block.pre_norm,
            mlp.kind,
            norm_spec(block.ln_1),
            norm_spec(block.ln_2),
            linear(attn.c_attn),
            linear(attn.c_proj),
            linear(mlp.c_fc),
            linear(mlp.c_gate) if mlp.c_gate is not None else None,
            linear(mlp.c_proj),
        )

    def __call__(
        self, x: Tensor, pos: Tensor, mask: Tensor | None, rotary: Rotary | None, cache: KVCache
    ) -> Tensor:
        B, C = x.size()
        h = apply_norm(self.norm_1, x) if self.pre_norm else x
        qkv = self.qkv(h).view(B, 3, self.n_head, 1, C // self.n_head)
        q, k, v = qkv.unbind(1)  # (B, H, 1, D)
        if rotary is not None:
            q, k = rotary(q, pos), rotary(k, pos)
        k, v = cache.update(self.layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, 1, D)
        y = self.attn_out(y.view(B, C))
        if self.pre_norm:
            x = x + y
            return x + self._mlp(apply_norm(self.norm_2, x))
        x = apply_norm(self.norm_1, x + y)
        return apply_norm(self.norm_2, x + self._mlp(x))

    def _mlp(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.fc(x)
        elif self.mlp == "relu":
            h = F.relu(self.fc(x))
        else:
            h = gelu_tanh(self.fc(x))
        return self.mlp_out(h)


LAYOUT_MIN_WEIGHT = 1 << 18  # elements; smaller weights stay in cache, their layout hardly matters


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
        # packed copies of large weights for products without autograd on a CPU (lmcli.packed)
        self._packs = PackCache()
        self.h = nn.ModuleList(Block(cfg, i, self._packs) for i in range(cfg.n_layer))
        self.ln_f = make_norm(cfg) if cfg.norm_placement == "pre" else nn.Identity()
        self.lm_head = PackableLinear(cfg.n_embd, cfg.vocab_size, False, self._packs)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self._decode_layout: list[nn.Parameter] = []  # weights laid out for decoding (decode_layout)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # residual projections, GPT-2 scaling
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def decode_layout(self) -> None:
        """Keep large weights with more outputs than inputs transposed in memory, for decoding.

        ``nn.Linear`` stores a weight as (out, in). A decoding step multiplies it by one row per
        sequence, and for a wide weight (QKV and MLP up-projections, the vocabulary head) that
        product is faster when the weight's transpose is contiguous, the layout of GPT-2's
        ``Conv1D``: with MKL on this project's CPUs, 1.3-1.8x for one row, 1.1-1.2x for 40 rows.
        Only the order in memory changes, not a value; ``train()`` puts the (out, in) layout
        back, so training never sees it.
        """
        if self._decode_layout:
            return
        with torch.inference_mode(False), torch.no_grad():
            for w in self._wide_weights():
                w.data = w.data.t().contiguous().t()
                self._decode_layout.append(w)

    def _wide_weights(self) -> list[nn.Parameter]:
        found: dict[int, nn.Parameter] = {}
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.out_features > module.in_features:
                w = module.weight
                if w.numel() >= LAYOUT_MIN_WEIGHT and w.is_contiguous():
                    found.setdefault(id(w), w)
        return list(found.values())

    def train(self, mode: bool = True) -> Transformer:
        if mode:
            self._packs.clear()  # training changes the weights: no packed copy outlives it
        if mode and self._decode_layout:
            with torch.inference_mode(False), torch.no_grad():
                for w in self._decode_layout:
                    w.data = w.data.contiguous()
            self._decode_layout = []
        return super().train(mode)

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
            pos = cache.positions(T)  # (B or 1, T)
        else:
            pos = torch.arange(T, device=idx.device)[None, :]  # (1, T)

        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(pos)
        elif cfg.position == "sinusoidal":
            x = x + self.sinusoid[pos].to(x.dtype)
        if self.training:
            x = self.drop(x)

        mask, is_causal = self._mask(T, n_cached, cache, prefix_len, x.dtype, idx.device)
        if T == 1 and cache is not None and not self.training and output_mask is None:
            plan = cache.step_plan
            if plan is None or plan[0] is not self:
                plan = cache.step_plan = self._step_plan(B)
            x = x.view(B, -1)  # a decoding step: (B, C) through every LayerStep
            for layer in plan[1]:
                x = layer(x, pos, mask, self.rotary, cache)
            cache.advance(1)
            return plan[3](apply_norm(plan[2], x)).view(B, 1, -1)
        for block in self.h:
            x = block(x, pos, mask, is_causal, self.rotary, cache)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:, :]
        elif output_mask is not None:
            x = x[output_mask]  # (B, T, C) -> (N, C)
        return self.lm_head(self.ln_f(x))

    def _step_plan(self, rows: int) -> tuple[Transformer, list[LayerStep], NormSpec, LinearFn]:
        """What a decoding step of ``rows`` rows runs: every layer's step, the final norm and the
        vocabulary head, their large weights packed when that pays (``lmcli.packed``)."""

        def linear(module: nn.Linear) -> LinearFn:
            return self._packs.linear(module.weight, module.bias, rows)

        return self, [LayerStep.of(b, linear) for b in self.h], norm_spec(self.ln_f), linear(self.lm_head)

    def _mask(
        self,
        T: int,
        n_cached: int,
        cache: KVCache | None,
        prefix_len: Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[Tensor | None, bool]:
        """The attention mask of this forward (or None) and whether SDPA should apply causality."""
        cfg = self.config
        padded = cache is not None and cache.has_padding
        if cfg.position == "alibi" or padded or prefix_len is not None:
            if T == 1 and cfg.position != "alibi" and prefix_len is None and n_cached >= cache.max_start:
                # a decoding step: every filled column but each row's left padding (and itself)
                return cache.padding_bias(n_cached + 1), False
            mask = attention_mask(T, n_cached, cache.start if padded else None, prefix_len, device)
            if cfg.position == "alibi":
                mask = self._alibi_bias(T, n_cached, mask, dtype)
            return mask, False
        if T == 1 or cache is None or n_cached == 0:
            return None, T > 1  # plain causal attention, or one query seeing all
        return attention_mask(T, n_cached, None, None, device), False

    def _alibi_bias(self, T: int, n_cached: int, allowed: Tensor, dtype: torch.dtype) -> Tensor:
        """Float mask (B or 1, H, T, S): -slope * |distance|, -inf where not allowed."""
        q = torch.arange(n_cached, n_cached + T, device=allowed.device)[:, None]
        k = torch.arange(n_cached + T, device=allowed.device)[None, :]
        dist = (q - k).abs().to(dtype)  # (T, S)
        bias = -self.slopes.to(dtype)[:, None, None] * dist  # (H, T, S)
        return bias[None].masked_fill(~allowed, float("-inf"))
