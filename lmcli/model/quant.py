"""Weight-only quantized inference: int8 and int4 linear layers swapped into a loaded model.

The model stays the one ``lmcli.model.transformer`` builds (gpt-fast's ``quantize.py`` is the pattern):
``quantize(model, "int8" | "int4", group_size)`` replaces its linear layers, and its token
embedding, by modules holding quantized weights with the same forward. Nothing else changes,
so every decoder, evaluation and the server run a quantized model as they run any other.

- **int8**: one scale per output channel (a row of the (out, in) weight), symmetric:
  ``w ~ s * q``, ``q`` in [-127, 127], ``s = max|w| / 127``.
- **int4**: groups of ``group_size`` inputs in each output channel, asymmetric, in the layout of
  torch's int4 kernels ("tinygemm"): ``w ~ (q - 8) * s + z``, ``q`` in [0, 15], ``z`` the group's
  value at ``q = 8``. A layer whose shape the kernels cannot take stays int8. The vocabulary head
  stays int8 in this mode: its error reaches every logit, and a tied model's head is also the
  token embedding, which is looked up row by row.
- **the token embedding**: int8 rows (a tied model's head and embedding share one int8 table),
  dequantized as they are looked up.

The products (docs/quantization.md has the measurements that chose them):

- on a CPU, torch's own packed kernels, ``aten._weight_int8pack_mm`` and
  ``aten._weight_int4pack_mm_for_cpu`` (AVX-512/AVX2 code in ATen). They are fast only for
  bfloat16 activations (20-50x slower for float32 or float16 ones), so the activations are
  rounded to bfloat16 for the product and its output returned in the model's dtype. For 48 rows
  or more (a prompt) the int8 weight is rather widened to bfloat16 for one GEMM, 2x faster;
- on CUDA, int8 is gpt-fast's ``F.linear(x, q.to(x.dtype)) * s`` and int4 torch's tinygemm
  kernel ``aten._weight_int4pack_mm`` (bfloat16, compute capability 8.0 or later). The CUDA
  paths follow torch's and gpt-fast's documented use; this project's machines have no GPU to
  run them on.

- on a CPU with lmcli's native kernels (``lmcli.model.native``, the default where they build),
  int8 is GGUF's q8_0 and int4 its q4_0 (blocks of 32 inputs, one fp16 scale each; int4 ignores
  ``group_size``), held as the block bytes a GGUF file stores (``BlockLinear``) and multiplied
  with int8 activations by integer dot products; the head and the embedding are q8_0 (a tied
  embedding looks its rows up in the head's blocks, ``BlockEmbedding``). A GGUF file's own
  matrices in any format the kernels run (``ops.FORMATS``: the q*_0/q*_1, the K-quants, iq4_nl,
  iq4_xs, mxfp4) load into the same layers as stored (``lmcli.formats.gguf.as_stored``).

``lmcli.model.fastpath``'s CPU scope leaves these modules alone (they are no ``nn.Linear``: nothing is
packed again) and its one-token step calls them as it calls a linear layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.config.commands import GROUP_SIZES
from lmcli.device import release_freed_memory
from lmcli.errors import LmcliError
from lmcli.model.native import ops
from lmcli.model.native.blocks import dequantize_blocks, quantize_blocks

MODES = ("none", "int8", "int4")
# torch 2.13's CPU int8 kernel reads past the end of inputs whose width is no multiple of 16 (it
# crashes): narrower or odd layers take the dequantizing product instead
INT8_KERNEL_K = 16
INT8_KERNEL_MAX_ROWS = 48  # from 64 rows on, dequantizing to bfloat16 and a GEMM is faster
CHUNK_VALUES = 1 << 20  # values of a weight quantized at a time, whole rows (the float32 temporaries')
BLOCK = 32  # values of a q8_0/q4_0 block: the widths the native kernels take from --quantize
# from this many rows on (a prompt) a block layer's weight is rather dequantized to bfloat16 by the
# kernels, a slice at a time, for torch's bfloat16 GEMM: 2-4x faster than the kernels' integer
# rows from 32 rows to 256 (faster from 24 on; docs/native-kernels.md). Not from 24: bfloat16
# activations and outputs move a tiny model's logits more than the kernels' int8 activations do
# (a 40-token forward against its one-token steps: 6.5% of the largest logit, against the 2% that
# tests/formats/test_window_families.py allows), so prompts up to 47 tokens keep the integer rows,
# as torch's int8 product kept its kernel below 48 rows.
BLOCK_GEMM_ROWS = 48


# ----------------------------------------------------------------------------- quantizing


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(q (N, K) int8, s (N,) float32) with ``w ~ q * s[:, None]``, one scale per output row;
    about ``CHUNK_VALUES`` values (whole rows) at a time, so the float32 temporaries stay small
    for a large table or a wide layer."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(w.size(0), dtype=torch.float32, device=w.device)
    n = max(1, CHUNK_VALUES // max(w.size(1), 1))  # rows a chunk
    for i in range(0, w.size(0), n):
        rows = w[i : i + n].detach().to(torch.float32, copy=True)  # (the weight itself untouched)
        scale = (rows.abs().amax(dim=1) / 127).clamp_min(1e-12)
        q[i : i + n] = rows.div_(scale[:, None]).round_().clamp_(-127, 127)
        s[i : i + n] = scale
    return q, s


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q (N, K) int32 in [0, 15], s (N, K/g), z (N, K/g)) with ``w ~ (q - 8) * s + z`` per group."""
    N, K = w.shape
    groups = w.detach().float().reshape(N, K // group_size, group_size)  # (N, K) -> (N, G, g)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    s = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((groups - low) / s).clamp_(0, 15).to(torch.int32).reshape(N, K)
    z = low + 8 * s
    return q, s.reshape(N, -1), z.reshape(N, -1)


def int4_fits(module: nn.Linear, group_size: int) -> bool:
    """True when the int4 kernels take this layer's shape (on a CPU and on CUDA)."""
    K, N = module.in_features, module.out_features
    return K % group_size == 0 and K % 32 == 0 and N % 16 == 0  # N: the CPU packing's; CUDA's is 8


def _cuda_tiles(K: int) -> int:
    """tinygemm's inner k-tiles for K inputs (K must be a multiple of 16 times it)."""
    return next(t for t in (8, 4, 2) if K % (16 * t) == 0)


# ----------------------------------------------------------------------------- the modules


def _bias(module: nn.Linear) -> Tensor | None:
    return None if module.bias is None else module.bias.detach()


class QuantLinear(nn.Module):
    """A linear layer with quantized weights: ``y = x @ W.T + b``, W held quantized."""

    bits = 0

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype  # the dtype the layer was loaded in (its outputs')
        self.register_buffer("bias", bias, persistent=False)

    def product(self, x: Tensor) -> Tensor:
        """x (M, K) @ W.T (K, N) -> (M, N), without the bias."""
        raise NotImplementedError

    def dequantized(self) -> Tensor:
        """The weight (N, K) the quantized one stands for, in float32."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        y = self.product(x.reshape(-1, self.in_features)).to(x.dtype)  # (.., K) -> (M, K) -> (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class Int8Linear(QuantLinear):
    """int8 weights with one scale per output channel."""

    bits = 8

    def __init__(self, module: nn.Linear, q: Tensor | None = None, s: Tensor | None = None) -> None:
        super().__init__(module.in_features, module.out_features, _bias(module), module.weight.dtype)
        if q is None or s is None:
            q, s = quantize_int8(module.weight)
        self.register_buffer("qweight", q, persistent=False)  # (N, K) int8
        self.register_buffer("scales", s, persistent=False)  # (N,) float32
        # the CPU kernel's scales, in its activations' dtype
        self.register_buffer("kernel_scales", s.to(torch.bfloat16), persistent=False)

    def product(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)  # gpt-fast's int8
        x = x.to(torch.bfloat16)
        if x.size(0) < INT8_KERNEL_MAX_ROWS and self.in_features % INT8_KERNEL_K == 0:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.kernel_scales)
        # many rows (a prompt): a bfloat16 copy of the weight and a GEMM, 2x faster than the kernel
        return F.linear(x, self.qweight.to(torch.bfloat16)) * self.kernel_scales

    def dequantized(self) -> Tensor:
        return self.qweight.float() * self.scales[:, None]


class Int4Linear(QuantLinear):
    """int4 weights in groups along the inputs, packed for torch's int4 kernels."""

    bits = 4

    def __init__(self, module: nn.Linear, group_size: int) -> None:
        super().__init__(module.in_features, module.out_features, _bias(module), module.weight.dtype)
        self.group_size = group_size
        q, s, z = quantize_int4(module.weight, group_size)
        device = module.weight.device
        # (N, G) scales and zeros -> (G, N, 2), the kernels' layout
        sz = torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:  # tinygemm: two 4-bit values per byte, then its tiled layout
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (N, K) -> (N, K/2)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _cuda_tiles(self.in_features))
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", sz, persistent=False)

    def product(self, x: Tensor) -> Tensor:
        x = x.to(torch.bfloat16)
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group_size, self.scales_zeros
            )
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_zeros)

    def dequantized(self) -> Tensor:
        """Read back through the kernel: eye (K, K) @ W.T, in float32 on a CPU (exact there)."""
        eye = torch.eye(self.in_features, device=self.packed.device)
        if eye.device.type == "cpu":
            wt = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.packed, self.group_size, self.scales_zeros.float()
            )
        else:
            wt = self.product(eye)
        return wt.float().t().contiguous()


