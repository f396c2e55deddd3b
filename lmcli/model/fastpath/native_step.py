"""Decoding steps of whole blocks in one native call each (``lmcli.model.native.layer``).

A block qualifies when every product of it is GGUF blocks the native kernels run (``--quantize
int8|int4``, a GGUF file as stored) or a float weight (float32, bfloat16, float16: a Hugging Face
folder, a float GGUF file, an lmcli run), its norms are RMSNorms placed before the sublayers (or
sandwiched), its attention rotary or none (soft-capped or not, over a sliding window or not) and
its MLP gated (SwiGLU, GeGLU). Its step is then one call instead of ~45 torch operations of a few
microseconds each, which on a small model cost as much as the products themselves. The call
reads a sliding window's ring of the cache (``WindowRing``: column c in slot c % size) as it is,
skips each row's left padding and computes in float32 whatever the model's dtype (the residual
stream of a bfloat16 model is float32 between the native blocks, as llama.cpp keeps it). Other
blocks take ``LayerStep`` (cpu.py), and so does a step the call cannot serve (ALiBi's scores, a
cache on another device): ``StepRunner`` decides per step and per block.
``LMCLI_NATIVE_LAYER=0`` turns the one-call step off (the products stay native).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.model.fastpath.packed import PackingLinear
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
    if type(norm) is RMSNorm and norm.weight.is_floating_point():
        return norm.weight.detach().float().contiguous()
    if type(norm) is RMSNorm1p:
        return norm.multiplier().detach().contiguous()
    return None


def _bias(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def _float_weight(module: nn.Module) -> Tensor | None:
    """The weight of a linear layer the kernels multiply as it is (float32, bfloat16 or float16,
    (out, in) contiguous on the CPU), or None."""
    if type(module) not in (nn.Linear, PackingLinear):  # (a LoRA layer's product is its own)
        return None
    w = module.weight
    if w.dtype not in ops.TORCH_FLOATS or w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
        return None
    return w


def _product(module: nn.Module) -> native_layer.Product | None:
    if type(module) is BlockLinear:
        return native_layer.Product(module.blocks, module.fmt, module.in_features, _bias(module.bias))
    w = _float_weight(module)
    if w is None:
        return None
    blocks, fmt = ops.float_blocks(w)
    return native_layer.Product(blocks, fmt, module.in_features, _bias(module.bias))


def _qkv(module: nn.Module) -> tuple[native_layer.Product, ...] | None:
    """The query/key/value products: one layer, or a stack of block parts (a GGUF file's q, k, v),
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


def native_block(block: Block, window: int = 0) -> native_layer.NativeLayer | None:
    """``block``'s step as one native call, or None where the block does not qualify; ``window``:
    its sliding window (0: none)."""
    attn, mlp = block.attn, block.mlp
    if os.environ.get("LMCLI_NATIVE_LAYER", "1") == "0":  # (the per-operation step, for comparisons)
        return None
    if not ops.available() or block.placement not in (PreNorm, SandwichNorm) or type(mlp) not in ACTS:
        return None
    if attn.n_head % attn.n_kv_head:
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
        window=window if attn.local else 0,
        softcap=float(attn.softcap or 0.0),
    )
    return native_layer.NativeLayer(weights)


def native_blocks(model: Transformer) -> list[native_layer.NativeLayer | None]:
    """Each block's one-call step (``native_block``), None where it does not qualify."""
    return [native_block(block, model.config.sliding_window) for block in model.h]


def float_weights(natives: list[native_layer.NativeLayer | None]) -> list[Tensor]:
    """The float weights (float32, bfloat16, float16) the native blocks read as they are: they
    must keep their plain layout while the blocks step (a scope packs the others)."""
    found = {p.blocks.data_ptr(): p.blocks for p in _products(natives) if p.fmt in ops.FLOATS}
    return list(found.values())


def _products(natives: list[native_layer.NativeLayer | None]) -> list[native_layer.Product]:
    """Every product of the native blocks."""
    return [
        p
        for n in natives
        if n is not None
        for p in (*n.weights.qkv, n.weights.out, n.weights.gate, n.weights.up, n.weights.down)
    ]


def step_line(model: Transformer) -> str:
    """One line saying how many blocks decode in one native call each (``--verbose``), e.g.
    "native step: 18 of 18 layers (15 windowed)", the float weights' formats where the kernels
    multiply them, and why no block does where none does."""
    natives = native_blocks(model)
    n, local = sum(x is not None for x in natives), sum(x is not None and x.window > 0 for x in natives)
    floats = sorted({p.fmt for p in _products(natives) if p.fmt in ops.FLOATS})
    notes = [f"{local} windowed"] if local else []
    notes += [f"{'/'.join(floats)} weights by the kernels, prompts by torch's GEMM"] if floats else []
    line = f"native step: {n} of {len(natives)} layers" + (f" ({'; '.join(notes)})" if notes else "")
    if n == 0:
        why = "off (LMCLI_NATIVE_LAYER=0)" if os.environ.get("LMCLI_NATIVE_LAYER") == "0" else None
        why = why or (None if ops.available() else "no native kernels")
        line += f": {why or 'their norms, MLP or products are not the kinds it runs'}"
    return line


