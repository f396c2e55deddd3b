"""Linear products with weights kept in oneDNN's packed layout, for CPU inference on a few rows.

``F.linear`` on a CPU calls MKL's sgemm, which re-packs the weight into its blocked layout at
every call. For the few rows of a decoding step (a beam search's inputs x beams) that packing is
a large share of the call. oneDNN can pack a weight once and keep it (the op ``torch.compile``
uses when it freezes a CPU model); on this project's 2-core CPU that makes the products of a
13.8M model 1.1-1.2x faster for 40 rows, 1.3-2x for 4-16 rows, and its 8000-token vocabulary
head 1.6x faster for 40 rows (``bench/bench_beam.py`` measures the whole beam search), and
prompts and evaluation batches of hundreds of rows 1.05-1.2x faster. For one row it is slower,
so only products of ``PACK_MIN_ROWS`` rows or more use it, and only for weights of
``PACK_MIN_WEIGHT`` elements or more (smaller ones stay in cache whatever their layout).

The packed copy costs the memory of the weights it packs; it is made again when the weight
changes (its version counter or storage moves). Anything but a float32 CPU weight, or a torch
without oneDNN, keeps ``F.linear``. The packed op has no autograd: ``PackingLinear`` uses it
only when autograd is off (``torch.no_grad``, ``inference_mode``), never while training.

**Large models are packed in place.** When a model's packable weights reach
``IN_PLACE_MIN_BYTES`` (they no longer fit in any cache, and a copy of them would be memory a
user feels: a 135M-parameter model in float32 would need 1.08 GB instead of 0.54), each one is
packed once when the scope starts (``pack_in_place``), float32 and bfloat16 alike, and the packed
copy *replaces* it for the scope: the parameter keeps its shape but no memory (a stand-in of one
element), every product of every row count uses the packed weight, and the scope's end puts
the plain weight back (``unpack``; oneDNN's ``to_dense`` gives it back exactly). A product that
needs the plain weight inside the scope (autograd, autocast) gets it from the packed copy. For a
one-row product this is 1.2-1.5x faster than MKL's float32 ``F.linear`` and 1.8-2x faster than
its bfloat16 one; for a 256-token prompt 2x (float32) on this project's CPU (AVX-512, bf16):
docs/quantization.md has the figures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.device import release_freed_memory

PACK_MIN_ROWS = 4  # rows per product from which packed weights are faster (see the docstring)
PACK_MIN_WEIGHT = 1 << 18  # elements
IN_PLACE_MIN_BYTES = 64 << 20  # packable weights from which a model is packed in place
IN_PLACE_ROWS = 256  # the row count oneDNN lays in-place packs out for (fast for 1 row too)
TRIM_EVERY = 8  # weights packed or unpacked between two returns of freed memory to the system

LinearFn = Callable[[Tensor], Tensor]


def packing_available() -> bool:
    """True when this torch build has oneDNN and its packed-linear ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def bf16_packing_available() -> bool:
    """True when oneDNN computes bfloat16 products natively on this CPU."""
    return packing_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear:
    """``F.linear(x, weight, bias)`` through a oneDNN-packed copy of ``weight``."""

    __slots__ = ("weight", "bias", "packed", "_version", "_ptr")

    def __init__(self, weight: Tensor, bias: Tensor | None, rows: int) -> None:
        self.weight, self.bias = weight, bias
        with torch.inference_mode(False), torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        self._version, self._ptr = weight._version, weight.data_ptr()

    def fresh(self, weight: Tensor, bias: Tensor | None) -> bool:
        """True while the pack still holds ``weight`` as it is now (and goes with ``bias``)."""
        return (
            weight is self.weight
            and bias is self.bias
            and weight._version == self._version
            and weight.data_ptr() == self._ptr
        )

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def plain_linear(weight: Tensor, bias: Tensor | None) -> LinearFn:
    """``F.linear`` with its parameters bound."""
    return lambda x: F.linear(x, weight, bias)


