"""Smoke test of bench/taco_error_table.py's pieces on small inputs (the full run is the bench)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[1] / "bench" / "taco_error_table.py"


def _load():
    spec = importlib.util.spec_from_file_location("taco_error_table", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_error_table_pieces_on_a_tiny_run():
    bench = _load()
    tensors, info = bench.train_and_capture(steps=2, batch=2)
    assert set(tensors) == {"ln_act", "ln_grad", "proj_grad"}
    assert all(t.numel() > 0 and torch.isfinite(t).all() for t in tensors.values())
    assert info["steps"] == 2 and info["train_loss_first"] > 4  # ~ln(256) at the start
    small = {name: t[:4096] for name, t in {**bench.synthetic(), **tensors}.items()}
    rows = bench.measure(small)
    assert len(rows) == 4 + len(bench.configs())
    for row in rows:
        assert all(0 <= row[name + suffix] < 1.01 for name in small for suffix in ("", "_bulk99"))
        # per token the error can exceed the token's norm: a transform over G > 128 mixes tokens
        assert all(0 <= row[name + "_token_p90"] < 100 for name in small)
    stats = {name: bench.stats(t) for name, t in small.items()}
    text = bench.markdown(rows, info, stats, "x.json")
    assert text.count("| TACO |") == len(bench.configs()) and "## E5M2" in text


def test_bandwidth_plot_from_rows(tmp_path):
    """bench/taco_bandwidth.py draws one panel per op from a run's rows (also --plot of a file)."""
    spec = importlib.util.spec_from_file_location("taco_bandwidth", BENCH.with_name("taco_bandwidth.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"op": op, "mib": mib, "world": 2, "nccl_GBps": 100.0 * mib ** 0.3, "cuda_GBps": 90.0 * mib ** 0.35,
             "cuda_speedup": 0.9 * mib ** 0.05} for op in module.OPS for mib in (1, 16, 256)]
    path = module.plot(rows, tmp_path / "bw.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_bandwidth_variants():
    """The measured variants name DeviceBackend arguments; a bad name says what a variant is."""
    from commweave.taco.bandwidth import variant
    from commweave.taco.device import DeviceBackend

    assert variant("cuda") == {"codec": "cuda", "fuse_barriers": False}
    assert variant("triton") == {"codec": "triton", "fuse_barriers": False}
    assert variant("cuda-fused") == {"codec": "cuda", "fuse_barriers": True}
    for bad in ("nccl", "cuda-p4", "cuda-p4-b132", "triton-fused", "cuda-fused-p4"):
        with pytest.raises(ValueError, match="a variant is cuda, triton"):
            variant(bad)
    assert DeviceBackend(**variant("cuda-fused")).fuse_barriers and not DeviceBackend(**variant("cuda")).fuse_barriers
    with pytest.raises(ValueError, match="only the CUDA codec's kernels perform barriers"):
        DeviceBackend(codec="triton", fuse_barriers=True)


def test_codec_bench_pieces_on_cpu():
    """bench/taco_codec.py's yardstick and rotation (the timed run needs a GPU): the plain quantizer's
    bytes and scales, input sets past twice the L2, and its tunings' names."""
    spec = importlib.util.spec_from_file_location("taco_codec", BENCH.with_name("taco_codec.py"))
    codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec)
    x = torch.randn(4 * 128, dtype=torch.bfloat16)
    q, scale = codec.plain_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (4, 128) and scale.shape == (4, 1)
    back = codec.plain_dequantize(q, scale)
    assert back.dtype == torch.bfloat16 and ((back.float() - x.float()).norm() / x.float().norm()) < 0.05
    from commweave.contracts.profile import H200

    for mib in (4, 16, 64, 256):
        assert codec._sets(mib) * mib * codec.MIB * 3 // 2 >= min(2 * H200.l2_bytes, 16 * mib * codec.MIB * 3 // 2)
    assert {"legacy", "default"} <= set(codec.TUNINGS) and codec.TUNINGS["default"] == codec.cuda.Tuning()
