"""How the model knows where a token is: one small object per position scheme.

Every scheme answers the same three questions, most of them with "nothing to do":

- ``embed(x, pos)``: what to add to the token embeddings (learned, sinusoidal);
- ``rotate(q, k, pos, local)``: how to turn queries and keys (rotary; ``local``: a sliding-window
  layer's, which may have its own base);
- ``bias(allowed, n_cached, dtype)``: what to add to the attention scores (ALiBi).

``pos`` holds position ids (B or 1, T): a row's column minus its left padding.

A scheme's fixed tables (rotary cos and sin, sinusoidal embeddings) cover the first
``TABLE_START`` positions when the model is built, and grow as a forward reaches past them
(``reach``, doubling, up to the context): a model of a 32k or 128k context that generates a few
hundred tokens holds tables of a thousand positions, not of its whole context (Gemma 3 270M's four
rotary tables of 32,768 positions: 67 MB, a quarter of its 253 MB Q4_K_M file). Each grown
table is computed whole again, on the CPU in float32 as at construction, then put where the old
one was (device, dtype): its rows are the values a table of the full context holds.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lmcli.config.model import ModelConfig

TABLE_START = 1024  # positions the tables cover until a forward reaches past them


class Positions(nn.Module):
    """The default answers: no embedding, no rotation, no score bias, the context as limit."""

    biases_scores = False  # True when bias() must be applied to every attention

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_len: int | None = cfg.block_size  # longest sequence; None = no limit
        self.cfg = cfg
        self.n_pos = 0  # positions the tables cover
        self.make_tables(cfg)

    def tables(self, cfg: ModelConfig, n_pos: int) -> dict[str, Tensor]:
        """The fixed tables this scheme computes from the config for positions 0..n_pos-1 (never
        stored in a checkpoint)."""
        return {}

    def table_shapes(self, cfg: ModelConfig, n_pos: int) -> dict[str, tuple[int, ...]]:
        """The shape of each of ``tables`` (float32), for a model on the meta device."""
        return {}

    def make_tables(self, cfg: ModelConfig, n_pos: int | None = None) -> None:
        """(Re)compute the tables for ``n_pos`` positions (default: the first ``TABLE_START`` of the
        context) as non-persistent buffers, on the current default device: at construction, and
        after a loader built the model on the meta device. On the meta device they are their
        shapes alone (torch's meta arithmetic is Python that imports its compiler)."""
        n_pos = n_pos or min(cfg.block_size, TABLE_START)
        if torch.get_default_device().type == "meta":
            tables = {name: torch.empty(shape) for name, shape in self.table_shapes(cfg, n_pos).items()}
        else:
            tables = self.tables(cfg, n_pos)
        for name, table in tables.items():
            self.register_buffer(name, table, persistent=False)
        self.n_pos = n_pos

    def reach(self, n: int) -> None:
        """Make the tables cover positions 0..n-1 (a forward's last position is below its cached
        columns plus its new ones): grown to twice their positions or to ``n``, at most the
        context, computed on the CPU in float32 and put where the old ones are (device, dtype).
        Nothing to do when they do already, or when the scheme has none."""
        if n <= self.n_pos or not self.table_shapes(self.cfg, 1):
            return
        old = {name: getattr(self, name) for name in self.table_shapes(self.cfg, 1)}
        if any(t.is_meta for t in old.values()):
            return  # a skeleton: its tables are shapes, computed when it is materialized
        n_pos = max(n, min(2 * self.n_pos, self.max_len or 2 * self.n_pos))
        with torch.device("cpu"):
            tables = self.tables(self.cfg, n_pos)
        for name, table in tables.items():
            self.register_buffer(name, table.to(old[name].device, old[name].dtype), persistent=False)
        self.n_pos = n_pos

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, pos: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, allowed: Tensor, n_cached: int, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError


class Learned(Positions):
    """A trained embedding per position (GPT-2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        return x + self.wpe(pos)


def sinusoidal_table(n_pos: int, dim: int) -> Tensor:
    """The fixed sin/cos position table of "Attention Is All You Need", (n_pos, dim)."""
    pos = torch.arange(n_pos, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_pos, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : dim // 2]
    return table


class Sinusoidal(Positions):
    """Fixed sin/cos embeddings added to the tokens."""

    def tables(self, cfg: ModelConfig, n_pos: int) -> dict[str, Tensor]:
        return {"table": sinusoidal_table(n_pos, cfg.n_embd)}

    def table_shapes(self, cfg: ModelConfig, n_pos: int) -> dict[str, tuple[int, ...]]:
        return {"table": (n_pos, cfg.n_embd)}

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        return x + self.table[pos].to(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> tuple[Tensor, float]:
    """The rotation frequencies (D/2,) of each pair of dimensions, and the factor cos and sin are
    multiplied by (1 but for yarn), with ``cfg.rope_scaling`` applied.

    linear: every frequency divided by the factor. llama3: low frequencies (wavelengths above
    the original context / low_freq_factor) divided by the factor, high ones (below context /
    high_freq_factor) kept, the band between interpolated. yarn (Peng et al. 2023): frequencies
    that turn fewer than 1 time over the original context divided by the factor, those turning
    more than 32 times kept, a linear ramp between; attention sharpened by 0.1 ln(factor) + 1.
    """
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    factor, context = cfg.rope_factor, cfg.rope_original_context
    if cfg.rope_scaling == "linear":
        return inv / factor, 1.0
    if cfg.rope_scaling == "llama3":
        wavelen = 2 * math.pi / inv
        low, high = context / cfg.rope_low_freq_factor, context / cfg.rope_high_freq_factor
        scaled = torch.where(wavelen > low, inv / factor, inv)
        smooth = (context / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        between = (1 - smooth) * scaled / factor + smooth * scaled
        return torch.where((wavelen >= high) & (wavelen <= low), between, scaled), 1.0
    if cfg.rope_scaling == "yarn":

        def dim_of(turns: float) -> float:  # the dimension that turns ``turns`` times over the context
            return D * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_base))

        lo, hi = max(math.floor(dim_of(32)), 0), min(math.ceil(dim_of(1)), D - 1)
        ramp = ((torch.arange(D // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1: the frequency kept (extrapolated), 0: divided by the factor
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return inv / factor * (1 - keep) + inv * keep, scale
    return inv, 1.0


def rotary_tables(n_pos: int, inv: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """cos and sin (n_pos, D/2) of every position's angles for the frequencies ``inv`` (D/2,):
    one angle for each pair of dimensions."""
    angles = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv)  # (n_pos, D/2)
    return angles.cos() * scale, angles.sin() * scale


class Rotary(Positions):
    """Rotary position embedding (rotate-half layout, as in Llama), applied to queries and keys.
    With ``rope_local_base`` the sliding-window layers turn by that base's own table, unscaled."""

    def tables(self, cfg: ModelConfig, n_pos: int) -> dict[str, Tensor]:
        cos, sin = rotary_tables(n_pos, *rope_frequencies(cfg))
        if not cfg.rope_local_base:
            return {"cos": cos, "sin": sin}
        D = cfg.head_dim
        inv = 1.0 / (cfg.rope_local_base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        cos_local, sin_local = rotary_tables(n_pos, inv, 1.0)
        return {"cos": cos, "sin": sin, "cos_local": cos_local, "sin_local": sin_local}

    def table_shapes(self, cfg: ModelConfig, n_pos: int) -> dict[str, tuple[int, ...]]:
        names = ("cos", "sin", "cos_local", "sin_local") if cfg.rope_local_base else ("cos", "sin")
        return dict.fromkeys(names, (n_pos, cfg.head_dim // 2))

    def table(self, local: bool) -> tuple[Tensor, Tensor]:
        """cos and sin (n_pos, D/2) of a local or a global layer."""
        if local and hasattr(self, "cos_local"):
            return self.cos_local, self.sin_local
        return self.cos, self.sin

    def rotate(self, q: Tensor, k: Tensor, pos: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
        """Rotate q and k (B, H, T, D) by positions pos (B or 1, T)."""
        cos, sin = self.table(local)
        cos = cos[pos].unsqueeze(1).to(q.dtype)  # (B or 1, 1, T, D/2)
        sin = sin[pos].unsqueeze(1).to(q.dtype)
        return rotate_half(q, cos, sin), rotate_half(k, cos, sin)


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (.., D) turned by angles with cos and sin (.., D/2): each dimension i < D/2 paired with
    i + D/2 (Llama's rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)  # (.., D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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


class ALiBi(Positions):
    """Attention scores lowered in proportion to distance, a slope per head; no length limit."""

    biases_scores = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.max_len = None

    def tables(self, cfg: ModelConfig, n_pos: int) -> dict[str, Tensor]:
        return {"slopes": alibi_slopes(cfg.n_head)}

    def table_shapes(self, cfg: ModelConfig, n_pos: int) -> dict[str, tuple[int, ...]]:
        return {"slopes": (cfg.n_head,)}

    def reach(self, n: int) -> None:
        """Its slopes serve any position."""

    def bias(self, allowed: Tensor, n_cached: int, dtype: torch.dtype) -> Tensor:
        """Float mask (B or 1, H, T, S) from a boolean one: -slope * |distance|, -inf where not allowed."""
        T = allowed.size(-2)
        q = torch.arange(n_cached, n_cached + T, device=allowed.device)[:, None]
        k = torch.arange(n_cached + T, device=allowed.device)[None, :]
        dist = (q - k).abs().to(self.slopes.dtype)  # (T, S)
        bias = -self.slopes[:, None, None] * dist  # (H, T, S), computed in float32, then cast once
        return bias[None].masked_fill(~allowed, float("-inf")).to(dtype)


POSITIONS: dict[str, type[Positions]] = {
    "learned": Learned,
    "sinusoidal": Sinusoidal,
    "rope": Rotary,
    "alibi": ALiBi,
}


def make_positions(cfg: ModelConfig) -> Positions:
    return POSITIONS[cfg.position](cfg)
