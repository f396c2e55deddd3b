"""LoRA: low-rank adapters on a frozen model's linear layers (Hu et al. 2021).

An adapted layer computes ``W x + b + (alpha / r) * B A dropout(x)`` with ``A`` (r, in) drawn
like a linear layer's weight and ``B`` (out, r) zero, so training starts from the base model's
output. Only ``A`` and ``B`` (and, with ``--lora-train-embeddings``, the token embedding and the
output head) require gradients, so the optimizer holds state for them alone.

``LoRALinear`` is an ``nn.Linear`` that shares the base layer's weight and bias, so the module
paths of the base (``h.0.attn.c_attn.weight``) do not change; the adapters are
``h.0.attn.c_attn.lora_a`` and ``.lora_b``. ``merge`` folds them into the weights and puts plain
``nn.Linear`` layers back: inference (and the CPU fast paths) sees an ordinary model.

Why not PEFT: it pulls in transformers and accelerate at about 4 s of import on this machine,
its ``modules_to_save`` copy of the embedding unties lmcli's tied head, and its wrapped layers
answer ``.weight`` with the base weight, which the one-token fast step would use without the
adapters. The layer is the few lines below.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError, check_names, check_tensors
from lmcli.model.transformer import Transformer

# --lora-targets names -> (sublayer, attribute) of each Block
TARGETS: dict[str, tuple[str, str]] = {
    "qkv": ("attn", "c_attn"),  # the fused query/key/value projection
    "attn_out": ("attn", "c_proj"),  # attention output projection
    "fc": ("mlp", "c_fc"),  # MLP up-projection
    "gate": ("mlp", "c_gate"),  # SwiGLU gate projection
    "mlp_out": ("mlp", "c_proj"),  # MLP down-projection
}
ADAPTER_KEYS = (".lora_a", ".lora_b")


class LoRALinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank update ``scale * B @ A``."""

    def __init__(
        self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator
    ) -> None:
        nn.Module.__init__(self)  # no weight of its own: the base layer's tensors are shared
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.scale = rank, alpha / rank
        w = base.weight
        # on a base built on the meta device (a sharded run's), the adapters still hold their values
        device = torch.device("cpu") if w.is_meta else w.device
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype, device=device))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, dtype=w.dtype, device=device))
        bound = 1.0 / math.sqrt(self.in_features)  # nn.Linear's default init (kaiming, a=sqrt(5))
        with torch.no_grad():
            a = torch.empty(rank, self.in_features).uniform_(-bound, bound, generator=generator)
            self.lora_a.copy_(a)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.dropout(x) if self.training and self.dropout.p > 0 else x
        update = F.linear(F.linear(h, self.lora_a), self.lora_b)  # (.., in) -> (.., r) -> (.., out)
        return F.linear(x, self.weight, self.bias) + update * self.scale

    def delta(self) -> Tensor:
        """The update of the weight (out, in) the adapters stand for."""
        return (self.lora_b @ self.lora_a) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def parse_targets(text: str) -> tuple[str, ...]:
    """``qkv,fc`` -> ("qkv", "fc"); one line for a name that is no projection lmcli has."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise LmcliError(f"lora-targets names no layer: choose from {', '.join(TARGETS)}")
    for name in names:
        if name not in TARGETS:
            raise LmcliError(f"lora-targets: {name!r} names no layer: choose from {', '.join(TARGETS)}")
    return names


def _targets(model: Transformer, cfg: TrainConfig) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(module path, parent, attribute, layer) of every layer ``cfg.lora.lora_targets`` names."""
    found = []
    for name in parse_targets(cfg.lora.lora_targets):
        sub, attr = TARGETS[name]
        for i, block in enumerate(model.h):
            layer = getattr(getattr(block, sub), attr)
            if not isinstance(layer, nn.Linear) or isinstance(layer, LoRALinear):
                raise LmcliError(
                    f"lora target {name} names no layer of this model ({sub}.{attr} is absent: "
                    f"mlp {model.config.mlp})"
                )
            found.append((f"h.{i}.{sub}.{attr}", getattr(block, sub), attr, layer))
    return found


