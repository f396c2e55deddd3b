"""A model's skeleton: its modules on the meta device (shapes, no storage), for checking a file
before reading it or for weights put in later.

torch's meta-device kernels for random initialization, ``torch.cat`` and arithmetic are
written in Python, and the first of them to run imports ``torch._dynamo`` (~70 MB resident, a
fifth of a 350 MB GGUF file's budget) in a process that never compiles. None of them runs for a
skeleton: within ``shapes_only`` initializers leave its values (never read) as they are, meta
tensors are joined by shape and a meta tensor plus, minus or times a number (Gemma 3's norms
shifted by 1) is a meta tensor of its shape; position tables on the meta device are their shapes
alone (``Positions.table_shapes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lmcli.config.model import ModelConfig
from lmcli.model.transformer import Transformer


def _joined(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat`` of meta tensors by shape: the sizes along ``dim`` added, the others equal."""
    first = tensors[0]
    dim = dim % first.dim()
    for t in tensors[1:]:
        others = [(a, b) for i, (a, b) in enumerate(zip(t.shape, first.shape, strict=False)) if i != dim]
        if t.dim() != first.dim() or any(a != b for a, b in others):
            raise RuntimeError(f"torch.cat: sizes {tuple(first.shape)} and {tuple(t.shape)} do not join")
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.empty(shape, dtype=first.dtype, device="meta")


# a tensor and a number: the result has the tensor's shape (and the two's promoted dtype)
_WITH_A_NUMBER = {
    *(getattr(Tensor, f"__{op}__") for op in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv")),
    *(Tensor.add, Tensor.sub, Tensor.mul, Tensor.div, torch.add, torch.sub, torch.mul, torch.div),
}


def _with_a_number(args: Sequence[Any]) -> Tensor | None:
    """The meta result of a meta tensor and a number (``args`` of a ``_WITH_A_NUMBER``), else None."""
    if len(args) != 2 or not isinstance(args[0], Tensor) or not args[0].is_meta:
        return None
    if isinstance(args[1], bool) or not isinstance(args[1], int | float):
        return None
    return torch.empty(args[0].shape, dtype=torch.result_type(*args), device="meta")


class shapes_only(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch.device)
    """Within it, ``torch.nn.init`` leaves tensors as they are, and ``torch.cat`` of meta tensors
    and arithmetic of a meta tensor with a number are computed from their shapes."""

    def __torch_function__(
        self, func: Callable, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        if func is torch.cat:
            tensors = args[0] if args else kwargs["tensors"]
            if tensors and all(isinstance(t, Tensor) and t.is_meta for t in tensors):
                return _joined(tensors, *args[1:2], **{k: v for k, v in kwargs.items() if k == "dim"})
        if func in _WITH_A_NUMBER and not kwargs and (out := _with_a_number(args)) is not None:
            return out
        return func(*args, **kwargs)


def skeleton(cfg: ModelConfig) -> Transformer:
    """The Transformer of ``cfg`` on the meta device, its weights left uninitialized."""
    with torch.device("meta"), shapes_only():
        return Transformer(cfg)
