"""SmolLM3: Llama whose every fourth layer has no rotary positions (``no_rope_layers``: 1 where a
layer turns, 0 where not; lmcli's ``rope_pattern``), with a sliding window on those layers when
``use_sliding_window`` says so. llama.cpp's ``smollm3`` turns adjacent pairs, as its ``llama``,
and fixes the layers without rotary in code (every fourth: ``(i + 1) % 4 == 0``), with no
metadata key and no window: a GGUF file of it reads so, and export refuses another pattern.
"""

from __future__ import annotations

from typing import Any

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families.adapter import GLOBAL, LOCAL, Format, layer_types, shortest_period
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.families.llama import Llama


def rotary_flags(hf: HFConfig, n_layer: int) -> list[int]:
    """``no_rope_layers`` (1: the layer turns), or transformers' default from the interval."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        every = hf.get("no_rope_layer_interval", 4)
        return [int((i + 1) % every != 0) for i in range(n_layer)]
    flags = [flags] if isinstance(flags, int) else flags
    if len(flags) != n_layer:
        raise LmcliError(f"{hf.where}: no_rope_layers has {len(flags)} entries for {n_layer} layers")
    return flags


GGUF_NO_ROPE_STEP = 4  # llama.cpp's smollm3: layer i turns unless (i + 1) % 4 == 0


def gguf_rope_pattern(n_layer: int) -> str:
    """lmcli's ``rope_pattern`` of llama.cpp's smollm3 with ``n_layer`` layers ("" if all turn)."""
    letters = "".join("N" if (i + 1) % GGUF_NO_ROPE_STEP == 0 else "R" for i in range(n_layer))
    return "" if "N" not in letters else shortest_period(letters)


class SmolLM3(Llama):
    name = "smollm3"
    architecture = "SmolLM3ForCausalLM"
    gguf_arch = "smollm3"
    export_rank = 30
    hf_extra = {"attention_bias": False, "mlp_bias": False}
    expresses = Llama.expresses | {"layers without rotary", "a sliding window", "a layer pattern"}
    gguf_expresses = Llama.gguf_expresses | {"layers without rotary"}
    gguf_needs = (
        "rotary positions without scaling on every layer but each fourth, pre-RMSNorm and a SwiGLU MLP"
    )

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        return bool(cfg.rope_pattern)

    def own_problems(self, cfg: ModelConfig, fmt: Format) -> list[str]:
        found = super().own_problems(cfg, fmt)
        turns = [(i + 1) % GGUF_NO_ROPE_STEP != 0 for i in range(cfg.n_layer)]  # llama.cpp's layers
        if fmt == "gguf" and any(cfg.is_rotary(i) != t for i, t in enumerate(turns)):
            found.append(f"layers without rotary other than each fourth (rope-pattern {cfg.rope_pattern!r})")
        return found

    def gguf_settings(self, meta: HFConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        n_layer = meta.require(f"{self.gguf_arch}.block_count")
        return super().gguf_settings(meta, shapes) | {"rope_pattern": gguf_rope_pattern(n_layer)}

    def window(self, hf: HFConfig) -> int | None:
        return hf.get("sliding_window") if hf.get("use_sliding_window") else None

    def default_layer_types(self, hf: HFConfig, n_layer: int, window: int) -> list[str]:
        return [GLOBAL if f else LOCAL for f in rotary_flags(hf, n_layer)]

    def own_settings(self, hf: HFConfig, n_layer: int) -> dict[str, Any]:
        letters = "".join("R" if f else "N" for f in rotary_flags(hf, n_layer))
        return {"rope_pattern": "" if "N" not in letters else shortest_period(letters)}

    def window_config(self, cfg: ModelConfig) -> dict[str, Any]:
        out: dict[str, Any] = {"no_rope_layers": [int(cfg.is_rotary(i)) for i in range(cfg.n_layer)]}
        if not cfg.sliding_window:
            return out | {"use_sliding_window": False, "sliding_window": None}
        return out | {
            "use_sliding_window": True,
            "sliding_window": cfg.sliding_window,
            "layer_types": layer_types(cfg),
        }
