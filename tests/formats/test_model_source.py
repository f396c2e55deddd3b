"""What a model source is, told once (``model_source``): each kind and the loader it is given, the
one-line errors for a path that is none of them, its weights one at a time (``tensors``) equal
to the loaded model's, and a LoRA run over a GGUF file, whose base every command finds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from families import hf_folder  # noqa: E402
from helpers import TINY_TEXT, assert_one_line_error, make_run, run_cli  # noqa: E402

from lmcli.errors import LmcliError  # noqa: E402
from lmcli.formats.checkpoint import ADAPTERS  # noqa: E402
from lmcli.formats.export.gguf import export_gguf  # noqa: E402
from lmcli.formats.model_source import model_source  # noqa: E402
from lmcli.formats.sources import load_model, read_model_config  # noqa: E402
from lmcli.formats.weights import model_state  # noqa: E402
from lmcli.train.init_from import init_source  # noqa: E402

LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One source of each kind: a run folder, its checkpoint, a Hugging Face folder, a GGUF file."""
    tmp = tmp_path_factory.mktemp("sources")
    run = make_run(tmp / "run", kind="bpe", **LLAMA)
    gguf = export_gguf(run, tmp / "model.gguf", "q8_0")
    return {"run": run, "checkpoint": run / "last", "hf": hf_folder(tmp, "qwen2-gqa-bias-yarn"), "gguf": gguf}


@pytest.mark.parametrize("kind", ["run", "checkpoint", "hf", "gguf"])
def test_each_kind_is_told_and_loaded_as_it(sources: dict[str, Path], kind: str) -> None:
    source = model_source(sources[kind])
    assert source.kind == kind and source.path == sources[kind]
    assert source.folder == {"run": sources["run"] / "best"}.get(kind, sources[kind])
    loaded = load_model(source)
    assert read_model_config(source) == source.config() == loaded.model.config
    assert load_model(sources[kind]).meta == loaded.meta  # a path is classified as its source is


def test_no_path_is_the_newest_run(sources: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LmcliError, match=r"^no run found under checkpoints/: give a run folder"):
        model_source(None)
    shutil.copytree(sources["run"], tmp_path / "checkpoints" / "a")
    assert model_source(None) == model_source(Path("checkpoints/a"))


def test_a_lora_run_is_told_by_its_adapters(sources: dict[str, Path], tmp_path: Path) -> None:
    run = shutil.copytree(sources["run"], tmp_path / "lora")
    (run / "best" / ADAPTERS).write_bytes(b"")
    assert model_source(run).kind == "lora" and model_source(run / "last").kind == "checkpoint"
    with pytest.raises(LmcliError, match=r"is a LoRA run: its weights are read whole"):
        next(model_source(run).tensors())


def test_a_path_that_is_no_source_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    cases = [
        (model_source, tmp_path / "gone", f"no such run or checkpoint folder: {tmp_path / 'gone'}"),
        (model_source, tmp_path / "plain", f"{tmp_path / 'plain'} is not an lmcli run or checkpoint folder"),
        (model_source, tmp_path / "notes.txt", f"{tmp_path / 'notes.txt'} is not an lmcli run or checkpoint"),
        (init_source, tmp_path / "gone", f"no such Hugging Face model folder: {tmp_path / 'gone'}"),
    ]
    for classify, path, message in cases:
        with pytest.raises(LmcliError) as exc:
            classify(path)
        assert str(exc.value).startswith(message)


@pytest.mark.parametrize("kind", ["run", "hf", "gguf"])
def test_tensors_one_at_a_time_are_the_loaded_weights(sources: dict[str, Path], kind: str) -> None:
    source = model_source(sources[kind])
    streamed = dict(source.tensors(torch.float32))
    loaded = model_state(load_model(source, dtype=torch.float32).model)
    assert streamed.keys() == loaded.keys()
    for name, value in loaded.items():
        assert torch.equal(streamed[name], value), name


def test_a_lora_run_over_a_gguf_file_finds_its_base(sources: dict[str, Path], tmp_path: Path, capsys) -> None:
    base = shutil.copy(sources["gguf"], tmp_path / "base.gguf")
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    run = tmp_path / "lora"
    argv = [
        *("train", str(tmp_path / "c.txt"), "--init-from", str(base), "-o", str(run), "--lora-rank", "2"),
        *("--cache-dir", str(tmp_path / "cache"), "--max-steps", "2", "--batch-size", "2", "-q"),
    ]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert model_source(run).kind == "lora" and load_model(run).model.config == model_source(base).config()
    code, out, err = run_cli(["verify", str(run)], capsys)  # the base's config read from its header
    assert code == 0 and out.count("ok  ") == 2, err
    Path(base).write_bytes(Path(base).read_bytes()[:-1] + b"\x01")
    code, _, err = run_cli(["sample", str(run), "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, f"the base model {Path(base).resolve()} changed since LoRA run")
