"""CPU inference fast paths, active inside ``with inference(model):`` and nowhere else.

A scope gives the model, until it ends:

- **packed weights** for products of a few rows or more (``lmcli.model.fastpath.packed``): its linear
  layers become ``PackingLinear`` for the scope;
- **a decoding layout**: large weights with more outputs than inputs kept transposed in memory,
  the layout of GPT-2's ``Conv1D``, which makes one-row products 1.3-1.8x faster with MKL on
  this project's CPUs (1.1-1.2x for 40 rows); only the order in memory changes, never a value;
- **the tanh-GELU computed as x * sigmoid(2u)** on large tensors, 1.5-2x faster than
  ``F.gelu``'s tanh on a CPU (equal to float32 rounding);
- **one-token decoding steps** (``model.fast_step``): each layer's parameters gathered once
  into a ``LayerStep`` and used in plain functional calls. It is the modules' arithmetic (the
  same MLP ``hidden``, norm placement and position objects), without the module calls and
  attribute look-ups that would otherwise cost more than the arithmetic of a small model.

When the scope ends, every module gets its class back and every weight its (out, in) layout,
so training never sees any of it. Inside a scope the weights must not change (leave it to
train). Scopes nest; only the outermost one acts. On other devices a scope does nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.model.fastpath.native_step import (
    NativeHead,
    float_weights,
    native_blocks,
    native_head,
    native_step,
    rotary_tables,
)
from lmcli.model.fastpath.packed import (
    IN_PLACE_MIN_BYTES,
    PACK_MIN_WEIGHT,
    LinearFn,
    PackCache,
    PackingLinear,
    bf16_packing_available,
    packing_available,
)
from lmcli.model.lora import has_adapters
from lmcli.model.native.layer import NativeLayer
from lmcli.model.positions import Positions, Rotary, rotate_half
from lmcli.model.quant import quantized_elements
from lmcli.model.transformer import (
    CausalSelfAttention,
    GeluMLP,
    RMSNorm1p,
    Transformer,
    softcapped_attention,
)

if TYPE_CHECKING:
    from lmcli.model.kv_cache import KVCache

T = TypeVar("T")
LAYOUT_MIN_WEIGHT = 1 << 18  # elements; smaller weights stay in cache, their layout hardly matters
SIGMOID_GELU_MIN = 8192  # elements; below this, one op beats five whatever their speed
SQRT_8_OVER_PI = math.sqrt(8.0 / math.pi)  # 2 * sqrt(2 / pi)
ONE_THREAD_WORK = 1 << 25  # multiply-adds per step below which a step runs on one thread


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's tanh-approximate GELU, 0.5 x (1 + tanh u) with u = sqrt(2/pi) (x + 0.044715 x^3).

    Without autograd, for a large enough float32 ``x``, it is computed as the equal
    x * sigmoid(2u), in place on one temporary.
    """
    if torch.is_grad_enabled() or x.numel() < SIGMOID_GELU_MIN or x.dtype != torch.float32:
        return F.gelu(x, approximate="tanh")
    t = x * x
    t.mul_(0.044715 * SQRT_8_OVER_PI).add_(SQRT_8_OVER_PI).mul_(x)  # 2u
    return torch.sigmoid_(t).mul_(x)


class SigmoidGeluMLP(GeluMLP):
    """``GeluMLP`` with the GELU above (for an inference scope)."""

    def hidden(self, x: Tensor, up: Callable[[Tensor], Tensor], gate: object = None) -> Tensor:
        return gelu_tanh(up(x))


# ----------------------------------------------------------------------------- one-token steps

Norm = Callable[[Tensor], Tensor]
Rotate = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
Turn = Callable[[Tensor], Tensor]
Masks = tuple[Tensor | None, Tensor | None]  # a global and a sliding-window layer's mask
Turns = tuple[Turn | None, Turn | None]  # a global and a sliding-window layer's rotary turn


