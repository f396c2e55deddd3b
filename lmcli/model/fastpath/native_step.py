"""Decoding steps of whole blocks in one native call each (``lmcli.model.native.layer``).

A block qualifies when every product of it is GGUF blocks the native kernels run (``--quantize
int8|int4``, a GGUF file as stored), its norms are RMSNorms in float32 placed before the sublayers
(or sandwiched), its attention is plain (no soft-capping) and its MLP gated (SwiGLU, GeGLU). Its
step is then one call instead of ~45 torch operations of a few microseconds each, which on a
small model cost as much as the products themselves. Others take ``LayerStep`` (cpu.py), and so
does a qualifying block in any step the call cannot serve (padded rows, a sliding window's mask or
ring, a float16 residual stream): ``StepRunner`` decides per step and per block.
``LMCLI_NATIVE_LAYER=0`` turns the one-call step off (the products stay native).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from lmcli.model.kv_cache import KVCache
from lmcli.model.native import layer as native_layer
from lmcli.model.native import ops
from lmcli.model.positions import Rotary
from lmcli.model.quant import BlockLinear, StackedBlockLinear
from lmcli.model.transformer import (
    Block,
    GeGLU,
    PreNorm,
    RMSNorm,
    RMSNorm1p,
    SandwichNorm,
    SwiGLU,
    Transformer,
)

ACTS = {SwiGLU: "silu", GeGLU: "gelu_tanh"}


def _multiplier(norm: nn.Module) -> Tensor | None:
    """The float32 vector an RMSNorm multiplies by (1 + w for Gemma's form), or None."""
    if type(norm) is RMSNorm and norm.weight.dtype == torch.float32:
        return norm.weight.detach().contiguous()
    if type(norm) is RMSNorm1p:
        return norm.multiplier().detach().contiguous()
    return None


def _bias(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def _product(module: nn.Module) -> native_layer.Product | None:
    if type(module) is not BlockLinear:
        return None
    return native_layer.Product(module.blocks, module.fmt, module.in_features, _bias(module.bias))


def _qkv(module: nn.Module) -> tuple[native_layer.Product, ...] | None:
    """The query/key/value products: one block layer, or a stack of parts (a GGUF file's q, k, v),
    the stack's bias cut into the parts' own."""
    single = _product(module)
    if single is not None:
        return (single,)
    if type(module) is not StackedBlockLinear or any(type(p) is not BlockLinear for p in module.parts):
        return None
    bias, at, parts = _bias(module.bias), 0, []
    for p in module.parts:
        cut = None if bias is None else bias[at : at + p.out_features]
        parts.append(native_layer.Product(p.blocks, p.fmt, p.in_features, cut))
        at += p.out_features
    return tuple(parts)


def native_block(block: Block) -> native_layer.NativeLayer | None:
    """``block``'s step as one native call, or None where the block does not qualify."""
    attn, mlp = block.attn, block.mlp
    if os.environ.get("LMCLI_NATIVE_LAYER", "1") == "0":  # (the per-operation step, for comparisons)
        return None
    if not ops.available() or block.placement not in (PreNorm, SandwichNorm) or type(mlp) not in ACTS:
        return None
    if attn.softcap or attn.n_head % attn.n_kv_head:
        return None
    norms = [_multiplier(block.ln_1), _multiplier(block.ln_2)]
    post = [_multiplier(n) for n in block.post] if block.post is not None else []
    qk = [_multiplier(attn.q_norm), _multiplier(attn.k_norm)] if attn.q_norm is not None else []
    products = [_product(m) for m in (attn.c_proj, mlp.c_gate, mlp.c_fc, mlp.c_proj)]
    qkv = _qkv(attn.c_attn)
    if qkv is None or any(t is None for t in [*norms, *post, *qk, *products]):
        return None
    eps = {n.eps for n in (block.ln_1, block.ln_2, *(block.post or ()))}
    if len(eps) != 1:
        return None
    D = attn.head_dim
    weights = native_layer.LayerWeights(
        heads=attn.n_head,
        kv_heads=attn.n_kv_head,
        head_dim=D,
        act=ACTS[type(mlp)],
        eps=eps.pop(),
        scale=attn.scale if attn.scale is not None else D**-0.5,
        norm_1=norms[0],
        norm_2=norms[1],
        qkv=qkv,
        out=products[0],
        gate=products[1],
        up=products[2],
        down=products[3],
        post=(post[0], post[1]) if post else None,
        qk_norm=(qk[0], qk[1]) if qk else None,
        qk_eps=attn.q_norm.eps if attn.q_norm is not None else 0.0,
    )
    return native_layer.NativeLayer(weights)


class NativeHead:
    """The vocabulary head's product (GGUF blocks) on a native step's threads."""

    def __init__(self, head: BlockLinear) -> None:
        self.product = ops.BoundProduct(head.blocks, head.fmt, head.in_features)
        self.bias = _bias(head.bias)

    def __call__(self, x: Tensor, threads: int) -> Tensor:
        """x (B, C) -> logits (B, V) float32."""
        y = self.product(x.to(torch.float32).contiguous(), threads)
        return y if self.bias is None else y + self.bias


def native_head(head: nn.Module) -> NativeHead | None:
    """The head of a model whose blocks step natively, when it is GGUF blocks too."""
    return NativeHead(head) if type(head) is BlockLinear and ops.available() else None


def _rotary(model: Transformer, positions: Tensor, local: bool) -> native_layer.RotaryRows | None:
    """The rotary table of global (or sliding-window) layers and the rows' positions (B,) in it,
    or None (no rotary table, or one not float32 or too short for the positions: the
    per-operation step's)."""
    rotary = model.positions
    if not isinstance(rotary, Rotary):
        return None
    cos, sin = rotary.table(local)
    if cos.dtype != torch.float32 or int(positions.max()) >= cos.size(0):
        return None
    return native_layer.RotaryRows(cos, sin, positions)


def native_step(
    model: Transformer, x: Tensor, cache: KVCache, first: native_layer.NativeLayer, threads: int | None = None
) -> native_layer.StepArgs | None:
    """The step's shared arguments, checked (``StepArgs.checked``), or None where this step cannot
    be native (ALiBi's scores, a row all padding, rows not float32, a cache laid out otherwise).
    ``threads``: the products' (default: torch's count)."""
    if x.dtype != torch.float32 or model.positions.biases_scores:
        return None
    B, column = x.size(0), cache.length
    if column + 1 > cache.max_len:
        raise ValueError(f"KV cache overflow: {column + 1} > {cache.max_len} columns")
    start = None
    if cache.padding.has_padding:
        start = cache.padding.start.to(torch.int64).contiguous()  # (B,)
        if start.shape != (B,) or int(start.max()) > column:  # (a row with no column of its own yet)
            return None
    cache.reserve(column + 1)
    k, v = cache.k, cache.v  # (layers, B, KV, columns, D)
    if k.dim() != 5 or k.size(0) == 0:
        return None
    positions = torch.full((B,), column, dtype=torch.int64) if start is None else column - start  # (B,)
    turn = _rotary(model, positions, False)
    turns = (turn, _rotary(model, positions, True) if model.config.sliding_window else turn)
    if isinstance(model.positions, Rotary) and (turns[0] is None or turns[1] is None):
        return None
    return native_layer.StepArgs.checked(
        first, B, k, v, column, start, turns, threads or torch.get_num_threads()
    )