class PackCache:
    """The packed weights of one model, made on first use and remade when a weight changes, or
    (``pack_in_place``) made once, standing in for the weights until ``unpack``."""

    def __init__(self) -> None:
        self._packs: dict[int, PackedLinear] = {}
        self._available = packing_available()
        self._in_place: dict[int, PackedLinear] = {}  # by id(weight): the only copy of the weight
        self._dense: set[int] = set()  # ids of plain weights that oneDNN multiplies as they are

    def multiply_dense(self, weights: list[nn.Parameter]) -> None:
        """Let oneDNN multiply these weights in their plain layout until ``clear``: a large weight
        that must stay plain (a tied vocabulary table, whose rows are looked up) and so cannot be
        packed in place. oneDNN's product reads the plain float32 layout as it is, 1.6-2.3x
        faster than MKL's ``F.linear`` for 1 to 256 rows on this project's CPU (no copy is made)."""
        self._dense.update(id(w) for w in weights)

    def pack_in_place(self, weights: list[nn.Parameter]) -> None:
        """Pack each weight and let the packed copy replace it until ``unpack`` (see the module
        docstring); each weight stays plain only while it is being packed."""
        with torch.inference_mode(False), torch.no_grad():
            for i, w in enumerate(weights):
                pack = PackedLinear(w, None, IN_PLACE_ROWS)
                w.data = torch.empty(1, dtype=w.dtype).expand(w.shape)  # the shape, no memory
                self._in_place[id(w)] = pack
                if i % TRIM_EVERY == TRIM_EVERY - 1 or i == len(weights) - 1:
                    release_freed_memory()

    def unpack(self) -> None:
        """Give every weight ``pack_in_place`` replaced its plain values back."""
        packs = list(self._in_place.values())
        self._in_place.clear()
        with torch.inference_mode(False), torch.no_grad():
            for i in range(len(packs)):
                pack = packs.pop()  # each packed copy freed once its plain weight is back
                pack.weight.data = pack.packed.to_dense()
                del pack
                if i % TRIM_EVERY == TRIM_EVERY - 1 or not packs:
                    release_freed_memory()

    def in_place(self, weight: Tensor, bias: Tensor | None) -> LinearFn | None:
        """The product by an in-place packed (or densely multiplied) ``weight`` (and ``bias``),
        None for any other weight."""
        pack = self._in_place.get(id(weight))
        if pack is None and id(weight) not in self._dense:
            return None
        w = weight if pack is None else pack.packed
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")

    def dense(self, weight: Tensor) -> Tensor:
        """The plain values of ``weight`` (from its packed copy when it is packed in place)."""
        pack = self._in_place.get(id(weight))
        return weight if pack is None else pack.packed.to_dense()

    def worth_it(self, weight: Tensor, rows: int) -> bool:
        """True when a product of ``rows`` rows by ``weight`` (out, in) should use a packed copy."""
        return (
            self._available
            and rows >= PACK_MIN_ROWS
            and weight.numel() >= PACK_MIN_WEIGHT
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
        )

    def linear(self, weight: Tensor, bias: Tensor | None, rows: int) -> LinearFn:
        """A product by ``weight`` (and ``bias``) for inputs of about ``rows`` rows, without autograd."""
        in_place = self.in_place(weight, bias)
        if in_place is not None:
            return in_place
        return self.packed(weight, bias, rows) if self.worth_it(weight, rows) else plain_linear(weight, bias)

    def packed(self, weight: Tensor, bias: Tensor | None, rows: int) -> PackedLinear:
        """The packed product by ``weight``: the one made before while the weight is unchanged."""
        pack = self._packs.get(id(weight))
        if pack is None or not pack.fresh(weight, bias):
            pack = self._packs[id(weight)] = PackedLinear(weight, bias, rows)
        return pack

    def clear(self) -> None:
        self._packs.clear()
        self._in_place.clear()
        self._dense.clear()

    # packs are a cache of the weights: a copied or pickled model starts without them (oneDNN's
    # packed tensors can be neither copied nor saved)
    def __deepcopy__(self, memo: dict[int, object]) -> PackCache:
        return PackCache()

    def __getstate__(self) -> dict[str, object]:
        return {}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()

    def __len__(self) -> int:
        return len(self._packs)


class PackingLinear(nn.Linear):
    """``nn.Linear`` whose products without autograd may use a packed weight.

    ``lmcli.model.fastpath.cpu.inference`` gives a model's linear layers this class for the length of
    an inference scope (and their own back after it). Autograd, autocast, compiled graphs and
    inputs that are not float32 always take ``F.linear``.
    """

    _packs: PackCache

    def forward(self, x: Tensor) -> Tensor:
        in_place = self._packs.in_place(self.weight, self.bias)
        if in_place is not None:  # the packed copy is the weight for this scope
            if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
                return F.linear(x, self._packs.dense(self.weight), self.bias)
            return in_place(x)
        rows = x.numel() // self.in_features
        if (
            torch.is_grad_enabled()
            or x.dtype != torch.float32
            or not self._packs.worth_it(self.weight, rows)
            or torch.is_autocast_enabled("cpu")
            or torch.compiler.is_compiling()
        ):
            return F.linear(x, self.weight, self.bias)
        return self._packs.packed(self.weight, self.bias, rows)(x)
