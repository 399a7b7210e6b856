"""The models bench's profile summary: what ran during a slow batch, read off a chrome trace."""

import pytest

pytest.importorskip("torch")

from arl_tangram.bench.models import profile_summary  # noqa: E402


def test_profile_summary_names_what_a_slow_batch_waited_on():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "batch big x2", "pid": 1, "tid": 7, "ts": 1000.0, "dur": 300_000},
        {"ph": "X", "cat": "user_annotation", "name": "batch small x1", "pid": 1, "tid": 8, "ts": 0.0, "dur": 5_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 7, "ts": 2000.0, "dur": 250_000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMalloc", "pid": 1, "tid": 9, "ts": 2000.0, "dur": 1_000},
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "pid": 0, "tid": 18, "ts": 1500.0, "dur": 100_000},
        {"ph": "X", "cat": "kernel", "name": "gemm_b", "pid": 0, "tid": 18, "ts": 50_000.0, "dur": 100_000},
        {"ph": "X", "cat": "kernel", "name": "outside", "pid": 0, "tid": 18, "ts": 900_000.0, "dur": 10},
    ]
    out = profile_summary(ev)
    assert [b["name"] for b in out["batches"]] == ["batch big x2"]  # the 5 ms one is not slow
    b = out["batches"][0]
    assert b["own_longest"][0]["name"] == "cudaMemcpyAsync"  # the batch thread's, not tid 9's malloc
    assert b["runtime_calls"]["cudaMemcpyAsync"] == [1, 250.0] and "cudaMalloc" in b["runtime_calls"]
    assert b["gpu_ops"] == 2 and b["gpu_busy_ms"] == 148.5  # overlapping kernels counted once
    assert b["gpu_by_stream"] == {"18": [2, 200.0]}
    assert out["longest_runtime_calls"][0]["ms"] == 250.0


def test_bench_models_have_an_even_number_of_heads():
    from arl_tangram.bench.models import GPU_SIZES_B
    from arl_tangram.managers.models.tiny import TinyConfig

    for b in GPU_SIZES_B:  # odd counts take nn.MultiheadAttention's slow path (TinyConfig.of_size)
        c = TinyConfig.of_size(b)
        assert c.heads % 2 == 0 and c.d_model == 128 * c.heads, (b, c)