class NativeHead:
    """The vocabulary head's product (GGUF blocks or a float weight) on a native step's threads,
    after the final norm in float32."""

    def __init__(
        self, product: ops.BoundProduct, bias: Tensor | None, norm: Callable[[Tensor], Tensor]
    ) -> None:
        self.product, self.bias, self.norm = product, bias, norm

    def __call__(self, x: Tensor, threads: int) -> Tensor:
        """x (B, C) float32, the last block's output -> logits (B, V) float32."""
        y = self.product(self.norm(x).contiguous(), threads)
        return y if self.bias is None else y + self.bias


def _final_norm(norm: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The final norm of float32 rows in float32 (an RMSNorm's, or none at all), or None."""
    if isinstance(norm, nn.Identity):
        return lambda x: x
    scale = _multiplier(norm)
    if scale is None:
        return None
    return lambda x: F.rms_norm(x, (scale.numel(),), scale, norm.eps)


def native_head(model: Transformer) -> NativeHead | None:
    """The head of a model whose blocks step natively, when it is GGUF blocks or a float weight
    the kernels multiply as it is (a tied one: the token embedding's table) and its final norm
    an RMSNorm."""
    head, norm = model.lm_head, _final_norm(model.ln_f)
    if not ops.available() or norm is None:
        return None
    if type(head) is BlockLinear:
        return NativeHead(ops.BoundProduct(head.blocks, head.fmt, head.in_features), _bias(head.bias), norm)
    w = _float_weight(head)
    if w is None:
        return None
    return NativeHead(ops.BoundProduct(*ops.float_blocks(w), head.in_features), _bias(head.bias), norm)


Table = tuple[Tensor, Tensor]  # cos, sin (N, D/2) float32


def rotary_tables(model: Transformer) -> tuple[Table, Table] | None:
    """The rotary tables of global and sliding-window layers in float32 (the model's own where
    they are float32, else a copy: a model cast to bfloat16 whole casts its tables too), or None
    without rotary positions."""
    if not isinstance(model.positions, Rotary):
        return None
    cos, sin = model.positions.table(False)
    cos_local, sin_local = model.positions.table(True)
    return (cos.float().contiguous(), sin.float().contiguous()), (
        cos_local.float().contiguous(),
        sin_local.float().contiguous(),
    )


def _rotary(table: Table, positions: Tensor) -> native_layer.RotaryRows | None:
    """A rotary table and the rows' positions (B,) in it, or None where it is too short for them
    (the per-operation step's)."""
    cos, sin = table
    if int(positions.max()) >= cos.size(0):
        return None
    return native_layer.RotaryRows(cos, sin, positions)


def native_step(
    model: Transformer,
    x: Tensor,
    cache: KVCache,
    first: native_layer.NativeLayer,
    threads: int | None = None,
    tables: tuple[Table, Table] | None = None,
) -> native_layer.StepArgs | None:
    """The step's shared arguments, checked (``StepArgs.checked``), or None where this step cannot
    be native (ALiBi's scores, rows or a cache not on the CPU, a cache laid out otherwise).
    ``threads``: the products' (default: torch's count); ``tables``: ``rotary_tables(model)``."""
    if not x.is_floating_point() or not x.is_cpu or model.positions.biases_scores:
        return None
    B, column = x.size(0), cache.length
    if column + 1 > cache.max_len:
        raise ValueError(f"KV cache overflow: {column + 1} > {cache.max_len} columns")
    start = None
    if cache.padding.has_padding:
        start = cache.padding.start.to(torch.int64).contiguous()  # (B,)
        if start.shape != (B,):
            return None
    cache.reserve(column + 1)
    k, v = cache.k, cache.v  # (layers, B, KV, columns, row)
    ring = None if cache.ring is None else (cache.ring.k, cache.ring.v)
    if k.dim() != 5 or not k.is_cpu:
        return None
    positions = torch.full((B,), column, dtype=torch.int64)  # (B,)
    if start is not None:
        positions = (column - start).clamp_min(0)  # (a row still all padding: position 0)
    turns: tuple[native_layer.RotaryRows | None, native_layer.RotaryRows | None] = (None, None)
    if isinstance(model.positions, Rotary):
        tables = tables or rotary_tables(model)
        assert tables is not None
        turns = (_rotary(tables[0], positions), _rotary(tables[1], positions))
        if turns[0] is None or turns[1] is None:
            return None
    return native_layer.StepArgs.checked(
        first, B, k, v, column, start, turns, threads or torch.get_num_threads(), ring, cache.fmt
    )
