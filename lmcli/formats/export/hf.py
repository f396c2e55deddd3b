"""Export an lmcli model as a Hugging Face folder that ``transformers`` loads.

The family adapter that expresses the model (``lmcli.formats.families.for_export``) writes its
``config.json`` and names its weights; the folder also holds the tokenizer and its roles in
Hugging Face's files, and is written to a temporary folder renamed into place. A tokenizer that
puts ``<bos>`` first (lmcli's own) says so twice: ``add_bos_token`` in ``tokenizer_config.json``
and a post-processor in ``tokenizer.json`` (what ``transformers`` follows), so a text encoded by
``transformers`` starts as the model saw its texts start.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import save_tensors
from lmcli.formats.families import for_export
from lmcli.formats.hf.load import adds_bos
from lmcli.formats.sources import load_model
from lmcli.formats.weights import logical_state
from lmcli.safe_io import new_folder, temp_dir, write_error
from lmcli.text.tokenizer import Tokenizer


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write a folder that ``transformers`` AutoModelForCausalLM/AutoTokenizer load, from an lmcli
    run or checkpoint folder (or a Hugging Face folder lmcli imports)."""
    ckpt = load_model(path)
    cfg, tok, model = ckpt.model_config, ckpt.tokenizer, ckpt.model
    family = for_export(cfg, "hf")
    out_dir = new_folder(out_dir)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    config, state = family.hf_config(cfg, ids, dtype), family.to_hf(logical_state(model), cfg)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out_dir)  # created exclusively: a link planted beside the output is never followed
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {**{f"{r}_token_id": i for r, i in ids.items()}})
        save_tensors(state, tmp / "model.safetensors")
        tokenizer_file(tok).save(str(tmp / "tokenizer.json"))
        specials = {f"{role}_token": tok.token(i) for role, i in ids.items()}
        for role, i in (("unk", tok.unk_id), ("sep", tok.sep_id)):
            if i is not None:
                specials[f"{role}_token"] = tok.token(i)
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.block_size,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": tok.add_bos,
            "add_eos_token": tok.add_eos,
            **specials,
        }
        if tok.chat_template is not None:
            tok_cfg["chat_template"] = tok.chat_template
        _write_json(tmp / "tokenizer_config.json", tok_cfg)
        _write_json(tmp / "special_tokens_map.json", specials)
        os.chmod(tmp, out_dir.parent.stat().st_mode & 0o777)  # not mkdtemp's 0700
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except OSError as exc:  # a full disk, a folder that cannot be written: named by OUT, not tmp
        shutil.rmtree(tmp, ignore_errors=True)
        raise LmcliError(f"cannot write {out_dir}: {write_error(exc)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def tokenizer_file(tok: Tokenizer) -> Any:
    """The ``tokenizers`` object to save as ``tokenizer.json``: the tokenizer's own, with a
    post-processor that puts ``<bos>`` first when the tokenizer does and its own does not."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    out = HFTokenizer.from_str(tok.to_json())
    if not tok.add_bos or adds_bos(tok):
        return out
    bos = tok.token(tok.bos_id)
    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
    )
    own = out.post_processor
    out.post_processor = template if own is None else processors.Sequence([own, template])
    return out


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