def adapter_shapes(model: Transformer, cfg: TrainConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a LoRA checkpoint of ``cfg`` on ``model`` holds, name -> shape, found without
    allocating anything (``model`` may be on the meta device); one line for a rank below 1 or
    above the smallest side of a layer it adapts (a larger one adds nothing and can take any
    amount of memory)."""
    r = cfg.lora.lora_rank
    targets = _targets(model, cfg)
    if r < 1:
        raise LmcliError(f"lora-rank {r}: LoRA adapters need a rank of at least 1")
    path, _, _, small = min(targets, key=lambda t: min(t[3].in_features, t[3].out_features))
    most = min(small.in_features, small.out_features)
    if r > most:
        raise LmcliError(
            f"lora-rank {r} is larger than the layers it adapts allow ({path}: "
            f"{small.in_features} -> {small.out_features}, at most {most})"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for path, _, _, layer in targets:
        shapes[f"{path}.lora_a"] = (r, layer.in_features)
        shapes[f"{path}.lora_b"] = (layer.out_features, r)
    if cfg.lora.lora_train_embeddings:
        shapes["wte.weight"] = tuple(model.wte.weight.shape)
        if not model.config.tie_embeddings:
            shapes["lm_head.weight"] = tuple(model.lm_head.weight.shape)
    return shapes


def check_adapters(
    model: Transformer, cfg: TrainConfig, tensors: dict[str, tuple[str, tuple[int, ...]]], where: str
) -> None:
    """One line when the adapters file's ``tensors`` (name -> (dtype, shape), its header) do not
    fit ``cfg``'s LoRA settings on ``model``: checked before any adapter is allocated."""
    rank = cfg.lora.lora_rank
    ranks = {shape[0] for name, (_, shape) in tensors.items() if name.endswith(".lora_a") and shape}
    if ranks and ranks != {rank}:
        name = next(n for n, (_, s) in tensors.items() if n.endswith(".lora_a") and s and s[0] != rank)
        raise LmcliError(
            f"adapters {where} have rank {tensors[name][1][0]} ({name} of shape {tensors[name][1]}), "
            f"the run's config says lora-rank {rank}"
        )
    try:
        expected = adapter_shapes(model, cfg)
    except LmcliError as exc:
        raise LmcliError(f"adapters {where}: {exc}") from None
    floats = ("F32", "F16", "BF16", "F64")
    wanted = {name: ("F32", shape) for name, shape in expected.items()}
    fit, expects = "the run's LoRA settings", "the run's LoRA settings expect"
    check_tensors(wanted, tensors, f"adapters {where}", fit, expects, floats)


def add_adapters(model: Transformer, cfg: TrainConfig) -> Transformer:
    """Freeze ``model`` and put adapters of ``cfg.lora.lora_rank`` on ``lora_targets`` of every
    block (drawn from ``cfg.seed``, not from torch's global generator); with
    ``lora_train_embeddings`` the token embedding (and an untied head) train too. The rank is
    checked (``adapter_shapes``) before anything is allocated."""
    adapter_shapes(model, cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    options = cfg.lora
    model.requires_grad_(False)
    for _, parent, attr, layer in _targets(model, cfg):
        adapted = LoRALinear(layer, options.lora_rank, options.lora_alpha, options.lora_dropout, generator)
        setattr(parent, attr, adapted)
    if options.lora_train_embeddings:
        model.wte.weight.requires_grad_(True)
        model.lm_head.weight.requires_grad_(True)  # the same tensor when tied
    return model


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_state(model: Transformer, gathered: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """What a LoRA checkpoint stores: the adapters and any other trained tensor (names as in
    the model's state dict; a tied head once, as ``wte.weight``); their values from
    ``gathered`` (the whole state dict) when the model's parameters are sharded."""
    state = {}
    for name, p in model.named_parameters():  # named_parameters lists a tied tensor once
        if p.requires_grad or name.endswith(ADAPTER_KEYS):
            value = p if gathered is None else gathered[name]
            state[name] = value.detach().to("cpu").contiguous()
    return state


def load_adapters(model: Transformer, state: dict[str, Tensor], where: str) -> None:
    """Put a LoRA checkpoint's tensors into a model that ``add_adapters`` prepared."""
    expected = adapter_state(model)
    check_names(expected, state, f"adapters {where} do not fit the run's LoRA settings")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            if value.shape != params[name].shape:
                raise LmcliError(
                    f"adapters {where}: {name} has shape {tuple(value.shape)}, "
                    f"the run's LoRA settings expect {tuple(params[name].shape)}"
                )
            params[name].copy_(value)


def merge(model: Transformer) -> Transformer:
    """Fold every adapter into its layer's weight and put plain ``nn.Linear`` layers back; every
    parameter trainable again, as in a model that never had adapters."""
    for block in model.h:
        for sub, attr in TARGETS.values():
            parent = getattr(block, sub)
            layer = getattr(parent, attr, None)
            if isinstance(layer, LoRALinear):
                with torch.no_grad():
                    layer.weight += layer.delta().to(layer.weight.dtype)
                plain = nn.Linear.__new__(nn.Linear)  # the adapted layer's own tensors, no new ones
                nn.Module.__init__(plain)
                plain.in_features, plain.out_features = layer.in_features, layer.out_features
                plain.weight, plain.bias = layer.weight, layer.bias
                setattr(parent, attr, plain)
    model.requires_grad_(True)
    return model
