"""Documents packed in a training window (``--document-mask``): each token attends only to the
tokens of its own document up to itself, and positions count from its document's start, so a
window of several documents computes for each what it would compute alone.

A window's documents are numbered (B, T) by the data (``lmcli.data.windows.document_ids``). On
a GPU the mask is a FlexAttention ``BlockMask``, whose blocks no document reaches are skipped;
elsewhere, and where attention needs what FlexAttention is not given here (dropout, a score
bias such as ALiBi), a boolean (B, 1, T, T) mask through ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor


def document_positions(document: Tensor) -> Tensor:
    """(B, T) the position of each token in its document (0 at each document's first token)."""
    B, T = document.size()
    t = torch.arange(T, device=document.device).expand(B, T)
    first = torch.ones_like(document, dtype=torch.bool)
    first[:, 1:] = document[:, 1:] != document[:, :-1]
    start = torch.where(first, t, 0).cummax(dim=1).values  # (B, T) where each token's document starts
    return t - start


def document_mask(document: Tensor, *, plain: bool) -> Any:
    """Where a query may attend: an earlier key of its own document. A FlexAttention ``BlockMask``
    on a GPU unless ``plain``; else a boolean tensor (B, 1, T, T)."""
    if document.is_cuda and not plain:
        return block_mask(document)
    T = document.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=document.device).tril()  # (T, T)
    return (causal & (document[:, :, None] == document[:, None, :])).unsqueeze(1)  # (B, 1, T, T)


def block_mask(document: Tensor) -> Any:
    """The same as a FlexAttention ``BlockMask`` (on any device: the tests compare the two)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (document[b, q] == document[b, k]) & (q >= k)

    B, T = document.size()
    return create_block_mask(same_document, B, None, T, T, device=document.device)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    """FlexAttention of q (B, H, T, D), k and v (B, H, S, D) under a ``BlockMask``: compiled on a
    GPU (uncompiled, it would materialize the scores), as it is elsewhere (tests)."""
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=block_mask)
    from torch.nn.attention.flex_attention import flex_attention as eager

    return eager(q, k, v, block_mask=block_mask)
