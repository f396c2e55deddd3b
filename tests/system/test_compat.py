"""A run folder written by lmcli 0.1 (before the package was reshaped) still loads, samples and
resumes: weight names, config fields and trainer state are read as they were written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers import TINY_TEXT, run_cli

from lmcli.formats.sources import load_checkpoint

OLD_RUN = Path(__file__).parents[1] / "fixtures" / "lmcli-0.1-run"


def test_a_checkpoint_of_lmcli_0_1_gives_the_logits_it_gave_then() -> None:
    expected = json.loads((OLD_RUN / "expected.json").read_text())
    ckpt = load_checkpoint(OLD_RUN / "last")
    assert ckpt.tokenizer.encode(expected["text"]) == expected["ids"]
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([expected["ids"]]))[0, -1]
    torch.testing.assert_close(logits, torch.tensor(expected["last_logits"]), rtol=0, atol=2e-6)


def test_a_run_of_lmcli_0_1_resumes_and_samples(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    (tmp_path / "corpus.txt").write_text(TINY_TEXT)  # the run's corpus, moved: given again
    corpus = [str(tmp_path / "corpus.txt"), "--allow-new-data"]  # another path: said explicitly
    code, _, err = run_cli(["train", "--resume", str(run), *corpus, "--max-steps", "6", "-q"], capsys)
    assert code == 0, err
    assert json.loads((run / "last" / "meta.json").read_text())["step"] == 6
    # written before --vocab-multiple: no padding, and the resumed run now records that
    assert load_checkpoint(OLD_RUN / "last").model_config.vocab_multiple == 1
    assert json.loads((run / "last" / "config.json").read_text())["model"]["vocab_multiple"] == 1
    code, out, err = run_cli(["sample", str(run), "-p", "the", "--max-new-tokens", "5"], capsys)
    assert code == 0 and out.startswith("the"), err
