"""Figure: bench/results/attention-cp-w1-1gpu-*.json, attention at W = 1 against SDPA on one GPU.

Attention at W = 1 on one GPU, forward and forward + backward: `ContextParallelAttention` (no
group: SDPA on [B, H, S, D] views of the sequence-major tensors), the differentiable ring op at
W = 1 (`context_parallel_attention_lse`: what a group of one runs), and the forward-only op's
single-rank path (issue 32 measured it at 46.2 / 55.2 ms full / causal at S = 8192 when it handed
SDPA 3-D tensors, and out of memory at 32768), against plain SDPA on [B, H, S, D] tensors (its own backend choice:
cuDNN on Hopper) and SDPA restricted to its flash kernel (issue 32, item 6).

    python bench/attention_cp_w1.py [--seq 8192] [--heads 32 --kv-heads 8] [--dim 128] [--batch 1]

Prints the times and writes bench/results/attention-cp-w1-1gpu-<UTC stamp>.json. Times: CUDA events,
median of --iters after --warmup, ms. FLOPs: forward 4 B S^2 Hq D (half that causal), backward 2.5x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from commweave.nn import ContextParallelAttention
from commweave.ops.groups import SINGLE


def _time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _train(fn, q, k, v, g):
    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(g)
    return step


def bench(seq: int, hq: int, hkv: int, dim: int, batch: int, causal: bool, warmup: int, iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seq, hq, dim, device="cuda", generator=gen).bfloat16().requires_grad_()
    k = torch.randn(batch, seq, hkv, dim, device="cuda", generator=gen).bfloat16().requires_grad_()
    v = torch.randn(batch, seq, hkv, dim, device="cuda", generator=gen).bfloat16().requires_grad_()
    g = torch.randn(batch, seq, hq, dim, device="cuda", generator=gen).bfloat16()
    # the yardsticks: SDPA on [B, H, S, D] tensors, GQA native (its default backend; flash only), and
    # SDPA on [B, H, S, D] views of the same sequence-major tensors the module gets
    qh, kh, vh = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    gh = g.transpose(1, 2).contiguous()

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=hq != hkv)

    def flash(a, b, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=hq != hkv)

    module = ContextParallelAttention(causal=causal)

    def module_flash_only(a, b, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return module(a, b, c)

    def ring(a, b, c):
        return torch.ops.commweave.context_parallel_attention_lse(a, b, c, causal, causal, SINGLE)[0]

    def forward_only_op(a, b, c):
        return torch.ops.commweave.context_parallel_attention(a[0], b[0], c[0], causal, SINGLE, None)

    rows = {}
    with torch.no_grad():
        rows["sdpa_fwd"] = _time(lambda: sdpa(qh, kh, vh), warmup, iters)
        rows["sdpa_views_fwd"] = _time(lambda: sdpa(*(t.transpose(1, 2) for t in (q, k, v))), warmup, iters)
        rows["sdpa_flash_fwd"] = _time(lambda: flash(qh, kh, vh), warmup, iters)
        rows["module_fwd"] = _time(lambda: module(q, k, v), warmup, iters)
        rows["ring_op_fwd"] = _time(lambda: ring(q, k, v), warmup, iters)
        if batch == 1:
            rows["forward_only_op_fwd"] = _time(lambda: forward_only_op(q, k, v), warmup, iters)
    rows["sdpa_train"] = _time(_train(sdpa, qh, kh, vh, gh), warmup, iters)
    rows["sdpa_views_train"] = _time(_train(lambda a, b, c: sdpa(a.transpose(1, 2), b.transpose(1, 2),
                                                                 c.transpose(1, 2)).transpose(1, 2), q, k, v, g),
                                     warmup, iters)
    rows["sdpa_flash_train"] = _time(_train(flash, qh, kh, vh, gh), warmup, iters)
    rows["module_train"] = _time(_train(module, q, k, v, g), warmup, iters)
    rows["module_flash_only_train"] = _time(_train(module_flash_only, q, k, v, g), warmup, iters)
    rows["ring_op_train"] = _time(_train(ring, q, k, v, g), warmup, iters)
    fwd_flops = 4.0 * batch * seq * seq * hq * dim * (0.5 if causal else 1.0)
    return {"ms": rows,
            "module_vs_sdpa": {"fwd": rows["module_fwd"] / rows["sdpa_fwd"],
                               "train": rows["module_train"] / rows["sdpa_train"]},
            "module_vs_sdpa_views": {"fwd": rows["module_fwd"] / rows["sdpa_views_fwd"],
                                     "train": rows["module_train"] / rows["sdpa_views_train"]},
            "module_flash_only_vs_flash": {"train": rows["module_flash_only_train"] / rows["sdpa_flash_train"]},
            "ring_op_vs_sdpa": {"fwd": rows["ring_op_fwd"] / rows["sdpa_fwd"],
                                "train": rows["ring_op_train"] / rows["sdpa_train"]},
            "tflops": {name: (fwd_flops * (3.5 if name.endswith("train") else 1.0)) / (ms * 1e9)
                       for name, ms in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention_cp_w1.py needs a CUDA GPU")
    result = {"what": "attention at W = 1, bf16: commweave vs SDPA (default backend, and flash only)",
              "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
              "dim": args.dim, "batch": args.batch, "runs": {}}
    for causal in (False, True):
        mode = "causal" if causal else "full"
        run = bench(args.seq, args.heads, args.kv_heads, args.dim, args.batch, causal, args.warmup, args.iters)
        result["runs"][mode] = run
        print(f"{mode}: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in run["ms"].items()))
        print(f"  module / sdpa: fwd {run['module_vs_sdpa']['fwd']:.3f}x, train {run['module_vs_sdpa']['train']:.3f}x;"
              f" / sdpa on views: fwd {run['module_vs_sdpa_views']['fwd']:.3f}x,"
              f" train {run['module_vs_sdpa_views']['train']:.3f}x;"
              f" flash only: train {run['module_flash_only_vs_flash']['train']:.3f}x;"
              f" ring op / sdpa: fwd {run['ring_op_vs_sdpa']['fwd']:.3f}x,"
              f" train {run['ring_op_vs_sdpa']['train']:.3f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"attention-cp-w1-1gpu-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