class Int8Embedding(nn.Module):
    """A token embedding held as int8 rows with one scale each, dequantized as they are looked up."""

    def __init__(self, q: Tensor, s: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("qweight", q, persistent=False)  # (V, C) int8
        self.register_buffer("scales", s, persistent=False)  # (V,)

    def forward(self, idx: Tensor) -> Tensor:
        rows = F.embedding(idx, self.qweight).to(self.dtype)  # (.., C)
        return rows * F.embedding(idx, self.scales[:, None]).to(self.dtype)  # times (.., 1)


class BlockLinear(QuantLinear):
    """Weights as GGUF blocks (a format of ``lmcli.model.native.ops.FORMATS``), multiplied by
    the native kernels: activations rounded to int8 per block, integer dot products (a prompt of
    ``BLOCK_GEMM_ROWS`` rows or more: the weight dequantized to bfloat16 by the kernels, a slice
    at a time, one torch GEMM a slice).

    ``blocks`` (out, row bytes) uint8 is the bytes a GGUF file stores (a view of a memory-mapped
    file, or ``quantize_blocks``'s output), so the layer takes the file's size. One row (decode)
    and many (a prompt) go through the same kernel (``threads``: how many share its rows).
    Without the kernels the weight is dequantized once, on first use, for torch's product."""

    def __init__(
        self,
        blocks: Tensor,
        fmt: str,
        in_features: int,
        bias: Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        checked = ops.check_blocks(blocks, fmt, in_features)
        super().__init__(in_features, blocks.size(0), bias, dtype)
        self.format = checked
        self.fmt, self.bits = fmt, 8 * self.format.block_bytes / self.format.block
        self.register_buffer("blocks", blocks, persistent=False)
        self._bound: ops.BoundProduct | None = None  # the kernel call for these blocks, made on first use
        self._float: Tensor | None = None  # the fallback's weight, made on first use

    @classmethod
    def quantized(cls, module: nn.Linear, fmt: str) -> BlockLinear:
        """``module`` with its weight rounded to ``fmt`` ("q8_0" or "q4_0") blocks."""
        return cls(
            quantize_blocks(module.weight, fmt), fmt, module.in_features, _bias(module), module.weight.dtype
        )

    def product(self, x: Tensor) -> Tensor:
        if not ops.available():
            if self._float is None:
                self._float = self.dequantized()
            return F.linear(x, self._float.to(x.dtype))
        if self._bound is None or self._bound.blocks is not self.blocks:  # new blocks: checked first
            self._bound = ops.BoundProduct(self.blocks, self.fmt, self.in_features)
            self.format = self._bound.format
        if x.size(0) >= BLOCK_GEMM_ROWS:  # a prompt: bfloat16 slices of the weight, a GEMM each
            # dequantized on this thread alone: the pool's workers, woken between torch's GEMMs,
            # would wait beside torch's spinning threads (2 threads, SmolLM2-135M shape, q4_0:
            # 256-token prompts at 486-826 tokens/s through the pool, 1089-1306 without)
            return self._bound.gemm(x, 1)
        return self._bound(x, self.threads(x.size(0)))

    def threads(self, rows: int) -> int:
        """The kernel's threads for ``rows`` activation rows: torch's count for a prompt, one for
        a decoding step, whose products (tens of µs) would wait on woken workers while torch's
        own threads spin on the other cores: on 2 threads a SmolLM2-shaped q8_0 step ran 2.3x
        slower than on 1, a Qwen2.5-shaped one 2.1x (bench_cpu_decode, 2026-11-26)."""
        return torch.get_num_threads() if rows > 1 else 1

    def dequantized(self) -> Tensor:
        return dequantize_blocks(self.blocks, self.fmt, self.in_features)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_bound": None}  # a copy (deepcopy, pickle) binds its own blocks

    def weight_rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` of the weight, float32 (ids.shape + (in,)): a block embedding's lookup, by
        the kernels where they run (gguf's values exactly; its numpy dequantize took ~80 us a
        q6_K row, a decoding step's every token), else by ``dequantize_blocks``."""
        if ops.available() and ids.device.type == "cpu":
            if self._bound is None or self._bound.blocks is not self.blocks:
                self._bound = ops.BoundProduct(self.blocks, self.fmt, self.in_features)
            return self._bound.rows(ids.reshape(-1)).reshape(*ids.shape, self.in_features)
        rows = self.blocks[ids.reshape(-1)]  # (len(ids), row bytes)
        return dequantize_blocks(rows, self.fmt, self.in_features).reshape(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class StackedBlockLinear(QuantLinear):
    """Output rows in parts of different block formats (a GGUF file's q, k and v as lmcli's one
    fused projection, v often in another format): the parts' products side by side."""

    def __init__(self, parts: list[BlockLinear], bias: Tensor | None = None) -> None:
        if len({p.in_features for p in parts}) != 1 or any(p.bias is not None for p in parts):
            raise LmcliError("stacked block layers need parts of one width and no bias of their own")
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias, parts[0].dtype)
        self.parts = nn.ModuleList(parts)

    def product(self, x: Tensor) -> Tensor:
        return torch.cat([p.product(x) for p in self.parts], -1)  # (M, out)

    def dequantized(self) -> Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


class BlockEmbedding(nn.Module):
    """A token embedding looked up in a BlockLinear's rows (a tied model's head, or a table kept
    as stored): each row dequantized as it is looked up, in ``dtype``."""

    def __init__(self, table: BlockLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, idx: Tensor) -> Tensor:
        return self.table.weight_rows(idx).to(self.dtype)  # (.., C)


# ----------------------------------------------------------------------------- the model


def quantize(model: nn.Module, mode: str, group_size: int = 64) -> nn.Module:
    """Swap ``model``'s linear layers and token embedding for quantized ones (in place; returns
    the model). ``mode``: ``none`` (nothing), ``int8`` or ``int4`` (groups of ``group_size``)."""
    if mode == "none":
        return model
    device = next(model.parameters()).device
    check_mode(mode, group_size, device)
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise LmcliError("the model is quantized already")
    native = device.type == "cpu" and ops.available()
    with torch.no_grad():
        for block in model.h:
            quantize_block(block, mode, group_size, native)
        release_freed_memory()  # the blocks' float weights, before the vocabulary's new table
        quantize_vocabulary(model, native)
    release_freed_memory()
    return model


def check_mode(mode: str, group_size: int, device: torch.device) -> None:
    """One line unless ``mode`` (int8, int4) with ``group_size`` runs on ``device``."""
    if mode not in MODES:
        raise LmcliError(f"invalid quantization {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise LmcliError(f"group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if mode == "int4" and device.type not in ("cpu", "cuda"):
        raise LmcliError(f"--quantize int4 runs on a CPU or CUDA, not on {device.type}: use int8")
    if mode == "int4" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise LmcliError("--quantize int4 on CUDA needs a GPU of compute capability 8.0 or later (Ampere)")


def quantize_block(block: nn.Module, mode: str, group_size: int, native: bool) -> None:
    """A Transformer block's linear layers swapped for quantized ones (in place): each float
    weight is dropped as its quantized layer takes its place."""
    for parent in (block.attn, block.mlp):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, _quantized(child, mode, group_size, native))


def _quantized(child: nn.Linear, mode: str, group_size: int, native: bool) -> QuantLinear:
    """``child`` quantized: GGUF blocks for the native kernels (q8_0 for int8, q4_0 for int4,
    where the width is whole blocks of 32), else torch's int8/int4 layouts."""
    if native and child.in_features % BLOCK == 0:
        return BlockLinear.quantized(child, "q8_0" if mode == "int8" else "q4_0")
    int4 = mode == "int4" and int4_fits(child, group_size)
    return Int4Linear(child, group_size) if int4 else Int8Linear(child)


def quantize_vocabulary(model: nn.Module, native: bool) -> None:
    """The head and the token embedding as int8 (q8_0 blocks for the native kernels), one table
    when they are tied."""
    head, wte = model.lm_head, model.wte
    dtype = wte.weight.dtype
    if native and head.in_features % BLOCK == 0:
        model.lm_head = BlockLinear.quantized(head, "q8_0")
        w = wte.weight
        table = (
            model.lm_head if head.weight is w else BlockLinear(quantize_blocks(w, "q8_0"), "q8_0", w.size(1))
        )
        model.wte = BlockEmbedding(table, dtype)
        return
    if head.weight is wte.weight:
        q, s = quantize_int8(head.weight)
        model.lm_head = Int8Linear(head, q, s)
    else:
        model.lm_head = Int8Linear(head)
        q, s = quantize_int8(wte.weight)
    model.wte = Int8Embedding(q, s, dtype)


def products_line(model: nn.Module) -> str:
    """One line naming the path ``model``'s products take (``--verbose``): the native kernels'
    line (``ops.backend_line``) for GGUF blocks, torch's int8/int4 kernels, or float weights."""
    modules = list(model.modules())
    blocks = sorted({m.fmt for m in modules if isinstance(m, BlockLinear)})
    if blocks:
        return f"{ops.backend_line()}; blocks {', '.join(blocks)}"
    device = next(model.parameters(), torch.empty(0)).device.type
    torch_quant = sorted({f"int{m.bits}" for m in modules if isinstance(m, (Int8Linear, Int4Linear))})
    if torch_quant:
        return f"quantized products: torch ({', '.join(torch_quant)} kernels on {device})"
    return f"products: torch (float weights on {device}; no quantized layer)"


def default_kv_dtype(model: nn.Module) -> torch.dtype | None:
    """``--kv-dtype auto``'s dtype for ``model``: float16 where GGUF blocks run on the native
    kernels (their one-call decoding step reads a half cache with F16C, +0-5% tokens/s at 256-384
    columns, and halves its memory; llama.cpp's default), else None (the dtype it computes in)."""
    blocks = any(isinstance(m, BlockLinear) for m in model.modules())
    on_cpu = next(model.parameters(), torch.empty(0)).device.type == "cpu"
    return torch.float16 if blocks and on_cpu and ops.available() else None


def quantized_elements(model: nn.Module) -> int:
    """Weights held quantized (counted as parameters would be), 0 for a float model."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    parts = {id(p) for m in layers if isinstance(m, StackedBlockLinear) for p in m.parts}
    return sum(m.in_features * m.out_features for m in layers if id(m) not in parts)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: parameters and the quantized modules' buffers (once each)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())
