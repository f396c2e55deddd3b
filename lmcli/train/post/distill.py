"""``--task distill``: a student learns its teacher's next-token distributions, one method object
(``Distill``) and its config section's options (``DistillConfig``: ``--teacher``,
``--distill-loss``, ``--distill-beta``, ``--distill-temperature``, ``--distill-alpha``,
``--on-policy``, ``--on-policy-tokens``, ``--init-from-teacher-layers``, ``--student-layers``).

A micro-batch is ``--batch-size`` windows of the corpus, as a language model reads them; the
teacher's distributions at their positions come from the teacher run beside the student (in
its own precision, without gradients) or, when the corpus is a token folder that holds them
(``lmcli tokenize --teacher``), from its logit shards: then the windows start on the shards'
grid, so the student sees the very context the teacher saw. With ``--on-policy F`` the last
``F`` of a micro-batch's rows are the student's own: each keeps the start of its window as a
prompt and the student samples the rest (the row engine, seeded by the step as GRPO's
rollouts: a resume samples the same tokens); the teacher scores them token by token. The loss
is ``divergence.distill_loss``. A validation: the student's loss and perplexity on the held-out
windows (what ``best/`` follows, comparable with any run's) and, when the teacher runs, the
divergence from it there.

``student_start`` gives a run its tokenizer and starting model before its data is read: the
teacher's tokenizer (a student of another vocabulary refused) and, with
``--init-from-teacher-layers``/``--student-layers``, a student cut from the teacher's blocks.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.config.commands import SampleConfig
from lmcli.config.train import TrainConfig
from lmcli.data.logit_shards import LogitFolder, gather, open_logit_folder
from lmcli.data.preferences import PromptData
from lmcli.data.token_shards import is_token_folder, open_token_folder
from lmcli.data.train_data import StreamData, TrainData
from lmcli.data.windows import IGNORE, Batch, WindowSampler
from lmcli.device import autocast
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import Checkpoint
from lmcli.model.kv_cache import cache_dtype, kv_bytes
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer
from lmcli.train.init_from import Init, open_cut
from lmcli.train.losses import evaluate_loss
from lmcli.train.post.divergence import DistillOut, Targets, distill_loss, divergence
from lmcli.train.post.rollouts import rollout_seed, sample_groups
from lmcli.train.post.teacher import (
    TeacherModel,
    identity,
    named,
    same_teacher,
    source_tokenizer,
    student_tokenizer,
    teacher_source,
)
from lmcli.train.preflight import fmt_bytes, fmt_count
from lmcli.train.run import Method, Run
from lmcli.train.state import Stateful


def student_start(
    cfg: TrainConfig,
    resumed: Checkpoint | None,
    init: Init | None,
    info: Callable[[str], None],
    block_size: int,
) -> tuple[Init | None, Tokenizer | None]:
    """A run's starting model and tokenizer (None: a new one, trained on the corpus): the
    resumed run's or ``--init-from``'s; with ``--teacher``, the teacher's tokenizer (a student's
    own must be the same vocabulary) and, cut from the teacher, a new run's student."""
    tokenizer = resumed.tokenizer if resumed else init.tokenizer if init else None
    distill = cfg.distill
    if not distill.teacher:
        return init, tokenizer
    source = teacher_source(distill.teacher)
    theirs = source_tokenizer(source)
    if distill.cut and resumed is None:
        init = open_cut(source, distill.layers, distill.student_layers, info, block_size)
        return init, theirs
    where = "the resumed run" if resumed is not None else f"--init-from {cfg.init_from}"
    return init, student_tokenizer(theirs, tokenizer, source.path, where)


@dataclass(frozen=True)
class DistillSettings:
    """The loss's options (``divergence.distill_loss``) and the on-policy rows."""

    kind: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    alpha: float = 1.0
    fraction: float = 0.0  # --on-policy
    tokens: int = 0  # tokens sampled per on-policy row (0: half the context)

    def own_rows(self, batch_size: int) -> int:
        """Rows of a micro-batch the student samples: ``fraction`` of them, at least one when
        the fraction is above 0."""
        return 0 if not self.fraction else min(batch_size, max(1, round(self.fraction * batch_size)))

    def sampled_tokens(self, block_size: int) -> int:
        return self.tokens or block_size // 2


