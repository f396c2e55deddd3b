"""Hugging Face interop: load a local model folder, export an lmcli checkpoint as one.

Neither direction needs ``transformers``; only the tests use it, to check that logits agree.
``gpt2.py`` holds GPT-2's config and weight layout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from lmcli.checkpoint import load_checkpoint
from lmcli.errors import LmcliError
from lmcli.hf import gpt2
from lmcli.model import Transformer
from lmcli.safe_io import temp_dir
from lmcli.tokenizer import Tokenizer


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder (config.json with a model_type), not an lmcli checkpoint."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "meta.json").exists():
        return False
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except ValueError:
        return False


def read_tokenizer(path: Path) -> Tokenizer:
    if (path / "tokenizer.json").exists():
        return Tokenizer.load(path / "tokenizer.json")
    if (path / "vocab.json").exists() and (path / "merges.txt").exists():
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        tok = HFTokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return Tokenizer(tok)
    raise LmcliError(f"{path} has no tokenizer.json (or vocab.json + merges.txt)")


def load_hf_folder(path: str | Path) -> tuple[Transformer, Tokenizer]:
    """A local Hugging Face model folder as our Transformer and Tokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise LmcliError(f"no such Hugging Face model folder: {path}")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LmcliError(f"cannot read {path / 'config.json'}: {exc}") from None
    if hf.get("model_type") != "gpt2":
        raise LmcliError(f"{path} holds a {hf.get('model_type')!r} model; only GPT-2 can be imported")
    model = gpt2.from_hf_gpt2(path, hf)
    tok = read_tokenizer(path)
    if tok.vocab_size > model.config.vocab_size:
        raise LmcliError(
            f"tokenizer in {path} has {tok.vocab_size} tokens, the model {model.config.vocab_size}"
        )
    return model, tok


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write a folder that ``transformers`` AutoModelForCausalLM/AutoTokenizer load."""
    ckpt = load_checkpoint(path)
    gpt2.check_gpt2_compatible(ckpt.model_config)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise LmcliError(f"{out_dir} already holds files: choose an empty or new folder")
    tok = ckpt.tokenizer
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out_dir)  # created exclusively: a link planted beside the output is never followed
    try:
        (tmp / "config.json").write_text(
            json.dumps(gpt2.gpt2_config(ckpt.model_config, tok), indent=2) + "\n"
        )
        save_file(gpt2.to_gpt2_state(ckpt.model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(tmp / "tokenizer.json")
        vocab = tok.hf.get_vocab(with_added_tokens=True)
        names = {i: t for t, i in vocab.items()}
        specials = {
            "bos_token": names[tok.bos_id],
            "eos_token": names[tok.eos_id],
            "pad_token": names[tok.pad_id],
        }
        if tok.unk_id is not None:
            specials["unk_token"] = names[tok.unk_id]
        if tok.sep_id is not None:
            specials["sep_token"] = names[tok.sep_id]
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": ckpt.model_config.block_size,
            "clean_up_tokenization_spaces": False,
            **specials,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        os.chmod(tmp, out_dir.parent.stat().st_mode & 0o777)  # not mkdtemp's 0700
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
