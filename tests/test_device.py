"""The device-independent logic of the GPU paths: dtype choices, precision scopes, the KV cache's
dtype, staged host-to-device copies (issue 19; the GPU itself is checked by `make check-gpu`)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_run, run_cli, tiny_model

from lmcli.data.windows import WindowSampler
from lmcli.device import (
    Staging,
    auto_cuda_dtype,
    autocast_dtype,
    compute_dtype,
    configure_backend,
    inference_dtype,
    precision,
    to_host,
)
from lmcli.generate.decoding import prefill, step
from lmcli.model.kv_cache import KVCache

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def fake_gpu(monkeypatch, native_bf16: bool) -> None:
    """A GPU whose bf16 is native (A100, H100) or only emulated (V100, T4)."""

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native_bf16 or including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)


@pytest.mark.parametrize(
    ("gpu", "native_bf16", "expected"),
    [("A100/H100 (sm_80+)", True, torch.bfloat16), ("V100/T4 (sm_70/75)", False, torch.float16)],
)
def test_dtype_auto_picks_bf16_only_where_it_is_native(monkeypatch, gpu, native_bf16, expected) -> None:
    fake_gpu(monkeypatch, native_bf16)
    assert autocast_dtype(CUDA, "auto") is expected, gpu
    assert auto_cuda_dtype(native_bf16) is expected
    # inference follows training's policy for float32 weights
    assert inference_dtype(CUDA, "auto", torch.float32) is expected
    # explicit choices are honoured; the CPU stays in float32 unless asked
    assert autocast_dtype(CUDA, "bfloat16") is torch.bfloat16
    assert autocast_dtype(CUDA, "float32") is None
    assert autocast_dtype(CPU, "auto") is None


def test_inference_dtype_table(monkeypatch) -> None:
    fake_gpu(monkeypatch, True)
    assert inference_dtype(CUDA, "float32", torch.float32) is None  # full precision asked for (TF32)
    assert inference_dtype(CUDA, "float16", torch.float32) is torch.float16
    assert inference_dtype(CUDA, "auto", torch.bfloat16) is None  # 16-bit weights need no autocast
    assert inference_dtype(CPU, "auto", torch.float32) is None
    assert inference_dtype(CPU, "bfloat16", torch.bfloat16) is None


def test_gpu_backend_uses_tf32_matmuls_and_the_cpu_is_left_alone() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        configure_backend(CPU)
        assert torch.get_float32_matmul_precision() == "highest"
        configure_backend(CUDA)  # flags only: no GPU needed to set them
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_precision_scope_enters_autocast_and_leaves_it() -> None:
    with precision(CPU, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        assert compute_dtype(CPU, torch.float32) is torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert compute_dtype(CPU, torch.float32) is torch.float32
    with precision(CPU, None):
        assert not torch.is_autocast_enabled("cpu")


def test_kv_cache_follows_the_autocast_dtype_and_decoding_keeps_it() -> None:
    """Under bf16 autocast the cache is bf16 from the start: no step casts it (CPU autocast here,
    the same code path as CUDA's)."""
    model = tiny_model(40, n_kv_head=1).eval()
    assert KVCache.for_model(model, 2).k.dtype is torch.float32
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache, logits = prefill(model, [[1, 2, 3], [4, 5]], 0)
        assert cache.k.dtype is torch.bfloat16 and cache.v.dtype is torch.bfloat16
        for _ in range(3):
            logits = step(model, cache, logits.argmax(-1))
        assert cache.k.dtype is torch.bfloat16 and torch.isfinite(logits).all()


def test_cli_decodes_inside_the_precision_scope(tmp_path, capsys, monkeypatch) -> None:
    """`lmcli sample` runs under the autocast dtype the policy returns (forced to bf16 here, as it
    is for float32 weights on a GPU): the KV cache it builds is bf16."""
    import lmcli.device

    run = make_run(tmp_path / "run")
    seen: list[torch.dtype] = []
    real = KVCache.for_model.__func__

    def spy(cls, *args, **kwargs):
        cache = real(cls, *args, **kwargs)
        seen.append(cache.k.dtype)
        return cache

    monkeypatch.setattr(lmcli.device, "inference_dtype", lambda *a: torch.bfloat16)
    monkeypatch.setattr(KVCache, "for_model", classmethod(spy))
    code, out, err = run_cli(["sample", str(run), "-p", "the", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    assert seen and set(seen) == {torch.bfloat16}
    assert not torch.is_autocast_enabled("cpu")  # the scope ended with the command


def test_staging_reuses_two_buffers_in_turn_and_copies_exactly() -> None:
    staging = Staging(CPU, pin=False)  # ordinary memory on the CPU: the same logic as pinned
    tokens = [torch.arange(i, i + 12).view(3, 4) for i in range(4)]
    outs = [staging.to_device(t) for t in tokens]
    buffers = [b.view(3, 4) for b in staging._buffers[("tensor", torch.int64)]]
    assert len(buffers) == 2 and len(staging._buffers) == 1  # one kind: two buffers, reused
    for t, out in zip(tokens, outs, strict=True):
        assert torch.equal(out, t)  # a copy that later refills of the buffer do not change
        assert all(out.data_ptr() != b.data_ptr() for b in buffers)
    # the fourth batch went through the second buffer: alternating
    assert torch.equal(buffers[1], tokens[3]) and torch.equal(buffers[0], tokens[2])


def test_a_window_batch_is_copied_once_and_sliced_on_the_device() -> None:
    sampler = WindowSampler(torch.arange(200).numpy(), block_size=8, seed=0)
    batch = sampler.batch(0, 4)
    assert batch.tokens is not None and batch.tokens.shape == (4, 9)
    staging = Staging(CPU, pin=False)
    moved = batch.to(CPU, staging)
    assert torch.equal(moved.x, batch.x) and torch.equal(moved.y, batch.y)
    # x and y are views of the one staged (B, T+1) copy
    assert moved.x.data_ptr() == moved.tokens.data_ptr()
    assert moved.y.data_ptr() == moved.tokens.data_ptr() + moved.tokens.element_size()
    assert list(staging._buffers) == [("tokens", torch.int64)]


def test_staging_buffers_stay_two_per_kind_when_shapes_vary() -> None:
    """Length buckets and scored positions change every batch: the buffers grow to the largest
    and are reused, instead of two new pinned buffers per shape seen."""
    staging = Staging(CPU, pin=False)
    for n in (5, 40, 12, 40, 3, 33):
        t = torch.arange(n)
        assert torch.equal(staging.to_device(t, "index"), t)
    pair = staging._buffers[("index", torch.int64)]
    # each of the two grew only when a larger tensor came its turn: 5 -> 12 and 40
    assert len(staging._buffers) == 1 and [b.numel() for b in pair] == [12, 40]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA build and device")
def test_staging_pins_its_buffers_on_a_gpu() -> None:
    staging = Staging(CUDA)
    out = staging.to_device(torch.arange(12).view(3, 4))
    assert out.is_cuda and all(b.is_pinned() for b in staging._buffers[("tensor", torch.int64)])


def test_to_host_returns_cpu_tensors_unchanged() -> None:
    a, b = torch.arange(3), torch.ones(2)
    assert to_host(a, b) == [a, b]


def test_the_forward_under_autocast_is_one_graph_for_torch_compile() -> None:
    """Choosing the mask's dtype from the autocast state (ALiBi: a float mask) breaks no graph."""
    import torch._dynamo

    model = tiny_model(40, position="alibi").train()
    idx = torch.randint(0, 40, (2, 12))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(idx)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_usable_cpus_follow_the_affinity_and_the_cgroup_quota(tmp_path, monkeypatch) -> None:
    import lmcli.device as device

    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs' worth of time
    assert device.cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert device.cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000")  # cgroup v1: 3 CPUs
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert device.cgroup_quota(tmp_path) == 3.0
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(device, "cgroup_quota", lambda: 1.5)
    assert device.usable_cpus() == 2  # the quota rounded up, below the affinity
    monkeypatch.setattr(device, "cgroup_quota", lambda: None)
    assert device.usable_cpus() == 4
    threads = torch.get_num_threads()
    try:
        assert device.set_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_the_training_preflight_shows_the_threads(tmp_path, capsys) -> None:
    from helpers import FAST_TRAIN_ARGS, TINY_TEXT

    corpus = tmp_path / "c.txt"
    corpus.write_text(TINY_TEXT)
    args = [a for a in FAST_TRAIN_ARGS if a != "-q"]
    threads = torch.get_num_threads()
    try:
        code, out, err = run_cli(
            [
                "train",
                str(corpus),
                "--out",
                str(tmp_path / "run"),
                *args,
                "--max-steps",
                "2",
                "--threads",
                "1",
            ],
            capsys,
        )
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert "CPU threads" in out + err and "1 (--threads" in out + err


def test_omp_num_threads_is_the_default_when_set(monkeypatch) -> None:
    import lmcli.device as device

    monkeypatch.setattr(device, "usable_cpus", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert device.default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert device.default_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert device.default_threads() == 2
