"""``LmcliLM``: an lmcli run, checkpoint or Hugging Face folder as lm-evaluation-harness's ``LM``.

It is a ``TemplateLM``: the harness tokenizes each (context, continuation) pair with
``tok_encode`` and ``_encode_pair``. ``loglikelihood`` groups the requests of one context and
scores them with ``lmcli.eval.downstream.scoring`` (the context run once, its KV cache shared by its
continuations); ``loglikelihood_rolling`` scores the harness's rolling windows the same way;
``generate_until`` decodes with lmcli's engine. Every context starts with ``<bos>``, as lmcli
reads every text (the harness's ``hf`` backend does so with ``add_bos_token=True``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from lmcli.config.commands import DeviceConfig, SampleConfig
from lmcli.config.files import field_names, from_dict
from lmcli.data.corpus import batched
from lmcli.device import inference_dtype, pick_device, precision
from lmcli.errors import LmcliError
from lmcli.eval.downstream.scoring import Group, score_groups
from lmcli.formats.checkpoint import Checkpoint
from lmcli.formats.sources import DTYPES, load_model
from lmcli.generate.sampling import BATCH_ROWS, generate
from lmcli.model.kv_cache import check_format, kv_dtype
from lmcli.text import chat_template


class LmcliLM(TemplateLM):
    """An lmcli run, checkpoint or Hugging Face folder as an lm-evaluation-harness model.

    ``--model_args path=RUN`` (and ``device``, ``dtype``: those of ``lmcli eval``;
    ``batch_size``: contexts per forward; ``max_gen_toks``: the generation limit)."""

    def __init__(
        self,
        path: str | None = None,
        *,
        checkpoint: Checkpoint | None = None,
        batch_size: int | str | None = 8,
        max_gen_toks: int = 256,
        **options: Any,
    ) -> None:
        super().__init__()
        options.pop("max_batch_size", None)  # given by the harness for its "auto" batch sizes
        device = options.pop("device", None)
        unknown = sorted(set(options) - field_names(DeviceConfig))
        if unknown:
            raise LmcliError(f"lmcli model_args: unknown argument(s) {', '.join(unknown)}")
        cfg = from_dict(DeviceConfig, {**options, "device": _device_name(device)}, source="lmcli model_args")
        if checkpoint is None:
            if path is None:
                raise LmcliError("lmcli model_args: give path=RUN (a run, checkpoint or Hugging Face folder)")
            checkpoint = load_model(path, pick_device(cfg.device), DTYPES.get(cfg.dtype))
        self.ckpt = checkpoint
        self.model, self.tok = checkpoint.model, checkpoint.tokenizer
        if cfg.kv_dtype != "auto":  # (auto keeps what ``lmcli eval`` set, or the compute dtype)
            self.model.kv_dtype = kv_dtype(cfg.kv_dtype)
            check_format(self.model.kv_dtype, self.model.config.head_dim)
        param = next(self.model.parameters())
        self._amp = inference_dtype(param.device, cfg.dtype, param.dtype)
        self._device = param.device
        self._batch_size = int(batch_size) if str(batch_size or "").isdigit() else 8  # "auto": 8
        self._max_gen_toks = int(max_gen_toks)
        self._specials = False  # prompts rendered by a chat template: special-token text is special

    # ------------------------------------------------------------------ what the harness reads

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> Any:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"lmcli-{self.tok.fingerprint}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The ids of ``string``, ``<bos>`` first unless ``add_special_tokens=False`` (or the text
        already starts with it: a chat template's rendering)."""
        if self._specials:
            ids = chat_template.special_parser(self.tok).encode(string, add_special_tokens=False).ids
        else:
            ids = self.tok.encode(string)
        if add_special_tokens is not False and ids[:1] != [self.tok.bos_id]:
            ids = [self.tok.bos_id, *ids]
        cut = kwargs.get("left_truncate_len")
        return ids[-cut:] if cut else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens, skip_special_tokens=skip_special_tokens)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template ``--apply_chat_template`` renders with (lmcli's has no text: "lmcli")."""
        if not chat_template:
            return None
        return _template(self.ckpt) or "lmcli"

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model's chat template renders it, ending where its reply starts."""
        self._specials = True
        return chat_template.render(chat_history, _template(self.ckpt), self.tok)

    # ------------------------------------------------------------------ the requests

    @contextmanager
    def _scope(self) -> Iterator[None]:
        with precision(self._device, self._amp):
            yield

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **_: Any,
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of every request, the requests of one context scored as a group."""
        where: dict[tuple[int, ...], int] = {}
        groups: list[Group] = []
        slots = []
        for _, context, continuation in requests:
            key = tuple(context)
            if key not in where:
                where[key] = len(groups)
                groups.append(Group(list(context), []))
            slots.append((where[key], len(groups[where[key]].continuations)))
            groups[where[key]].continuations.append(list(continuation))
        bar = tqdm(total=len(groups), desc="lmcli: contexts", disable=disable_tqdm or None, leave=False)
        with self._scope():
            scored = score_groups(self.model, groups, self._batch_size, bar.update)
        bar.close()
        return [scored[g][i] for g, i in slots]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text in the harness's disjoint rolling windows (of the
        model's context), the first predicted from ``<bos>``."""
        groups, owner = [], []
        for n, request in enumerate(requests):
            ids = self.tok_encode(request.args[0], add_special_tokens=False)
            windows = get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1)
            for context, continuation in map(make_disjoint_window, windows):
                groups.append(Group(list(context), [list(continuation)]))
                owner.append(n)
        with self._scope():
            scored = score_groups(self.model, groups, self._batch_size)
        totals = [0.0] * len(requests)
        for n, [(ll, _)] in zip(owner, scored, strict=True):
            totals[n] += ll
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context continued by lmcli's engine until a stop string, ``<eos>`` or the limit
        (greedy unless ``do_sample``), the stop string left out."""
        out: list[str] = [""] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for n, request in enumerate(requests):
            by_kwargs.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(n)
        bar = tqdm(total=len(requests), desc="lmcli: generating", disable=disable_tqdm or None, leave=False)
        for key, indices in by_kwargs.items():
            cfg = self._sample_config(json.loads(key))
            room = max(self.max_length - cfg.max_new_tokens, 1)
            for chunk in batched(indices, BATCH_ROWS):
                prompts = [self.tok_encode(requests[n].args[0], left_truncate_len=room) for n in chunk]
                with self._scope():
                    done = generate(self.model, self.tok, prompts, cfg)
                for n, g in zip(chunk, done, strict=True):
                    out[n] = g.text
                bar.update(len(chunk))
        bar.close()
        return out

    def _sample_config(self, kwargs: dict[str, Any]) -> SampleConfig:
        gen = normalize_gen_kwargs(kwargs, self._max_gen_toks)
        until = gen.get("until") or []
        sampling = bool(gen.get("do_sample")) and float(gen.get("temperature") or 0.0) > 0
        return SampleConfig(
            max_new_tokens=min(int(gen["max_gen_toks"]), self.max_length - 1),
            temperature=float(gen["temperature"]) if sampling else 0.0,
            top_k=int(gen.get("top_k") or 0) if sampling else 0,
            top_p=float(gen.get("top_p") or 1.0) if sampling else 1.0,
            stop=tuple(s for s in ([until] if isinstance(until, str) else until) if s),
        )


def _device_name(device: Any) -> str:
    """The harness's ``--device`` as lmcli's: its default ``cuda:0`` on a machine without CUDA,
    or a device lmcli does not name, is ``auto`` (its hf backend falls back to the CPU too)."""
    import torch

    name = str(device).split(":")[0] if device is not None else "auto"
    if name not in ("cpu", "cuda", "mps") or (name == "cuda" and not torch.cuda.is_available()):
        return "auto"
    return name


def _template(ckpt: Checkpoint) -> str | None:
    return chat_template.find_template(ckpt.path) or ckpt.tokenizer.chat_template


# the harness's own models first: its registry imports them only while it is empty
import lm_eval.models  # noqa: E402, F401

if "lmcli" not in model_registry:  # imported once more (a reload): the first class stays
    register_model("lmcli")(LmcliLM)
