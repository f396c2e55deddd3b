"""A model file changed under a running command (issue 48): a GGUF file's tensors (and a
``pytorch_model.bin``'s) are read into the process's own memory, so a truncation, a rewrite in
place or a file renamed over it leaves the running model as it was (a memory map of the file
killed the process with SIGBUS at the next read past the new end, and a rewrite changed its
weights); a file that changes between the scan of its header and the read of its tensors is
one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from families import hf_folder  # noqa: E402
from gguf_files import write_gguf_model  # noqa: E402

from lmcli.errors import LmcliError  # noqa: E402
from lmcli.formats.gguf.check import scan  # noqa: E402
from lmcli.formats.gguf.load import read_data  # noqa: E402

# Loads each model, then truncates, rewrites in place and replaces its file, computing logits
# after each: they must stay those it computed first (argv: pairs of a model and its file).
SCRIPT = """
import os, sys, torch
from lmcli.formats.gguf.load import load_gguf
from lmcli.formats.sources import load_model

ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
pairs = list(zip(sys.argv[1::2], sys.argv[2::2]))
models = [(load_model(m, as_stored=True).model, f) for m, f in pairs]
models.append((load_gguf(pairs[0][0])[0], pairs[0][1]))  # dequantized: F32 norms as read

def logits():
    with torch.no_grad():
        return [m(ids) for m, _ in models]

first = logits()
sizes = {f: os.path.getsize(f) for _, f in models}
for f, size in sizes.items():  # the second half rewritten in place: the same size, other bytes
    with open(f, "r+b") as out:
        out.seek(size // 2)
        out.write(os.urandom(size - size // 2))
rewritten = logits()
for f, size in sizes.items():
    os.truncate(f, size // 3)
truncated = logits()
for f in sizes:
    os.replace(f + ".other", f)
replaced = logits()
for name, now in (("rewritten", rewritten), ("truncated", truncated), ("replaced", replaced)):
    assert all(torch.equal(a, b) for a, b in zip(first, now)), name
print("unchanged")
"""


def test_a_running_model_is_immune_to_its_file_changing(tmp_path: Path) -> None:
    path = write_gguf_model(tmp_path / "model.gguf", "llama", "Q8_0")
    folder = hf_folder(tmp_path, "qwen2-gqa-bias-yarn")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()  # a folder of the older format
    files = [path, folder / "pytorch_model.bin"]
    for f in files:  # what each file is replaced by: another model of the same kind
        shutil.copy(f, f"{f}.other")
    write_gguf_model(Path(f"{path}.other"), "llama", "Q8_0", seed=1)
    argv = [str(path), str(path), str(folder), str(files[1])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", SCRIPT, *argv]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -7: SIGBUS
    assert proc.stdout.strip() == "unchanged"


def test_a_file_changed_between_its_scan_and_its_read_is_one_line(tmp_path: Path) -> None:
    path = write_gguf_model(tmp_path / "model.gguf", "llama", "Q8_0")
    other = write_gguf_model(tmp_path / "other.gguf", "llama", "Q8_0", seed=1)
    scanned = scan(path)
    with open(path, "r+b") as f:  # rewritten in place at the same size
        f.seek(-64, os.SEEK_END)
        f.write(os.urandom(64))
    os.utime(path, ns=(scanned.stamp[3], scanned.stamp[3] + 10**9))  # a second later
    with pytest.raises(LmcliError, match=f"^{path} changed while it was read"):
        read_data(scanned)
    scanned = scan(path)
    os.replace(other, path)  # replaced by another file
    with pytest.raises(LmcliError, match="changed while it was read"):
        read_data(scanned)
    assert len(read_data(scan(path))) == len(scanned.tensors)


def test_verify_reads_safetensors_so_a_truncation_is_one_line(tmp_path: Path) -> None:
    """verify's NaN scan read a folder's safetensors through a map of the file (a truncation
    during the scan: SIGBUS); it reads them, and a file cut short meanwhile is one line."""
    from safetensors.torch import save_file

    from lmcli.formats.verify import nonfinite_safetensors

    file = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64, 64), "b": torch.tensor([1.0, float("nan")])}, str(file))
    assert nonfinite_safetensors([file], chunk=256) == "b"
    os.truncate(file, file.stat().st_size - 8)
    with pytest.raises(LmcliError, match=f"^{file} changed while it was read$"):
        nonfinite_safetensors([file], chunk=256)