@dataclass
class Micro:
    """One micro-batch: the windows (data rows first, then the student's own samples), the
    flat positions the loss reads (``batch.index``: every data position, then each sample's;
    None without samples: every position), the teacher's side of each, and the share of the
    rows that are samples."""

    batch: Batch
    n_data: int  # positions of the data rows (the first of the index)
    teacher: Targets | None  # the data rows' (None: every row sampled)
    sampled: Targets | None  # the samples' (None: no on-policy rows)
    fraction: float


class TeacherRecord:
    """The teacher's identity in the trainer state: a resume against another teacher (other
    weights, tokenizer or shape, wherever its files are now) is refused in one line."""

    def __init__(self, ident: dict[str, Any]) -> None:
        self.ident = ident

    def state_dict(self) -> dict[str, str]:
        return {"identity": json.dumps(self.ident, sort_keys=True)}

    def load_state_dict(self, state: dict[str, str]) -> None:
        saved = json.loads(state["identity"])
        if not same_teacher(saved, self.ident):
            raise LmcliError(
                f"this run was distilled from {named(saved)}; --teacher {named(self.ident)} is another "
                "model (other weights, tokenizer or shape): resume with the run's own teacher"
            )


def offline_logits(cfg: TrainConfig) -> LogitFolder | None:
    """The teacher logits beside the corpus's token shards, when the corpus is one token folder
    that holds them."""
    corpus = cfg.data.corpus
    if len(corpus) != 1 or not is_token_folder(Path(corpus[0])):
        return None
    return open_logit_folder(open_token_folder(corpus[0]))


