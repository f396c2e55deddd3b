"""A model's skeleton: its modules on the meta device (shapes, no storage), for checking a file
before reading it or for weights put in later.

torch's meta-device kernels for random initialization, ``torch.cat`` and arithmetic are
written in Python, and the first of them to run imports ``torch._dynamo`` (~70 MB resident, a
fifth of a 350 MB GGUF file's budget) in a process that never compiles. None of them runs for a
skeleton: within ``shapes_only`` initializers leave its values (never read) as they are and
meta tensors are joined by shape; position tables on the meta device are their shapes alone
(``Positions.table_shapes``).
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


class shapes_only(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch.device)
    """Within it, ``torch.nn.init`` leaves tensors as they are and ``torch.cat`` of meta tensors
    is computed from their shapes."""

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
        return func(*args, **kwargs)


def skeleton(cfg: ModelConfig) -> Transformer:
    """The Transformer of ``cfg`` on the meta device, its weights left uninitialized."""
    with torch.device("meta"), shapes_only():
        return Transformer(cfg)
