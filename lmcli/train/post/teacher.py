"""Distillation's teacher: the model a student learns from, any model source lmcli reads (an
lmcli run or checkpoint, a Hugging Face folder, a GGUF file: ``formats.model_source``).

- ``teacher_source``: what ``--teacher`` names, opened without reading its weights: its
  tokenizer is the student's (``student_tokenizer`` refuses a student of another vocabulary);
- ``identity``: what a run and logit shards record of it (its weights' sha256, its tokenizer,
  its shape), so that a resume or logits of another teacher are refused in one line;
- ``TeacherModel``: the teacher loaded for inference in its own precision (a GGUF file's
  quantized blocks as stored on a CPU, on the native kernels, as ``lmcli sample`` runs it),
  giving the log-probabilities of every next token over the student's vocabulary.

The teacher never trains: no gradient, no dropout, no optimizer state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lmcli.config.files import to_dict
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import ADAPTERS, BASE, sha256_of
from lmcli.formats.model_source import ModelSource, model_source
from lmcli.formats.sources import load_model
from lmcli.model.transformer import Transformer
from lmcli.safe_io import checked_file
from lmcli.text.tokenizer import Tokenizer


def teacher_source(path: str | Path) -> ModelSource:
    """What ``--teacher`` names (one line when it is no model lmcli reads)."""
    try:
        return model_source(
            path, missing="teacher model (a run folder, a Hugging Face folder or a GGUF file)"
        )
    except LmcliError as exc:
        raise LmcliError(f"--teacher {path}: {exc}") from None


def source_tokenizer(source: ModelSource) -> Tokenizer:
    """The teacher's tokenizer, read without its weights."""
    try:
        return source.tokenizer()
    except LmcliError as exc:
        raise LmcliError(f"--teacher {source.path}: {exc}") from None


def digests(source: ModelSource) -> dict[str, str]:
    """The sha256 of a teacher's weight files; a LoRA run's: its adapters and its base's record
    (which holds the base's own sha256)."""
    if source.kind == "lora":
        return {name: sha256_of(checked_file(source.folder / name)) for name in (ADAPTERS, BASE)}
    return source.digests()


def identity(source: ModelSource, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a run and logit shards record of their teacher: where it was (for messages), its
    weights (each file's sha256), its tokenizer's fingerprint and its shape (a hash of its
    config); two teachers are the same when all but the path agree."""
    config = {
        k: v for k, v in to_dict(source.config()).items() if k != "block_size"
    }  # a cut context is the same model
    shape = json.dumps(config, sort_keys=True)
    return {
        "path": str(source.path.resolve()),
        "kind": source.kind,
        "sha256": digests(source),
        "tokenizer": tokenizer.fingerprint,
        "config": hashlib.sha256(shape.encode()).hexdigest()[:16],
    }


def same_teacher(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two identities name the same model (wherever its files are now)."""
    return all(a.get(key) == b.get(key) for key in ("sha256", "tokenizer", "config"))


def named(ident: dict[str, Any]) -> str:
    """A teacher's identity in a message: its path and the start of its weights' hash."""
    digests = ident.get("sha256") if isinstance(ident.get("sha256"), dict) else {}
    first = next(iter(digests.values()), "") if digests else ""
    return f"{ident.get('path')} (sha256 {str(first)[:12]})"


def student_tokenizer(
    teacher: Tokenizer, student: Tokenizer | None, teacher_path: Path, where: str
) -> Tokenizer:
    """The student's tokenizer: the teacher's for a new student; one line when a student's own
    (``where``: --init-from, the resumed run) has another vocabulary than the teacher's."""
    if student is None:
        return teacher
    if student.hf.get_vocab(with_added_tokens=True) != teacher.hf.get_vocab(with_added_tokens=True):
        raise LmcliError(
            f"the student ({where}) has another vocabulary ({student.vocab_size} tokens) than the "
            f"teacher {teacher_path} ({teacher.vocab_size} tokens): distillation compares their "
            "distributions token by token, so both need one tokenizer"
        )
    return student


@dataclass
class TeacherModel:
    """A teacher loaded for inference: its model (eval mode, its own precision), tokenizer and
    identity; ``vocab``: the tokens compared (the tokenizer's: a model may have more rows)."""

    source: ModelSource
    model: Transformer
    tokenizer: Tokenizer
    ident: dict[str, Any]

    @classmethod
    def open(cls, source: ModelSource, device: torch.device) -> TeacherModel:
        """Load ``source`` on ``device`` as stored (one line when it does not load)."""
        try:
            ckpt = load_model(source, device, as_stored=device.type == "cpu")
        except LmcliError as exc:
            raise LmcliError(f"--teacher {source.path} does not load: {exc}") from None
        for p in ckpt.model.parameters():
            p.requires_grad_(False)
        return cls(source, ckpt.model.eval(), ckpt.tokenizer, identity(source, ckpt.tokenizer))

    @property
    def vocab(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def nbytes(self) -> int:
        """Bytes of its weights and tables, as held (quantized blocks at their size)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def precision(self) -> str:
        """How its weights are held, in words: a dtype, or a GGUF file's blocks as stored."""
        blocks = {type(m).__name__ for m in self.model.modules() if type(m).__name__.startswith("Block")}
        floats = [t.dtype for t in self.model.parameters() if t.is_floating_point()]
        dtype = str(floats[0] if floats else torch.float32).removeprefix("torch.")
        return f"{dtype}, GGUF blocks as stored" if blocks else dtype

    @torch.no_grad()
    def logprobs(
        self,
        x: Tensor,
        temperature: float = 1.0,
        index: Tensor | None = None,
        document: Tensor | None = None,
    ) -> Tensor:
        """Log-probabilities (float32) of the next token over the vocabulary at every position of
        ``x`` (B, T) -> (B, T, V), or at the flat positions ``index`` (N,) -> (N, V), softened
        by ``temperature``; ``document``: each input's document in its window (the attention kept
        within each, as the student's)."""
        logits = self.model(x, output_index=index, document=document)
        logits = logits[..., : self.vocab].float()
        return torch.log_softmax(logits / temperature, dim=-1)
