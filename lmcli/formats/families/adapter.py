"""What a family adapter is: tensor-name maps both ways, configs both ways, what it cannot express,
when export writes a model as the family, and the sliding window as its ``config.json`` says it.

lmcli's names are those of its checkpoint files (``wte.weight``, ``wpe.weight``,
``h.{i}.attn.c_attn.weight``, ...; the logical vocabulary; a tied head absent). A family's map
to another format is a tuple of entries, each naming one module on both sides (its ``.weight``
and, where present, its ``.bias``; ``{i}`` stands for the block). The same entries read both
ways: ``Rename`` (optionally transposed, for GPT-2's ``Conv1D``) and ``SplitQKV`` (lmcli's fused
query/key/value projection as three tensors, optionally in llama.cpp's rotary order). Entries are
listed in the order the tensors are written; a run of per-block entries is written block by block.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families.hf_config import HFConfig

Format = Literal["hf", "gguf"]
PARTS = ("weight", "bias")
REQUIRED = object()  # a config.json field the family cannot do without


def _key(module: str, i: int | None, part: str) -> str:
    return f"{module.format(i=i)}.{part}"


def pairs_from_halves(w: Tensor, n_head: int) -> Tensor:
    """Rows of each head reordered from lmcli's rotary layout (i paired with i + D/2) to
    llama.cpp's (2i paired with 2i + 1). ``w``: (n_head * D, ...) weight or (n_head * D,) bias."""
    rest = w.shape[1:]
    D = w.size(0) // n_head
    # (H*D, ...) -> (H, 2, D/2, ...) -> (H, D/2, 2, ...) -> (H*D, ...)
    return w.reshape(n_head, 2, D // 2, *rest).transpose(1, 2).reshape(w.shape)


def halves_from_pairs(w: Tensor, n_head: int) -> Tensor:
    """The inverse of ``pairs_from_halves``: llama.cpp's adjacent rotary pairs back to halves."""
    rest = w.shape[1:]
    D = w.size(0) // n_head
    # (H*D, ...) -> (H, D/2, 2, ...) -> (H, 2, D/2, ...) -> (H*D, ...)
    return w.reshape(n_head, D // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class Rename:
    """One module under another name; ``transpose``: the other side stores the weight (in, out)."""

    ours: str
    theirs: str
    transpose: bool = False

    def forward(self, src: dict[str, Tensor], i: int | None, part: str, cfg: ModelConfig, out: dict) -> None:
        """Move ``src``'s tensor of this module (if any) into ``out`` under the other name."""
        self._move(src, _key(self.ours, i, part), _key(self.theirs, i, part), part, out)

    def backward(self, src: dict[str, Tensor], i: int | None, part: str, cfg: ModelConfig, out: dict) -> None:
        """The other way: from the other format's name to lmcli's."""
        self._move(src, _key(self.theirs, i, part), _key(self.ours, i, part), part, out)

    def _move(self, src: dict[str, Tensor], key: str, to: str, part: str, out: dict) -> None:
        if key in src:
            value = src.pop(key)
            out[to] = value.t().contiguous() if self.transpose and part == "weight" else value


@dataclass(frozen=True)
class SplitQKV:
    """lmcli's fused projection (q, then k, then v rows) as three tensors ``theirs``; ``pairs``:
    the q and k rows of each head in llama.cpp's adjacent rotary pairs instead of lmcli's halves."""

    ours: str
    theirs: tuple[str, str, str]
    pairs: bool = False

    def forward(self, src: dict[str, Tensor], i: int | None, part: str, cfg: ModelConfig, out: dict) -> None:
        key = _key(self.ours, i, part)
        if key not in src:
            return
        kv = cfg.n_kv_head * cfg.head_dim
        q, k, v = src.pop(key).split([cfg.q_width, kv, kv])  # (C + 2*kv, ...) -> q, k, v rows
        if self.pairs:
            q, k = pairs_from_halves(q, cfg.n_head), pairs_from_halves(k, cfg.n_kv_head)
        for name, piece in zip(self.theirs, (q, k, v), strict=True):
            out[_key(name, i, part)] = piece.contiguous()

    def backward(self, src: dict[str, Tensor], i: int | None, part: str, cfg: ModelConfig, out: dict) -> None:
        keys = [_key(name, i, part) for name in self.theirs]
        if not all(k in src for k in keys):
            return  # left under their names: loading names what is missing
        q, k, v = (src.pop(k) for k in keys)
        if self.pairs:
            q, k = halves_from_pairs(q, cfg.n_head), halves_from_pairs(k, cfg.n_kv_head)
        out[_key(self.ours, i, part)] = torch.cat([q, k, v])


Entry = Rename | SplitQKV


def _placed(entries: tuple[Entry, ...], n_layer: int) -> Iterator[tuple[Entry, int | None]]:
    """Each entry with its block: whole-model entries once, each run of per-block entries for
    block 0, then block 1, ..., in the order listed."""
    for per_block, run in itertools.groupby(entries, key=lambda e: "{i}" in e.ours):
        run = list(run)
        for i in range(n_layer) if per_block else [None]:
            for entry in run:
                yield entry, i


def map_names(
    entries: tuple[Entry, ...], state: dict[str, Tensor], cfg: ModelConfig, *, back: bool = False
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``state`` under the other side's names (``back``: from the other side's to lmcli's), and
    what no entry names, as it was."""
    src, out = dict(state), {}
    for entry, i in _placed(entries, cfg.n_layer):
        for part in PARTS:
            (entry.backward if back else entry.forward)(src, i, part, cfg, out)
    return out, src


# GGUF's names (llama.cpp's ``gguf.TENSOR_NAMES``) of the modules every family has
GGUF_BLOCK = (
    Rename("h.{i}.ln_1", "blk.{i}.attn_norm"),
    Rename("h.{i}.attn.c_proj", "blk.{i}.attn_output"),
    Rename("h.{i}.ln_2", "blk.{i}.ffn_norm"),
    Rename("h.{i}.mlp.c_fc", "blk.{i}.ffn_up"),
    Rename("h.{i}.mlp.c_proj", "blk.{i}.ffn_down"),
)
GGUF_HEAD = (Rename("ln_f", "output_norm"), Rename("lm_head", "output"))


def variants(cfg: ModelConfig) -> dict[str, bool]:
    """Which of the model's optional variants ``cfg`` uses, by the name an export's refusal gives
    them; a family lists those it can hold in ``FamilyAdapter.expresses``."""
    return {
        "qk-norm": cfg.qk_norm,
        "a head size apart from n-embd/n-head": bool(cfg.head_size)
        and cfg.head_size * cfg.n_head != cfg.n_embd,
        "a sliding window": bool(cfg.sliding_window),
        "a layer pattern": bool(cfg.layer_pattern),
        "a local rotary base": bool(cfg.rope_local_base),
        "layers without rotary": bool(cfg.rope_pattern),
        "scaled embeddings": cfg.scale_embeddings,
        "an attention scale": bool(cfg.attn_scalar),
        "attention soft-capping": bool(cfg.attn_softcap),
        "logit soft-capping": bool(cfg.logit_softcap),
    }


LOCAL, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer types


def layer_pattern(types: list[str], where: str) -> str:
    """The shortest ``layer_pattern`` (L local, G global, repeated) of config.json's
    ``layer_types``; "" when every layer is local."""
    letters = []
    for t in types:
        if t not in (LOCAL, GLOBAL):
            raise LmcliError(f"{where}: unsupported layer type {t!r} (lmcli reads {LOCAL}, {GLOBAL})")
        letters.append("L" if t == LOCAL else "G")
    return "" if all(x == "L" for x in letters) else shortest_period("".join(letters))


def shortest_period(letters: str) -> str:
    """The shortest prefix that, repeated, gives ``letters`` (a layer or rotary pattern)."""
    n = next(n for n in range(1, len(letters) + 1) if all(c == letters[i % n] for i, c in enumerate(letters)))
    return letters[:n]


def layer_types(cfg: ModelConfig) -> list[str]:
    """config.json's ``layer_types`` of ``cfg``."""
    return [LOCAL if cfg.is_local(i) else GLOBAL for i in range(cfg.n_layer)]


@dataclass(frozen=True)
class Field:
    """A ``config.json`` field holding a ModelConfig field: read on import, written on export."""

    theirs: str
    ours: str
    default: Any = REQUIRED  # on import, when the config lacks it (REQUIRED: one line naming it)


class FamilyAdapter:
    """One model family: what lmcli knows of it, used by every import and export.

    A family is one subclass in a module of ``lmcli.formats.families``: the registry collects
    every adapter class those modules define (writing the class registers it). A subclass sets
    the class attributes (the name tables, ``hf_fields``, the messages, ``export_rank``) and
    writes ``config_from_hf``, ``hf_settings``, ``gguf_metadata``, ``gguf_settings``, ``claims``
    (which models export writes as it) and, for what only it cannot express, ``own_problems``;
    the weight maps need no code. A family with a sliding window says how its ``config.json``
    holds it (``window``, ``default_layer_types``, ``window_config``).
    """

    name: ClassVar[str]  # config.json's model_type
    architecture: ClassVar[str]  # config.json's architectures
    gguf_arch: ClassVar[str | None] = None  # GGUF's general.architecture
    reads_gguf: ClassVar[bool] = True  # whether GGUF files of ``gguf_arch`` are read through it
    # export asks the families in rising rank whether they ``claim`` a model; None: import only
    export_rank: ClassVar[int | None] = None
    position: ClassVar[str]  # what the family computes, as lmcli's options say it
    norm: ClassVar[str]
    mlp: ClassVar[str]
    placement: ClassVar[str] = "pre"  # the norm placement
    hf_names: ClassVar[tuple[Entry, ...]]  # Hugging Face's tensor names
    hf_buffers: ClassVar[tuple[str, ...]] = ()  # tensors some checkpoints hold that are no weights
    gguf_names: ClassVar[tuple[Entry, ...]] = ()  # GGUF's tensor names
    hf_refusal: ClassVar[str]  # the export's error; {} stands for the problems
    gguf_needs: ClassVar[str] = ""  # what GGUF's architecture needs, for its error
    hf_fields: ClassVar[tuple[Field, ...]]  # config.json fields that hold ModelConfig fields
    hf_extra: ClassVar[dict[str, Any]] = {}  # config.json fields after the rest (constants)
    expresses: ClassVar[frozenset[str]] = frozenset()  # the ``variants`` the family can hold
    # the ``variants`` its GGUF architecture holds (None: those of ``expresses``)
    gguf_expresses: ClassVar[frozenset[str] | None] = None

    # ------------------------------------------------------------------------- export's choice

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        """Whether export writes ``cfg`` as this family in ``fmt`` (asked in ``export_rank``
        order, the first family that claims it writes it, or names what it cannot express):
        ``cfg`` uses something this family is the one to write."""
        return False

    # ------------------------------------------------------------------------- the sliding window

    def window(self, hf: HFConfig) -> int | None:
        """The sliding window the family's transformers code applies (None: none)."""
        return None

    def default_layer_types(self, hf: HFConfig, n_layer: int, window: int) -> list[str]:
        """The layer types transformers gives a config.json without ``layer_types``."""
        return [LOCAL] * n_layer

    def window_settings(self, hf: HFConfig, n_layer: int) -> dict[str, Any]:
        """``sliding_window`` and ``layer_pattern`` of the config (transformers 5's ``layer_types``
        or the family's older keys)."""
        window = self.window(hf)
        if not window:
            return {}
        types = hf.get("layer_types") or self.default_layer_types(hf, n_layer, window)
        if len(types) != n_layer:
            raise LmcliError(f"{hf.where}: layer_types has {len(types)} entries for {n_layer} layers")
        if LOCAL not in types:
            return {}
        return {"sliding_window": window, "layer_pattern": layer_pattern(types, hf.where)}

    def window_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """The config.json fields of ``cfg``'s sliding window (none for a family without one)."""
        return {}

    def own_settings(self, hf: HFConfig, n_layer: int) -> dict[str, Any]:
        """The ModelConfig fields only this family's config.json holds."""
        return {}

    # ------------------------------------------------------------------------- configs

    def config_from_hf(self, hf: HFConfig) -> tuple[ModelConfig, list[str]]:
        """lmcli's ModelConfig of the family's ``config.json``, and notices for the user."""
        raise NotImplementedError

    def read_fields(self, hf: HFConfig) -> dict[str, Any]:
        """The ModelConfig fields that ``hf_fields`` name (and the vocabulary), as ``hf`` holds them."""
        read = {
            f.ours: hf.require(f.theirs) if f.default is REQUIRED else hf.get(f.theirs, f.default)
            for f in self.hf_fields
        }
        return {"vocab_size": hf.require("vocab_size"), **read}

    def hf_config(self, cfg: ModelConfig, ids: dict[str, int | None], dtype: str) -> dict[str, Any]:
        """The ``config.json`` of ``cfg`` as this family (``ids``: bos/eos/pad token ids)."""
        resolved = dataclasses.replace(cfg, d_ff=cfg.ffn_dim)  # a config.json holds the MLP's width
        return {
            "architectures": [self.architecture],
            "model_type": self.name,
            "vocab_size": cfg.vocab_size,
            **{f.theirs: getattr(resolved, f.ours) for f in self.hf_fields},
            **self.hf_settings(cfg),
            **{f"{role}_token_id": ids[role] for role in ("bos", "eos", "pad")},
            "torch_dtype": dtype,
            **self.hf_extra,
        }

    def hf_settings(self, cfg: ModelConfig) -> dict[str, Any]:
        """The ``config.json`` fields export writes beyond ``hf_fields`` (import checks them)."""
        return {}

    def gguf_metadata(self, writer: Any, cfg: ModelConfig) -> None:
        """The hyperparameters only this architecture's GGUF metadata holds (``gguf.GGUFWriter``)."""

    def config_from_gguf(self, meta: HFConfig, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
        """lmcli's ModelConfig of a GGUF file of this family: its metadata ``meta`` (keys as the
        file names them, ``llama.block_count``, ...) and its tensors' ``shapes`` (PyTorch order,
        by GGUF name). The shapes themselves are checked against the config afterwards."""
        arch = self.gguf_arch
        heads = meta.require(f"{arch}.attention.head_count")
        embd = shapes.get("token_embd.weight")
        if embd is None or len(embd) != 2:
            raise LmcliError(f"{meta.where} has no token_embd.weight matrix")
        fields = dict(
            vocab_size=embd[0],
            block_size=meta.require(f"{arch}.context_length"),
            n_embd=meta.require(f"{arch}.embedding_length"),
            n_layer=meta.require(f"{arch}.block_count"),
            n_head=heads,
            n_kv_head=meta.get(f"{arch}.attention.head_count_kv", heads),
            d_ff=meta.require(f"{arch}.feed_forward_length"),
            tie_embeddings="output.weight" not in shapes,
        )
        settings = self.gguf_settings(meta, shapes)
        try:
            return ModelConfig(
                **fields,  # type: ignore[arg-type]
                vocab_multiple=1,  # the file's shapes as they are
                position=self.position,
                norm=self.norm,
                norm_placement=self.placement,
                mlp=self.mlp,
                **settings,
            )
        except LmcliError as exc:
            raise LmcliError(f"{meta.where}: {exc}") from None

    def gguf_settings(self, meta: HFConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """The ModelConfig fields only this architecture's GGUF metadata holds (eps, rope, biases)."""
        return {}

    # ------------------------------------------------------------------------- what it cannot express

    def problems(self, cfg: ModelConfig, fmt: Format = "hf") -> list[str]:
        """What of ``cfg`` this family cannot express when written as ``fmt`` ([]: all of it)."""
        found = []
        if cfg.position != self.position:
            found.append(f"{cfg.position} positions")
        if cfg.norm != self.norm:
            found.append(cfg.norm)
        if cfg.norm_placement != self.placement:
            found.append(f"{cfg.norm_placement}-norm")
        if cfg.mlp != self.mlp:
            found.append(f"a {cfg.mlp} MLP")
        found += self.own_problems(cfg, fmt)
        found += [name for name, used in variants(cfg).items() if used and name not in self.expressed(fmt)]
        return found

    def expressed(self, fmt: Format) -> frozenset[str]:
        """The ``variants`` the family holds in ``fmt``."""
        return self.gguf_expresses if fmt == "gguf" and self.gguf_expresses is not None else self.expresses

    def gguf_context(self, cfg: ModelConfig) -> int:
        """The context length a GGUF file of ``cfg`` states."""
        return cfg.block_size

    def own_problems(self, cfg: ModelConfig, fmt: Format) -> list[str]:
        """The family's own limits beyond positions, norm and MLP."""
        return []

    def refusal(self, problems: list[str], fmt: Format) -> str:
        """The one-line error of an export ``problems`` stop."""
        listed = ", ".join(problems)
        if fmt == "gguf":
            arch, needs = self.gguf_arch, self.gguf_needs
            return f"GGUF's {arch} architecture cannot express this model ({listed}): it needs {needs}"
        return self.hf_refusal.format(listed)

    # ------------------------------------------------------------------------- weights

    def from_hf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """Hugging Face weights under lmcli's names; unknown ones kept (loading names them)."""
        out, left = map_names(self.hf_names, state, cfg, back=True)
        return out | {k: v for k, v in left.items() if not any(re.fullmatch(p, k) for p in self.hf_buffers)}

    def to_hf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """lmcli's weights (as on disk, logical vocabulary) under Hugging Face's names."""
        return self._export(self.hf_names, state, cfg)

    def to_gguf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """lmcli's weights under GGUF's tensor names, in the order they are written."""
        return self._export(self.gguf_names, state, cfg)

    def from_gguf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """GGUF tensors (PyTorch layout) under lmcli's names; unknown ones kept."""
        out, left = map_names(self.gguf_names, state, cfg, back=True)
        return out | left

    def _export(
        self, entries: tuple[Entry, ...], state: dict[str, Tensor], cfg: ModelConfig
    ) -> dict[str, Tensor]:
        out, left = map_names(entries, state, cfg)
        if left:  # ``problems`` let through a model the map does not cover: a bug, not bad input
            raise RuntimeError(f"the {self.name} adapter has no name for {', '.join(sorted(left)[:3])}")
        return out