def functional_norm(norm: nn.Module) -> Norm:
    """``norm``'s arithmetic as a plain function of x (no module call)."""
    if isinstance(norm, nn.LayerNorm):
        return functools.partial(
            F.layer_norm,
            normalized_shape=norm.normalized_shape,
            weight=norm.weight,
            bias=norm.bias,
            eps=norm.eps,
        )
    if isinstance(norm, nn.Identity):  # post-norm models have no final norm
        return lambda x: x
    if isinstance(norm, RMSNorm1p):  # (1 + weight) computed once: on float32 rows, one fused op
        scale = norm.multiplier().detach().contiguous()
        fused = functools.partial(F.rms_norm, normalized_shape=(scale.numel(),), weight=scale, eps=norm.eps)
        return lambda x: fused(x) if x.dtype == torch.float32 else norm(x)
    return functools.partial(
        F.rms_norm, normalized_shape=(norm.weight.numel(),), weight=norm.weight, eps=norm.eps
    )


@dataclass(frozen=True, slots=True)
class LayerStep:
    """One block's parameters, for ``Block.forward``'s arithmetic on x (B, C) without modules."""

    layer: int
    heads: CausalSelfAttention  # its split_heads / share_heads (plain arithmetic on tensors)
    residual: Callable[..., Tensor]  # the block's norm placement
    hidden: Callable[..., Tensor]  # the block's MLP nonlinearity
    norm_1: Norm
    norm_2: Norm
    qkv: LinearFn
    attn_out: LinearFn
    fc: LinearFn
    gate: LinearFn | None
    mlp_out: LinearFn
    post: tuple[Norm, ...]  # sandwich norms of the sublayers' outputs, or none
    local: int  # 1: a sliding-window layer (its mask and rotary turn are the second of each pair)
    one_turn: bool  # rotary without QK-norm: queries and keys turned in one call

    def __call__(
        self, x: Tensor, pos: Tensor, masks: Masks, rotate: Rotate, cache: KVCache, turns: Turns
    ) -> Tensor:
        heads, mask, turn = self.heads, masks[self.local], turns[self.local]

        def attn(h: Tensor) -> Tensor:
            B = h.size(0)
            H, KV, D = heads.n_head, heads.n_kv_head, heads.head_dim
            qkv = self.qkv(h).view(B, H + 2 * KV, D)  # (B, H * D + 2 * KV * D) -> (B, heads, D)
            v = qkv[:, H + KV :].unsqueeze(2)  # (B, KV, 1, D)
            if turn is not None and self.one_turn:
                qk = turn(qkv[:, : H + KV])  # (B, H + KV, D)
                q, k = qk[:, :H].unsqueeze(2), qk[:, H:].unsqueeze(2)  # (B, H, 1, D), (B, KV, 1, D)
            else:
                q, k = heads.normalize_qk(qkv[:, :H].unsqueeze(2), qkv[:, H : H + KV].unsqueeze(2))
                if heads.rotary:
                    q, k = rotate(q, k, pos, local=heads.local)
            keys, values = cache.update(self.layer, k, v)  # (B, KV, S, D)
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # a 16-bit cache, read in q's dtype
            if heads.scale is None and not heads.softcap:
                y = grouped_attention(q, keys, values, mask)  # (B, KV, G, D)
            else:
                y = grouped_attention(q, keys, values, mask, heads.scale, heads.softcap)
            return self.attn_out(y.reshape(B, H * D))

        def mlp(h: Tensor) -> Tensor:
            return self.mlp_out(self.hidden(h, self.fc, self.gate))

        return self.residual(x, attn, mlp, self.norm_1, self.norm_2, *self.post)