class Distill(Method[Micro]):
    """``--task distill`` (see the module doc): each micro-batch's loss against the teacher's
    distributions, run beside the student or read from logit shards; validation: the
    student's held-out loss (``best/`` follows it) and its divergence from the teacher."""

    shown = (("kl", "kl", ".4f"), ("on_policy_kl", "on-policy kl", ".4f"))

    def __init__(
        self,
        settings: DistillSettings,
        ident: dict[str, Any],
        teacher: TeacherModel | None,
        logits: LogitFolder | None,
        data: StreamData,
        cfg: TrainConfig,
    ) -> None:
        self.settings, self.ident, self.teacher, self.logits = settings, ident, teacher, logits
        self.data, self.cfg = data, cfg
        self.pieces = logits.pieces() if logits is not None else []
        self.vocab = data.tokenizer.vocab_size
        self._sums: dict[str, Tensor] = {}
        self._counts: dict[str, int] = {}

    @classmethod
    def open(
        cls, cfg: TrainConfig, model: Transformer, resumed: Checkpoint | None, data: TrainData | PromptData
    ) -> Distill:
        """The method of a run: the teacher loaded (unless its logits are read and no row is
        sampled), the logit shards checked against it and the run."""
        assert isinstance(data, StreamData)
        d = cfg.distill
        settings = DistillSettings(
            d.distill_loss,
            d.distill_beta,
            d.distill_temperature,
            d.distill_alpha,
            d.on_policy,
            d.on_policy_tokens,
        )
        assert d.teacher is not None  # --task distill needs it (tasks.Distillation.check)
        source = teacher_source(d.teacher)
        logits = offline_logits(cfg)
        device = next(model.parameters()).device
        teacher = TeacherModel.open(source, device) if logits is None or d.on_policy else None
        ident = teacher.ident if teacher is not None else identity(source, source_tokenizer(source))
        check_run(cfg, data, settings, teacher, ident, logits)
        return cls(settings, ident, teacher, logits, data, cfg)

    def sampler(self, data: TrainData | PromptData, batch_size: int, seed: int) -> Any:
        """Windows as a language model reads them; on the logit shards' grid when they are read."""
        assert isinstance(data, StreamData)
        if self.logits is None:
            return data.sampler(batch_size, seed)
        return WindowSampler(
            data.train, data.block_size, seed, documents=data.documents, grid=self.logits.context
        )

    # ------------------------------------------------------------------ a step

    def micro_batches(self, run: Run) -> Iterator[Micro]:
        """This rank's ``grad_accum`` micro-batches of windows, each with the teacher's side
        (and its rows the student samples, seeded by the step, the rank and the row)."""
        state, size = run.state, self.cfg.optim.batch_size
        own = self.settings.own_rows(size)
        accum = self.cfg.optim.grad_accum
        seed = rollout_seed(
            self.cfg.seed, state.step, run.dist.rank, run.dist.world_size, max(accum * own, 1)
        )
        for micro in range(accum):
            first = state.cursor + run.dist.rank * size
            starts = run.sampler.window_starts(first, size)
            batch = run.sampler.batch(first, size)
            state.cursor += run.global_batch
            yield self.prepared(run, batch, starts, own, seed + micro * own)

    def prepared(self, run: Run, batch: Batch, starts: list[int], own: int, seed: int) -> Micro:
        """A micro-batch's windows laid out for the loss: its last ``own`` rows replaced by the
        student's samples, the positions read, the teacher's side of each, on the device."""
        size, T = batch.x.shape
        n_rows, n_data = size - own, (size - own) * T
        if own:  # the scored positions: every data row's, then the samples'
            sampled_x, sampled_y, positions = self.samples(run, batch.x[n_rows:], seed)
            index = torch.cat([torch.arange(n_data), positions + n_data])
            batch = Batch(
                torch.cat([batch.x[:n_rows], sampled_x]),
                torch.cat([batch.y[:n_rows], sampled_y]),
                index=index,
            )
        laid = batch.to(run.device, run.staging)  # without samples: every position, no index
        teacher = sampled = None
        if self.logits is not None:
            teacher = self.offline(starts[:n_rows], T, run.device) if n_rows else None
            if own:
                sampled = self.online(laid.x[n_rows:], laid.index[n_data:] - n_data, None)
        else:
            both = self.online(laid.x, laid.index, laid.document).logp.view(-1, self.vocab)
            teacher = Targets(both[:n_data]) if n_rows else None
            sampled = Targets(both[n_data:]) if own else None
        return Micro(laid, n_data, teacher, sampled, own / size)

    def online(self, x: Tensor, index: Tensor, document: Tensor | None) -> Targets:
        """The teacher's log-probs at the flat positions ``index`` of ``x`` (N, V)."""
        assert self.teacher is not None
        return Targets(self.teacher.logprobs(x, self.settings.temperature, index, document))

    def offline(self, starts: list[int], length: int, device: torch.device) -> Targets:
        """The teacher's top-K (or draws) of the data rows' positions, read from the logit shards."""
        ids, logp, rest = gather(self.pieces, self.data.train, starts, length)  # (B, T, K), (B, T, K), (B, T)
        k = ids.shape[-1]
        return Targets(
            torch.from_numpy(logp).view(-1, k).to(device),  # (B, T, K) -> (N, K)
            torch.from_numpy(ids).view(-1, k).to(device),
            None if rest is None else torch.from_numpy(rest).view(-1).to(device),
            drawn=rest is None,
        )

    def samples(self, run: Run, windows: Tensor, seed: int) -> tuple[Tensor, Tensor, Tensor]:
        """The student's own rows: each window's first ``T - n`` tokens as a prompt, ``n``
        tokens sampled after it (temperature 1, row ``j`` seeded ``seed + j``), as inputs (R, T)
        and targets (R, T) (the samples', ``IGNORE`` elsewhere) and the flat positions (N_s,)
        of the samples' targets."""
        R, T = windows.shape
        n = self.settings.sampled_tokens(T)
        prompts = windows[:, : T - n].tolist()
        sample = SampleConfig(max_new_tokens=n, temperature=1.0, seed=seed)
        replies = sample_groups(run.model, self.data.tokenizer, prompts, 1, sample)
        x = torch.full((R, T), self.data.tokenizer.pad_id, dtype=torch.long)
        y = torch.full((R, T), IGNORE, dtype=torch.long)
        positions = []
        for r, (prompt, row) in enumerate(zip(prompts, replies, strict=True)):
            reply = row.ids + ([self.data.tokenizer.eos_id] if row.finish_reason == "eos" else [])
            sequence = torch.tensor(prompt + reply, dtype=torch.long)
            x[r, : len(sequence) - 1] = sequence[:-1]
            y[r, len(prompt) - 1 : len(sequence) - 1] = sequence[len(prompt) :]
            positions.append(r * T + torch.arange(len(prompt) - 1, len(sequence) - 1))
        return x, y, torch.cat(positions)

    def loss(self, model: nn.Module, micro: Micro) -> Tensor:
        """The micro-batch's share of the step's loss (``divergence.distill_loss`` / grad_accum)."""
        batch = micro.batch
        logits = model(batch.x, output_index=batch.index, document=batch.document)
        logits = logits[..., : self.vocab].reshape(-1, self.vocab)  # (B, T, V) or (N, V) -> (N, V)
        targets = batch.y.reshape(-1)[: micro.n_data]  # (N_d,): the data rows' every position
        s = self.settings
        out = distill_loss(
            logits,
            targets,
            micro.teacher,
            micro.sampled,
            kind=s.kind,
            beta=s.beta,
            temperature=s.temperature,
            alpha=s.alpha,
            fraction=micro.fraction,
        )
        self.add(out, micro)
        return out.loss / self.cfg.optim.grad_accum

    def add(self, out: DistillOut, micro: Micro) -> None:
        """The step's quantities, summed on the device (read at the next log point)."""
        values = {"kl": out.kl, "ce": out.ce} if micro.teacher is not None else {}
        if out.on_policy_kl is not None:
            values["on_policy_kl"] = out.on_policy_kl
        for key, value in values.items():
            self._sums[key] = self._sums.get(key, 0) + value
            self._counts[key] = self._counts.get(key, 0) + 1

    def logged(self) -> dict[str, float]:
        """The means since the last log point: the divergence from the teacher (``kl``), the
        data's cross-entropy (``ce``), the samples' reverse KL (``on_policy_kl``)."""
        out = {key: float(total) / self._counts[key] for key, total in self._sums.items()}
        self._sums, self._counts = {}, {}
        return out

    # ------------------------------------------------------------------ validation

    def validate(self, run: Run) -> tuple[float, dict[str, float]]:
        """The student's loss on the validation windows (``best/`` follows it) and, when the
        teacher runs, the divergence from it there (``val_kl``)."""
        loss, kl = evaluate_distill(run, self.teacher, self.settings, self.vocab)
        record = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50))}
        if kl is not None:
            record["val_kl"] = kl
        return loss, record

    def summary(self, record: dict[str, Any]) -> str:
        words = f"val loss {record['val_loss']:.4f} (ppl {record['val_ppl']:.2f})"
        return words + (f", kl from the teacher {record['val_kl']:.4f}" if "val_kl" in record else "")

    # ------------------------------------------------------------------ what the run keeps and shows

    def parts(self) -> dict[str, Stateful]:
        return {"teacher": TeacherRecord(self.ident)}

    def describe(self) -> dict[str, str]:
        s, rows = self.settings, {}
        if self.teacher is not None:
            t = self.teacher
            params = fmt_count(sum(p.numel() for p in t.model.parameters()))
            rows["teacher"] = f"{t.source.path}: {params} parameters, {t.precision}, {fmt_bytes(t.nbytes)}"
        else:
            rows["teacher"] = f"{self.ident['path']} (not loaded: its logits are read)"
        how = f"{s.kind}" + (f" (beta {s.beta:g})" if s.kind == "jsd" else "")
        how += f" at temperature {s.temperature:g}, alpha {s.alpha:g}"
        own = s.own_rows(self.cfg.optim.batch_size)
        if own:
            n = s.sampled_tokens(self.data.block_size)
            size = self.cfg.optim.batch_size
            how += f"; on-policy: {own} of {size} rows sampled by the student ({n} tokens), reverse KL"
        rows["distillation"] = how
        if self.logits is not None:
            lf = self.logits
            rows["teacher logits"] = (
                f"{lf.label} from {lf.path} ({lf.bytes_per_token} bytes a token), windows on their "
                f"{lf.context}-token grid"
            )
        return rows

    def memory(self, run: Run, shards: int) -> int:
        """The student's step, the teacher's weights and its forward's logits (three float32
        copies of a micro-batch's), the samples' decoding cache."""
        size, T = self.cfg.optim.batch_size, self.data.block_size
        step = super().memory(run, shards)
        if self.teacher is None:
            k = self.logits.top_k if self.logits is not None else 0
            return step + size * T * k * 16  # the gathered K tokens, as int64 ids and float32 log-probs
        c = self.teacher.model.config
        forward = size * T * (3 * self.vocab + 4 * c.n_embd + c.ffn_dim) * 4
        own = self.settings.own_rows(size)
        itemsize = torch.empty((), dtype=cache_dtype(run.model)).element_size()
        decoding = own * (kv_bytes(run.model.config, T, itemsize) + 4 * self.vocab * 4)
        return step + self.teacher.nbytes + forward + decoding

    def extra_seconds(self, run: Run) -> float:
        """A step's teacher forwards and samples, timed on one micro-batch (the second of two
        calls), times ``grad_accum``; nothing when the logits are read and no row is sampled."""
        if self.teacher is None:
            return 0.0
        size, accum = self.cfg.optim.batch_size, self.cfg.optim.grad_accum
        x = run.sampler.batch(0, size).x.to(run.device)
        own = self.settings.own_rows(size)
        seconds = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            self.teacher.logprobs(x, self.settings.temperature)
            if own:
                self.samples(run, x[size - own :], 0)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        return seconds * accum


