"""What quantizing a model cost: its next-token distributions against a reference model's, as
``llama-perplexity --kl-divergence`` reports them.

Both models read the same token windows (``perplexity.stream_windows``: the text as ``<bos>
text``, each token scored once); at every scored position:

- KL(reference || model) = sum_v p_ref(v) (log p_ref(v) - log p_model(v)), in nats, in float64;
- the top-1 agreement: whether both put their highest probability on the same token;
- each model's negative log-likelihood of the actual next token.

Reported: the mean, median, 90th and 99th percentiles and maximum of the per-token KL (the
percentiles interpolated linearly between sorted values, as llama-perplexity's are), the share of
positions whose top-1 tokens agree, both perplexities and their ratio PPL(model)/PPL(reference).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.data.corpus import batched
from lmcli.data.windows import IGNORE
from lmcli.errors import LmcliError
from lmcli.eval.perplexity import stream_windows, window_batch
from lmcli.model import fastpath
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer, split_pieces

POSITIONS = 128  # positions whose float64 distributions are computed at a time


@dataclass
class Divergence:
    """The per-token divergences and the totals of one comparison."""

    kld: list[np.ndarray] = field(default_factory=list)  # per scored token, in pieces
    agree: int = 0  # positions whose top-1 tokens agree
    nll: float = 0.0  # the model's total NLL of the actual tokens
    nll_reference: float = 0.0

    @property
    def values(self) -> np.ndarray:
        return np.concatenate(self.kld) if self.kld else np.zeros(0)

    def report(self) -> dict[str, float | int]:
        kld = self.values
        n = len(kld)
        if n == 0:
            raise LmcliError("text is too short: at least one token is needed after <bos>")
        ppl, ppl_ref = np.exp(self.nll / n), np.exp(self.nll_reference / n)
        return {
            "tokens": n,
            "kld_mean": float(kld.mean()),
            "kld_median": float(np.median(kld)),
            "kld_p90": float(np.percentile(kld, 90)),
            "kld_p99": float(np.percentile(kld, 99)),
            "kld_max": float(kld.max()),
            "top1_agreement": self.agree / n,
            "perplexity": float(ppl),
            "reference_perplexity": float(ppl_ref),
            "perplexity_ratio": float(ppl / ppl_ref),
        }


def compare(logits: Tensor, reference: Tensor, targets: Tensor, out: Divergence) -> None:
    """Add the positions of (N, V) ``logits`` and ``reference`` logits (targets (N,)) to ``out``."""
    for start in range(0, logits.size(0), POSITIONS):
        lp = F.log_softmax(logits[start : start + POSITIONS].double(), -1)  # (n, V)
        lq = F.log_softmax(reference[start : start + POSITIONS].double(), -1)
        y = targets[start : start + POSITIONS]
        kld = (lq.exp() * (lq - lp)).sum(-1).clamp_min(0)  # (n,): rounding may dip below 0
        out.kld.append(kld.cpu().numpy())
        out.agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        out.nll -= float(lp.gather(1, y[:, None]).sum())
        out.nll_reference -= float(lq.gather(1, y[:, None]).sum())


@fastpath.scoped
@torch.inference_mode()
def divergence(
    model: Transformer,
    reference: Transformer,
    chunks: Iterable[list[int]],
    context: int,
    stride: int,
    batch_size: int = 8,
) -> Divergence:
    """The divergence of ``model`` from ``reference`` over ids arriving in chunks (the first id
    ``<bos>``), by sliding windows of ``context`` tokens every ``stride``."""
    for m in (model, reference):
        if context > m.config.block_size:
            raise LmcliError(f"context {context} exceeds the model's block size {m.config.block_size}")
    device = next(model.parameters()).device
    ref_device = next(reference.parameters()).device
    out = Divergence()
    for chunk in batched(stream_windows(chunks, context, stride), batch_size):
        x, y = window_batch(chunk)
        scored = (y != IGNORE).reshape(-1)
        logits = model(x.to(device)).float()  # (B, T, V): the logical vocabulary
        logits = logits.reshape(-1, logits.size(-1))
        ref = reference(x.to(ref_device)).float()
        ref = ref.reshape(-1, ref.size(-1)).to(logits.device)
        if ref.size(-1) != logits.size(-1):
            raise LmcliError(f"the reference has {ref.size(-1)} tokens, the model {logits.size(-1)}")
        index = scored.nonzero().squeeze(1).to(logits.device)
        compare(logits[index], ref[index], y.reshape(-1)[scored].to(logits.device), out)
    return out


def text_ids(tokenizer: Tokenizer, chunks: Iterable[str]) -> Iterator[list[int]]:
    """The ids of the text ``chunks`` make up as perplexity reads it: ``<bos>`` first where the
    tokenizer puts one, then the text in the token cache's pieces."""
    if tokenizer.add_bos:
        yield [tokenizer.bos_id]
    for chunk in chunks:
        for piece in split_pieces(chunk):
            yield tokenizer.encode(piece)