def grouped_attention(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float | None = None, cap: float = 0.0
) -> Tensor:
    """One query per head, q (B, H, 1, D), against keys and values (B, KV, S, D): each key/value
    head's G = H / KV query heads attend as G rows of one head, so nothing is repeated (the
    model's ``share_heads`` copies every key and value G times). Returns (B, KV, G, D), which is
    (B, H, D) in head order."""
    B, H, _, D = q.size()
    KV = keys.size(1)
    G = H // KV
    if mask is not None and mask.size(1) != 1:  # a bias per head (ALiBi): (B or 1, H, 1, S)
        mask = mask.reshape(mask.size(0), KV, G, -1)  # -> (B or 1, KV, G, S)
    if cap:  # soft-capped scores (``--attn-softcap``): the model's own attention
        return softcapped_attention(q.reshape(B, KV, G, D), keys, values, mask, False, scale, cap, 0.0)
    if scale is None:
        return F.scaled_dot_product_attention(q.reshape(B, KV, G, D), keys, values, attn_mask=mask)
    return F.scaled_dot_product_attention(q.reshape(B, KV, G, D), keys, values, attn_mask=mask, scale=scale)


def rotary_turn(positions: Positions, pos: Tensor, dtype: torch.dtype, local: bool = False) -> Turn | None:
    """The rotary turn of one decoding step, for rows (B, N, D) of queries and keys at ``pos``
    (B or 1, 1): ``Rotary.rotate``'s arithmetic with its cos and sin looked up once per step
    instead of once per layer; None for other positions."""
    if not isinstance(positions, Rotary):
        return None
    cos, sin = positions.table(local)
    cos = cos[pos].to(dtype)  # (B or 1, 1, D/2)
    sin = sin[pos].to(dtype)
    return lambda x: rotate_half(x, cos, sin)


@dataclass(frozen=True)
class Plan:
    """A batch size's decoding step: each layer's ``LayerStep`` and its one-call native step
    (``native_step``; None where the block does not qualify), the final norm and the head."""

    layers: list[LayerStep]
    natives: list[NativeLayer | None]
    final_norm: Norm
    head: LinearFn
    native_head: NativeHead | None  # the final norm and head on the kernels' threads, for a native step

    @property
    def first_native(self) -> NativeLayer | None:
        return next((n for n in self.natives if n is not None), None)


def step_turns(model: Transformer, pos: Tensor, dtype: torch.dtype) -> Turns:
    """The rotary turns of one decoding step: a global layer's and a sliding-window layer's."""
    turn = rotary_turn(model.positions, pos, dtype)
    return turn, rotary_turn(model.positions, pos, dtype, local=True) if model.config.sliding_window else turn


