"""Loading an open model: a Qwen2.5-0.5B-shaped folder (random weights, bfloat16 safetensors, as
the hub's) loaded and sampled on the CPU by lmcli and by ``transformers``.

The folder is written into a temporary directory by a child process. Each side then runs in a
fresh process of its own: import, load the folder in its stored dtype, greedily generate
``NEW`` tokens; the process reports its load time, its resident memory just before loading
(Python, torch and the library imported) and its peak resident memory (``ru_maxrss``, which
counts the memory-mapped weights it touched). The memory row is the peak minus the memory
before loading, over the weights' size on disk; lmcli's goal is at most ``GOAL_X``. The
whole-process peaks are in the JSON too. Both rows are "lower is better": the ratio is HF's
figure / lmcli's.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, log, run_suite

ROOT = Path(__file__).resolve().parents[1]
NEW = 16
GOAL_X = 1.3
# Qwen2.5-0.5B's config.json (the weights are random)
QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 21,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def write_folder(folder: Path) -> int:
    """The Qwen2.5-0.5B-shaped folder with random bf16 weights and a small tokenizer; its weights'
    size in bytes."""
    import torch
    from safetensors.torch import save_file

    from bench.texts import wide_tokenizer

    c, f, kv = QWEN["hidden_size"], QWEN["intermediate_size"], 2 * 64
    shapes = {"model.embed_tokens.weight": (QWEN["vocab_size"], c), "model.norm.weight": (c,)}
    for i in range(QWEN["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (c,),
                p + "post_attention_layernorm.weight": (c,),
                p + "self_attn.q_proj.weight": (c, c),
                p + "self_attn.q_proj.bias": (c,),
                p + "self_attn.k_proj.weight": (kv, c),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, c),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (c, c),
                p + "mlp.gate_proj.weight": (f, c),
                p + "mlp.up_proj.weight": (f, c),
                p + "mlp.down_proj.weight": (c, f),
            }
        )
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(QWEN, indent=2))
    tok = wide_tokenizer(QWEN["vocab_size"])  # any id the random model emits decodes
    tok.hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": tok.token(tok.eos_id)}))
    return sum(t.numel() * t.element_size() for t in state.values())


def measure(side: str, folder: str) -> dict[str, float]:
    """In this (fresh) process: load the folder on ``side`` and generate; times and memory."""
    import torch

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    if side == "lmcli":
        from lmcli.config.commands import SampleConfig
        from lmcli.formats.sources import load_model
        from lmcli.generate.sampling import generate

        before = resident()
        t0 = time.perf_counter()
        ckpt = load_model(folder)
        loaded = time.perf_counter() - t0
        prompt = [ckpt.tokenizer.bos_id, *range(100, 115)]
        cfg = SampleConfig(temperature=0, max_new_tokens=NEW, min_new_tokens=NEW)
        t1 = time.perf_counter()
        out = generate(ckpt.model, ckpt.tokenizer, [prompt], cfg)[0].ids
    else:
        import transformers

        before = resident()
        t0 = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        loaded = time.perf_counter() - t0
        prompt = [0, *range(100, 115)]
        t1 = time.perf_counter()
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
            )[0, len(prompt) :].tolist()
    return {
        "load_s": loaded,
        "sample_s": time.perf_counter() - t1,
        "new_tokens": len(out),
        "rss_before_load": before,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def child(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_load", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen2.5-0.5b-shaped"
        size = child("write", str(folder))["bytes"]
        log(f"wrote {folder.name}: {size / 1e9:.2f} GB of bf16 weights")
        ours, theirs = child("measure", "lmcli", str(folder)), child("measure", "hf", str(folder))
    log(f"lmcli: {ours}")
    log(f"HF: {theirs}")
    x_ours, x_theirs = ((m["peak_rss"] - m["rss_before_load"]) / size for m in (ours, theirs))
    return [
        Row(
            "load+sample memory / weights, Qwen2.5-0.5B bf16",
            "x weights",
            x_ours,
            x_theirs,
            "HF from_pretrained",
            None,
            lower_is_better=True,
            valid=x_ours <= GOAL_X and ours["new_tokens"] == NEW,
            note=f"peak RSS minus RSS before loading; goal: lmcli at most {GOAL_X}x the weights' "
            f"{size / 1e9:.2f} GB: {'met' if x_ours <= GOAL_X else 'MISSED'}; whole-process peaks "
            f"{ours['peak_rss'] / size:.2f}x (lmcli), {theirs['peak_rss'] / size:.2f}x (HF)",
            extra={"weights_bytes": size, "lmcli": ours, "hf": theirs},
        ),
        Row(
            "load time, Qwen2.5-0.5B bf16",
            "s",
            ours["load_s"],
            theirs["load_s"],
            "HF from_pretrained",
            None,
            lower_is_better=True,
            extra={"sample_s": {"lmcli": ours["sample_s"], "hf": theirs["sample_s"]}, "new_tokens": NEW},
        ),
    ]


def main() -> None:
    if sys.argv[1:2] == ["write"]:
        print(json.dumps({"bytes": write_folder(Path(sys.argv[2]))}))
    elif sys.argv[1:2] == ["measure"]:
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
    else:
        run_suite("load", run)


if __name__ == "__main__":
    main()
