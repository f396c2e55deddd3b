"""Distillation's parts on tiny models: a student cut from a teacher holds exactly the chosen blocks
(any family: lmcli's own names of a Hugging Face folder's weights), each block keeping its kind;
the teacher logits ``lmcli tokenize --teacher`` stores are the top-K of the full softmax and the
mass left, 4 K + 2 bytes a token; with K = the vocabulary, the loss read from them equals the loss
of the teacher run beside the student (to float16's rounding) on the windows a run reads; sampled
logits are K draws from the teacher's distribution and its log-probs of them, 4 K bytes a token,
the same bytes from a resumed writer as from an uninterrupted one."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_TEXT, make_run, tiny_model, tiny_tokenizer, train_config

from lmcli.config.commands import TokenizeConfig
from lmcli.config.files import from_dict
from lmcli.data.logit_shards import bytes_per_token, gather, open_logit_folder
from lmcli.data.token_shards import file_check, open_token_folder
from lmcli.data.windows import WindowSampler
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.model_source import model_source
from lmcli.formats.sources import load_model
from lmcli.train.init_from import open_cut, spaced_layers
from lmcli.train.post.divergence import Targets, distill_loss, top_k
from lmcli.train.post.teacher import TeacherModel
from lmcli.train.post.teacher_logits import tokenize_with_teacher

sys.path.insert(0, str(Path(__file__).parents[1] / "formats"))
from families import hf_folder  # noqa: E402


def quiet(msg: str) -> None:
    pass


def test_evenly_spaced_blocks_keep_the_first_and_the_last() -> None:
    assert spaced_layers(8, 4) == (0, 2, 5, 7)
    assert spaced_layers(6, 3) == (0, 3, 5)  # 2.5 rounds up
    assert spaced_layers(4, 4) == (0, 1, 2, 3) and spaced_layers(5, 1) == (0,)


def test_a_cut_student_copies_exactly_the_chosen_blocks(tmp_path: Path) -> None:
    teacher = load_model(make_run(tmp_path / "teacher", n_layer=4)).model
    student = open_cut(model_source(tmp_path / "teacher"), (0, 3), 0, quiet, None).load(False)[0]
    assert student.config.n_layer == 2 and student.config.n_embd == teacher.config.n_embd
    mine, theirs = student.state_dict(), teacher.state_dict()
    for name, value in mine.items():
        source = name.replace("h.1.", "h.3.") if name.startswith("h.1.") else name
        assert torch.equal(value, theirs[source]), name
    kept = {n for n in theirs if not n.startswith(("h.1.", "h.2.", "h.3."))}
    assert set(mine) == kept | {n.replace("h.3.", "h.1.") for n in theirs if n.startswith("h.3.")}


def test_a_cut_of_a_windowed_hugging_face_family_keeps_each_blocks_kind(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path, "gemma3-window-scaled")
    source = model_source(folder)
    teacher = load_model(folder).model
    layers = tuple(range(teacher.config.n_layer))[-2:]  # the last two: a local and a global block
    student = open_cut(source, layers, 0, quiet, None).load(False)[0]
    for j, i in enumerate(layers):
        assert student.config.is_local(j) == teacher.config.is_local(i)
        assert student.config.is_rotary(j) == teacher.config.is_rotary(i)
        for name, value in student.h[j].state_dict().items():
            torch.testing.assert_close(value, teacher.h[i].state_dict()[name], rtol=0, atol=0)
    assert {teacher.config.is_local(i) for i in layers} == {True, False}
    assert torch.equal(student.wte.weight, teacher.wte.weight)


def test_blocks_the_teacher_does_not_have_are_one_line(tmp_path: Path) -> None:
    source = model_source(make_run(tmp_path / "teacher", n_layer=2))
    with pytest.raises(LmcliError, match="the teacher .* has blocks 0 to 1"):
        open_cut(source, (0, 2), 0, quiet, None)
    with pytest.raises(LmcliError, match="give each block once, in increasing order"):
        open_cut(source, (1, 0), 0, quiet, None)
    with pytest.raises(LmcliError, match="--student-layers 3: the teacher .* has 2 blocks"):
        open_cut(source, (), 3, quiet, None)


def peaked_run(out: Path, scale: float = 30) -> Path:
    """A tiny teacher whose (tied) embedding is scaled up: peaked distributions, no near-ties
    (``scale`` 30; 3: spread ones)."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, n_layer=2, block_size=32)
    with torch.no_grad():
        model.wte.weight.mul_(scale)
    for name in ("last", "best"):
        save_checkpoint(out / name, model, train_config(), tok, meta={"step": 0})
    return out