class StepRunner:
    """``model.fast_step``: the logits (B, 1, V) of one new token per row, as ``forward`` gives."""

    def __init__(
        self,
        model: Transformer,
        packs: PackCache,
        natives: list[NativeLayer | None],
        head: NativeHead | None,
    ) -> None:
        """``natives``: each block's one-call native step (None where the block does not
        qualify); ``head``: the final norm and head for a native step, or None."""
        self.model, self.packs, self.natives, self.head = model, packs, natives, head
        self.tables = rotary_tables(model) if any(n is not None for n in natives) else None
        self.plans: dict[int, Plan] = {}  # by batch size
        self.kernel_threads: int | None = None  # the native step's threads while torch's are 1

    def _plan(self, rows: int) -> Plan:
        """Every layer's step for ``rows`` rows, the final norm and the head, large weights packed
        when that pays."""

        def linear(module: nn.Module) -> LinearFn:
            if not isinstance(module, nn.Linear):  # a quantized layer (lmcli.model.quant): its own product
                return module
            return self.packs.linear(module.weight, module.bias, rows)

        layers = []
        for block in self.model.h:
            attn, mlp = block.attn, block.mlp
            layers.append(
                LayerStep(
                    attn.layer,
                    attn,
                    block.placement.residual,
                    mlp.hidden,
                    functional_norm(block.ln_1),
                    functional_norm(block.ln_2),
                    linear(attn.c_attn),
                    linear(attn.c_proj),
                    linear(mlp.c_fc),
                    linear(mlp.c_gate) if mlp.c_gate is not None else None,
                    linear(mlp.c_proj),
                    () if block.post is None else tuple(functional_norm(n) for n in block.post),
                    int(attn.local),
                    attn.q_norm is None and attn.rotary,
                )
            )
        head = self.model.lm_head
        return Plan(layers, self.natives, functional_norm(self.model.ln_f), linear(head), self.head)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return _absent, ()  # a copied or pickled model leaves the scope's step behind

    def masks(self, cache: KVCache, dtype: torch.dtype, device: torch.device) -> Masks:
        """A global and a sliding-window layer's mask of a one-token step."""
        model = self.model
        mask, _ = model.attention_mask(1, cache, None, dtype, device)
        window = model.config.sliding_window
        return mask, model.local_mask(mask, False, 1, cache, device)[0] if window else mask

    def __call__(self, idx: Tensor, cache: KVCache) -> Tensor:
        model = self.model
        B = idx.size(0)
        plan = self.plans.get(B)
        if plan is None:
            plan = self.plans[B] = self._plan(B)
        pos = cache.positions(1)  # (B or 1, 1)
        x = model.embed(idx, pos).view(B, -1)  # (B, 1, C) -> (B, C)
        dtype = x.dtype  # (the native blocks' residual stream is float32 between them)
        first = plan.first_native
        native = None
        if first is not None:
            native = native_step(model, x, cache, first, self.kernel_threads, self.tables)
        masks: Masks | None = None  # (made once a step, for the first layer that is not native)
        turns: Turns | None = None
        for layer, block in zip(plan.layers, plan.natives, strict=True):
            if native is not None and block is not None:
                row = cache.index[layer.layer]
                ringed = row < 0  # a sliding-window layer's keys and values in the cache's ring
                if ringed:
                    row = cache.ring.slot[layer.layer]
                x = native.run(block, x, row, layer.local, layer.heads.rotary, ringed)
                continue
            x = x.to(dtype)
            masks = masks or self.masks(cache, dtype, idx.device)
            turns = turns or step_turns(model, pos, dtype)
            x = layer(x, pos, masks, model.positions.rotate, cache, turns)
        cache.advance(1)
        if native is not None and plan.native_head is not None:
            logits = plan.native_head(x.float(), native.threads).to(dtype)
        else:
            logits = plan.head(plan.final_norm(x.to(dtype)))
        return model.cap_logits(model.vocab_logits(logits)).view(B, 1, -1)


def _absent() -> None:
    return None


# ----------------------------------------------------------------------------- the scope


def _wide_weights(model: nn.Module, plain: set[int]) -> list[nn.Parameter]:
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features > module.in_features:
            w = module.weight
            # float32 only: the layout pays for MKL's float32 products; for another dtype the copy
            # made while laying out would only add to the memory of a large model
            big = w.numel() >= LAYOUT_MIN_WEIGHT and w.is_contiguous() and w.dtype == torch.float32
            if big and w.data_ptr() not in plain:
                found.setdefault(id(w), w)
    return list(found.values())