@torch.no_grad()
def evaluate_distill(
    run: Run, teacher: TeacherModel | None, settings: DistillSettings, vocab: int
) -> tuple[float, float | None]:
    """The student's mean loss on the validation windows and, when the teacher runs, the mean
    divergence of its distributions from the teacher's there (at the run's temperature), both
    across ranks, over the windows ``evaluate_loss`` reads."""
    if teacher is None:
        return evaluate_loss(run.model, run.data, run.cfg, run.device, run.amp, run.dist), None
    model, cfg, dist = run.model, run.cfg, run.dist
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss, divergence, positions
    size = cfg.optim.batch_size
    limit = cfg.validation.eval_batches * size * dist.world_size
    for host in run.data.val_batches(size, limit, dist.rank, dist.world_size):
        batch = host.to(run.device)
        with autocast(run.device, run.amp):
            logits = model(batch.x, document=batch.document)
        logits = logits[..., :vocab].float().reshape(-1, vocab)  # (B, T, V) -> (N, V)
        targets = batch.y.reshape(-1)
        theirs = teacher.logprobs(batch.x, settings.temperature, None, batch.document).reshape(-1, vocab)
        mine = torch.log_softmax(logits / settings.temperature, dim=-1)
        scored = targets != IGNORE
        sums[0] += F.cross_entropy(logits, targets, reduction="sum")
        sums[1] += divergence(settings.kind, mine, theirs, settings.beta)[scored].sum()
        sums[2] += scored.sum()
    if dist.enabled:
        torch.distributed.all_reduce(sums)
    model.train(was_training)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def check_run(
    cfg: TrainConfig,
    data: StreamData,
    settings: DistillSettings,
    teacher: TeacherModel | None,
    ident: dict[str, Any],
    logits: LogitFolder | None,
) -> None:
    """One line for what this run cannot do with this teacher or these logits (before training)."""
    T = data.block_size
    if teacher is not None and T > teacher.model.config.block_size:
        raise LmcliError(
            f"--block-size {T} is longer than the teacher's context ({teacher.model.config.block_size} "
            "tokens): it reads each window whole"
        )
    n = settings.sampled_tokens(T)
    if settings.fraction and n >= T:
        raise LmcliError(f"--on-policy-tokens {n} leaves no prompt in a context of {T} tokens")
    if settings.fraction and data.documents:
        raise LmcliError(
            "--on-policy: the student's samples are not split into documents: drop --document-mask"
        )
    if logits is None:
        return
    where = logits.path
    if not same_teacher(logits.teacher, ident):
        raise LmcliError(
            f"the teacher logits in {where} are of {named(logits.teacher)}, not of --teacher "
            f"{named(ident)}: compute them with this teacher (lmcli tokenize --teacher) or give theirs"
        )
    if not math.isclose(logits.temperature, settings.temperature, rel_tol=1e-9):
        raise LmcliError(
            f"the teacher logits in {where} are at temperature {logits.temperature:g}: give "
            f"--distill-temperature {logits.temperature:g}, or compute them at {settings.temperature:g}"
        )
    if T > logits.context:
        raise LmcliError(
            f"--block-size {T} is longer than the context the teacher logits in {where} were computed "
            f"with ({logits.context} tokens): give --block-size {logits.context} or less"
        )
    if data.align or data.documents:
        raise LmcliError(
            f"--align-documents and --document-mask: the teacher logits in {where} were computed in "
            "chunks across documents: the windows start on their grid"
        )
    if logits.kind == "sampled" and settings.kind != "forward_kl":
        raise LmcliError(
            f"--distill-loss {settings.kind}: the teacher logits in {where} are tokens drawn from the "
            "teacher, which estimate only the forward KL: give --distill-loss forward_kl, or compute "
            "top-K logits (lmcli tokenize --logits top)"
        )
    logits.check_ids(data.tokenizer.vocab_size)