def logits_of(tmp_path: Path, k: int, block: int = 16, kind: str = "top", scale: float = 30):
    """A tiny teacher and its logits of a corpus."""
    run = peaked_run(tmp_path / "teacher", scale)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT)
    options = dict(corpus=(str(corpus),), teacher=str(run), top_k=k, block_size=block, logits=kind)
    cfg = from_dict(TokenizeConfig, {**options, "out": str(tmp_path / "tok")})
    folder, logits = tokenize_with_teacher(cfg, progress=False, info=quiet)
    return TeacherModel.open(model_source(run), torch.device("cpu")), folder, logits


def test_stored_logits_are_the_top_k_of_the_full_softmax_and_the_rest(tmp_path: Path) -> None:
    teacher, folder, logits = logits_of(tmp_path, k=5)
    V = teacher.vocab
    assert logits.bytes_per_token == bytes_per_token(5, V) == 4 * 5 + 2  # uint16 ids, float16 log-probs
    assert (tmp_path / "tok" / "shard-00000.top-ids").stat().st_size == folder.n_tokens * 5 * 2
    piece = logits.pieces()[0]
    tokens = folder.stream().pieces[0].tokens
    x = torch.from_numpy(np.asarray(tokens[16:48], dtype=np.int64)).view(2, 16)  # chunks 1 and 2
    exact = teacher.logprobs(x).view(32, V)
    ids, values, rest = top_k(exact, 5)
    assert torch.equal(torch.from_numpy(np.asarray(piece.ids[16:48], dtype=np.int64)), ids)
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(piece.logp[16:48], dtype=np.float32)), values, atol=4e-3, rtol=1e-3
    )
    left = 1 - values.exp().sum(-1)  # the rest: the mass the five leave
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(piece.rest[16:48], dtype=np.float32)).exp(), left, atol=1e-3, rtol=2e-3
    )


def test_offline_equals_online_for_k_equal_to_the_vocabulary(tmp_path: Path) -> None:
    """On the windows an offline run reads (on the logits' grid), the loss from the stored logits
    (K = V) equals the loss against the teacher run beside the student, to float16's rounding."""
    teacher, folder, logits = logits_of(tmp_path, k=tiny_tokenizer().vocab_size)
    stream = folder.stream()
    sampler = WindowSampler(stream, 16, seed=3, grid=logits.context)
    starts = sampler.window_starts(0, 6)
    assert all(s % 16 == 0 for s in starts)  # chunk starts: the teacher's context is the window's
    batch = sampler.batch(0, 6)
    ids, logp, rest = gather(logits.pieces(), stream, starts, 16)
    K = ids.shape[-1]
    offline = Targets(
        torch.from_numpy(logp).view(-1, K), torch.from_numpy(ids).view(-1, K), torch.from_numpy(rest).view(-1)
    )
    online = Targets(teacher.logprobs(batch.x).view(-1, teacher.vocab))
    torch.manual_seed(0)
    student = torch.randn(6 * 16, teacher.vocab)
    targets = batch.y.reshape(-1)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        a = distill_loss(student, targets, offline, kind=kind, temperature=1.0).loss
        b = distill_loss(student, targets, online, kind=kind, temperature=1.0).loss
        assert a.item() == pytest.approx(b.item(), rel=2e-3), kind