def _in_place_weights(model: Transformer, plain: set[int]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The weights to pack in place for a scope (``lmcli.model.fastpath.packed``): the large float32
    and bfloat16 weights of the linear layers, when they add up to ``IN_PLACE_MIN_BYTES``; and
    the float32 ones to multiply by oneDNN as they are: those the token embedding shares (a tied
    head, whose rows are looked up) and those the native step reads (their data pointers:
    ``plain``), which stay plain."""
    if not packing_available():
        return [], []
    dtypes = (torch.float32, torch.bfloat16) if bf16_packing_available() else (torch.float32,)
    shared = {id(p) for p in model.wte.parameters()}
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if type(module) is nn.Linear:
            w = module.weight
            if w.numel() >= PACK_MIN_WEIGHT and w.dtype in dtypes and w.is_contiguous():
                found.setdefault(id(w), w)
    native = [w for w in found.values() if w.data_ptr() in plain and w.dtype == torch.float32]
    weights = [w for w in found.values() if w.data_ptr() not in plain]
    if sum(w.numel() * w.element_size() for w in weights) < IN_PLACE_MIN_BYTES:
        return [], native
    # (a bfloat16 table gains nothing from oneDNN's plain-layout product here: MKL's is as fast)
    dense = [w for w in weights if id(w) in shared and w.dtype == torch.float32]
    return [w for w in weights if id(w) not in shared], dense + native


def _swap(module: nn.Module, cls: type) -> None:
    module.__class__ = cls


@contextmanager
def inference(model: Transformer) -> Iterator[Transformer]:
    """The CPU fast paths for ``model`` while the scope lasts (see the module docstring)."""
    if model.fast_step is not None or next(model.parameters()).device.type != "cpu" or has_adapters(model):
        yield model  # nested, not on a CPU, or LoRA adapters in training (the step reads plain weights)
        return
    packs = PackCache()
    natives = native_blocks(model)  # (the float weights they read stay plain: none is packed)
    head = native_head(model) if any(n is not None for n in natives) else None
    plain = {w.data_ptr() for w in float_weights(natives)}
    if head is not None:
        plain.add(head.product.ptr)
    packed, dense = _in_place_weights(model, plain)  # (before the linear layers change class)
    swapped: list[tuple[nn.Module, type]] = []
    for module in model.modules():
        if type(module) is nn.Linear:
            module._packs = packs
            swapped.append((module, nn.Linear))
            _swap(module, PackingLinear)
        elif type(module) is GeluMLP:
            swapped.append((module, GeluMLP))
            _swap(module, SigmoidGeluMLP)
    # a model packed in place keeps its other weights' layout (its tied vocabulary table among
    # them): the transposed copy would hold the largest weight twice while it is made
    laid_out = [] if packed or dense else _wide_weights(model, plain)
    try:  # (from here on, whatever fails, every weight gets its values and layout back)
        packs.pack_in_place(packed)
        packs.multiply_dense(dense)
        with torch.inference_mode(False), torch.no_grad():
            for w in laid_out:
                w.data = w.data.t().contiguous().t()  # (out, in) values, (in, out) order in memory
        model.fast_step = StepRunner(model, packs, natives, head)
        yield model
    finally:
        model.fast_step = None
        packs.unpack()
        with torch.inference_mode(False), torch.no_grad():
            for w in laid_out:
                w.data = w.data.contiguous()
        for module, cls in swapped:
            _swap(module, cls)
            module.__dict__.pop("_packs", None)
        packs.clear()


def scoped(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn(model, ...)`` run inside ``inference(model)``."""

    @functools.wraps(fn)
    def run(model: Transformer, *args: Any, **kwargs: Any) -> T:
        with inference(model):
            return fn(model, *args, **kwargs)

    return run


@contextmanager
def step_threads(model: Transformer, rows: int, native: bool = True) -> Iterator[None]:
    """Run decoding steps of a small model, or one row's steps of a model whose blocks step
    natively, on one torch thread, then restore the thread count.

    A step of a small model is hundreds of operations of a few microseconds each; handing
    them to a second thread costs more than it saves, and much more when the other cores are
    busy (a worker that is not scheduled stalls every operation it takes part in). Large
    models, or many rows at once, keep every thread. A native step (``native_step``) of one
    row runs its products on the kernels' own threads, as many as torch had: torch's, left on,
    would spin beside them after each sampling operation (2 threads: 104 against 153 tokens/s
    a step of the SmolLM2-135M shape in q8_0, bench_cpu_decode's model, 2026-11-26). Rows
    that may be padded (a step the call leaves to torch), and ``native=False`` (a scope that
    also runs prompts: speculative decoding's checks), keep torch's threads.
    """
    threads = torch.get_num_threads()
    runner = model.fast_step
    native = native and rows == 1 and isinstance(runner, StepRunner)
    native = native and any(n is not None for n in runner.natives)
    small = (model.num_parameters() + quantized_elements(model)) * rows <= ONE_THREAD_WORK
    if threads == 1 or not (small or native) or next(model.parameters()).device.type != "cpu":
        yield
        return
    torch.set_num_threads(1)
    if native:
        runner.kernel_threads = threads
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if native:
            runner.kernel_threads = None