def test_the_logits_writer_resumes_and_damaged_or_foreign_logits_are_one_line(tmp_path: Path) -> None:
    run = peaked_run(tmp_path / "teacher")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT * 10)  # pieces of 4 KiB: a shard each
    options = dict(corpus=(str(corpus),), teacher=str(run), top_k=4, block_size=16, shard_tokens=1000)
    cfg = from_dict(TokenizeConfig, {**options, "out": str(tmp_path / "tok")})
    folder, first = tokenize_with_teacher(cfg, progress=False, info=quiet)
    assert len(folder.index["shards"]) >= 3
    written = {p.name: p.read_bytes() for p in (tmp_path / "tok").glob("shard-*.top-*")}
    # a writer killed in the third shard: the record, its files and the next shards' are gone
    (tmp_path / "tok" / "teacher.json").unlink()
    for p in (tmp_path / "tok").glob("shard-0000[2-9].top*"):
        p.unlink()
    with pytest.raises(LmcliError, match="are unfinished: run the same lmcli tokenize --teacher again"):
        open_logit_folder(open_token_folder(tmp_path / "tok"))
    said: list[str] = []
    _, again = tokenize_with_teacher(cfg, progress=False, info=said.append)
    assert said == [f"teacher logits in {tmp_path / 'tok'}: resuming, 2 finished shard(s) kept"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "tok").glob("shard-*.top-*")} == written
    assert again.record == first.record
    # logits of other tokens (the same text tokenized into another folder) and damaged files
    other = from_dict(TokenizeConfig, {**options, "shard_tokens": 10_000, "out": str(tmp_path / "other")})
    tokenize_with_teacher(other, progress=False, info=quiet)
    shutil.copy(tmp_path / "tok" / "teacher.json", tmp_path / "other" / "teacher.json")
    with pytest.raises(LmcliError, match="are of other tokens than its shards"):
        open_logit_folder(open_token_folder(tmp_path / "other"))
    # an id past the vocabulary, its checksums made to match (a crafted folder)
    ids = tmp_path / "tok" / "shard-00000.top-ids"
    ids.write_bytes(np.full(ids.stat().st_size // 2, 60_000, dtype="<u2").tobytes())
    record = json.loads((tmp_path / "tok" / "teacher.json").read_text())
    record["shards"][0]["check"]["top-ids"] = file_check(ids)
    (tmp_path / "tok" / "teacher.json").write_text(json.dumps(record))
    crafted = open_logit_folder(open_token_folder(tmp_path / "tok"))
    with pytest.raises(LmcliError, match="shard-00000 holds token id 60000, outside the vocabulary of 25"):
        crafted.check_ids(25)
    logp = tmp_path / "tok" / "shard-00001.top-logp"
    logp.write_bytes(logp.read_bytes()[:-2] + b"\x00\x7c")  # the last value now +inf
    with pytest.raises(LmcliError, match=r"are damaged \(shard-00001.top-logp: size or checksum mismatch\)"):
        open_logit_folder(open_token_folder(tmp_path / "tok"))


def test_sampled_logits_are_draws_from_the_teacher_and_its_log_probs_of_them(tmp_path: Path) -> None:
    teacher, folder, logits = logits_of(tmp_path, k=400, kind="sampled", scale=3)
    V = teacher.vocab
    assert (
        logits.kind == "sampled" and logits.bytes_per_token == bytes_per_token(400, V, "sampled") == 4 * 400
    )
    record = json.loads((tmp_path / "tok" / "teacher.json").read_text())
    assert record["logits"] == "sampled" and record["version"] == 2
    logit_files = {p.name for p in (tmp_path / "tok").glob("shard-00000.*")} - {"shard-00000.bin"}
    assert {"shard-00000.drawn-ids", "shard-00000.drawn-logp", "shard-00000.drawn.json"} <= logit_files
    assert not any(".top" in name for name in logit_files)
    piece = logits.pieces()[0]
    assert piece.rest is None
    tokens = folder.stream().pieces[0].tokens
    x = torch.from_numpy(np.asarray(tokens[16:48], dtype=np.int64)).view(2, 16)  # chunks 1 and 2
    exact = teacher.logprobs(x).view(32, V)
    ids = torch.from_numpy(np.asarray(piece.ids[16:48], dtype=np.int64))  # (32, 400)
    assert int(ids.max()) < V
    stored = torch.from_numpy(np.asarray(piece.logp[16:48], dtype=np.float32))
    torch.testing.assert_close(stored, exact.gather(-1, ids), atol=4e-3, rtol=1e-3)
    p = exact.exp().double()
    counts = torch.zeros(32, V, dtype=torch.float64).scatter_add_(
        1, ids, torch.ones_like(ids, dtype=torch.float64)
    )
    freq = counts / 400
    # each token's frequency, summed over the 32 positions, within five standard errors of its mass
    errors = (p * (1 - p) / 400).sum(0).sqrt()
    assert ((freq - p).sum(0).abs() <= 5 * errors).all()
    assert ((freq - p).abs() < 0.1).all()  # and each position's (its standard error about 0.02)
    assert (freq[p < 1e-7] == 0).all() and (p.max(-1).values < 0.9).sum() > 16  # spread: draws vary


def test_the_sampled_estimate_on_a_runs_windows_is_the_online_forward_kl(tmp_path: Path) -> None:
    """On the windows an offline run reads, the loss from 400 draws a position is the loss against
    the teacher run beside the student, within five standard errors of the mean of its terms."""
    teacher, folder, logits = logits_of(tmp_path, k=400, kind="sampled", scale=3)
    stream = folder.stream()
    sampler = WindowSampler(stream, 16, seed=3, grid=logits.context)
    starts, batch = sampler.window_starts(0, 6), sampler.batch(0, 6)
    ids, logp, rest = gather(logits.pieces(), stream, starts, 16)
    assert rest is None
    K = ids.shape[-1]
    offline = Targets(torch.from_numpy(logp).view(-1, K), torch.from_numpy(ids).view(-1, K), drawn=True)
    online = Targets(teacher.logprobs(batch.x).view(-1, teacher.vocab))
    torch.manual_seed(0)
    student = torch.randn(6 * 16, teacher.vocab)
    targets = batch.y.reshape(-1)
    a = distill_loss(student, targets, offline).loss.item()
    b = distill_loss(student, targets, online).loss.item()
    terms = offline.logp - torch.log_softmax(student, -1).gather(-1, offline.ids)  # (96, 400)
    assert abs(a - b) <= 5 * terms.std().item() / terms.numel() ** 0.5, (a, b)
    with pytest.raises(ValueError, match="reverse_kl cannot be estimated"):
        distill_loss(student, targets, offline, kind="reverse_kl")


def test_the_sampled_logits_writer_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    run = peaked_run(tmp_path / "teacher")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT * 10)  # pieces of 4 KiB: a shard each
    options = dict(corpus=(str(corpus),), teacher=str(run), top_k=4, block_size=16, shard_tokens=1000)

    def write(out: str, **more: str) -> tuple:
        cfg = from_dict(TokenizeConfig, {**options, **more, "out": str(tmp_path / out)})
        return tokenize_with_teacher(cfg, progress=False, info=quiet)

    folder, first = write("tok", logits="sampled")
    assert len(folder.index["shards"]) >= 3
    written = {p.name: p.read_bytes() for p in (tmp_path / "tok").glob("shard-*.drawn*")}
    (tmp_path / "tok" / "teacher.json").unlink()  # a writer killed in the third shard
    for p in (tmp_path / "tok").glob("shard-0000[2-9].drawn*"):
        p.unlink()
    with pytest.raises(LmcliError, match="are unfinished: run the same lmcli tokenize --teacher again"):
        open_logit_folder(open_token_folder(tmp_path / "tok"))
    said: list[str] = []
    cfg = from_dict(TokenizeConfig, {**options, "logits": "sampled", "out": str(tmp_path / "tok")})
    _, again = tokenize_with_teacher(cfg, progress=False, info=said.append)
    assert said == [f"teacher logits in {tmp_path / 'tok'}: resuming, 2 finished shard(s) kept"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "tok").glob("shard-*.drawn*")} == written
    assert again.record == first.record
    # one kind a folder: top-K logits where sampled ones are, and sampled where top-K ones are
    with pytest.raises(
        LmcliError, match=r"holds the logits of .* \(4 draws, block size 16, temperature 1.0\)"
    ):
        write("tok")
    write("top")
    with pytest.raises(LmcliError, match=r"holds the logits of .* \(top-4, block size 16, temperature 1.0\)"):
        write("top", logits="sampled")
    # a record written before the kinds were (no "logits") is of top-K logits: read, and reused
    record = json.loads((tmp_path / "top" / "teacher.json").read_text())
    del record["logits"]
    (tmp_path / "top" / "teacher.json").write_text(json.dumps(record))
    old = open_logit_folder(open_token_folder(tmp_path / "top"))
    assert old is not None and old.kind == "top" and old.pieces()[0].rest is not None
    assert "logits" not in write("top")[1].record  # the same plan: the folder kept as it is


def test_the_progress_bar_shows_the_fields_each_method_declares() -> None:
    from lmcli.train.display import TrainProgress
    from lmcli.train.post.distill import Distill
    from lmcli.train.post.dpo import DPO

    shown: list[str] = []
    record = {"train_loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "elapsed": 1.0, "mfu": None}
    for method, fields, words in (
        (Distill, {"kl": 0.25, "on_policy_kl": 0.5}, "kl 0.2500  on-policy kl 0.5000"),
        (DPO, {"margin": 1.5, "accuracy": 0.75}, "margin 1.500  acc 0.75"),
    ):
        bar = TrainProgress(console=None)
        bar.shown = method.shown
        bar.progress = type(
            "P",
            (),
            {"tasks": [type("T", (), {"total": 4})()], "update": lambda s, t, **k: shown.append(k["stats"])},
        )()
        bar.update(2, {**record, **fields})
        assert words in shown[-1]
