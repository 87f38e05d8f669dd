"""Figure: bench/results/layers-w1-1gpu-*.json, the W = 1 tax of commweave's layers over the plain PyTorch layers.

The tax at W = 1: commweave's layers' forward + backward time over the plain PyTorch layers' on one GPU.

Where there is nothing to communicate a layer should cost what the plain computation costs (issue
32, item 6). On one GPU, bf16, this times forward alone and forward + backward (a training step's
share: parameter gradients reset to None first, as `zero_grad()` does) of:
- the TP MLP block (column-parallel -> GELU -> row-parallel) at T = 4096, H = 8192, FF = 28672 and
  T = 1024, H = 4096, FF = 14336: `commweave.nn`'s layers at TP = 1, the custom ops themselves
  (`torch.ops.commweave.gemm_allgather` / `gemm_reducescatter` on weight.t(), the path the layers
  take on several ranks), against the same block of `torch.nn.Linear` (goal: within 3 %);
- `commweave.nn.ExpertParallelMoE` (all experts on the one rank: T = 4096 tokens, H = 7168,
  I = 2048, 64 experts, top-8, uniform routing) against a plain local MoE under torch autograd (the
  moe workload's `single_rank`: sort, gather, two grouped GEMMs, weighted sum) (goal: <= 1.10x);
- `commweave.nn.ContextParallelAttention` (S = 8192, 32 query heads, 8 KV heads, D = 128, B = 1,
  full and causal, [B, S, H, D]) against SDPA's flash backend (goal: <= 1.10x), where the module
  exists in this tree (else reported as not present).
Times are medians of CUDA-event times (`runtime.timers.cuda_call_us`: every call queued behind a
~1 ms spin kernel, so the time is the GPU's), `--rounds` rounds of `--iters` calls with the variants
interleaved call by call in rotating order (the median of the rounds kept), inputs rotated over enough sets to exceed twice the
L2. "loop_us" is the same step run back to back without the hold (host launch costs included when
the host is the slower side).

    python bench/layers_w1.py [--iters 20] [--rounds 3] [--only mlp moe attention]

Writes bench/results/layers-w1-1gpu-<stamp>.json (runtime.provenance: device, versions, commit,
date, command).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from commweave.evaluate.timing import input_sets_for
from commweave.report.results import write_results
from commweave.runtime.timers import cuda_call_us

MLP_SHAPES = ((4096, 8192, 28672), (1024, 4096, 14336))
MOE_SHAPE = dict(T=4096, H=7168, I=2048, E=64, K=8)
ATTENTION_SHAPE = dict(S=8192, Hq=32, Hkv=8, D=128, B=1)
DEVICE = "cuda"
Step = Callable[[int], object]  # one call on rotating input set i


def loop_us(fn: Step, iters: int) -> float:
    """Mean time of `iters` back-to-back calls (no hold: the host's launch time shows when slower)."""
    fn(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(iters):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def time_variants(variants: dict[str, dict[str, Step]], iters: int, rounds: int) -> dict[str, dict[str, float]]:
    """{variant: {"forward_us", "train_us", "loop_us"}}: per kind, the median over `rounds` rounds
    of each round's median; within a round every call of one variant is followed by one of each
    other, the order rotating call by call, so the GPU's clock and power state (they drift by
    several % over a run of large GEMMs) fall on every variant alike."""
    names = list(variants)
    samples: dict[str, dict[str, list[float]]] = {v: {"forward_us": [], "train_us": [], "loop_us": []} for v in variants}
    counters = {name: iter(range(1 << 30)) for name in names}
    for name in names:  # warm-up: every kernel loaded, every workspace allocated
        for kind in ("forward", "train"):
            for _ in range(3):
                variants[name][kind](next(counters[name]))
    for round_index in range(rounds):
        for kind in ("forward", "train"):
            calls: dict[str, list[float]] = {name: [] for name in names}
            for i in range(iters):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    fn = variants[name][kind]
                    calls[name].append(cuda_call_us(lambda: fn(next(counters[name]))))
            for name in names:
                samples[name][f"{kind}_us"].append(statistics.median(calls[name]))
        for name in names[::-1] if round_index % 2 else names:
            samples[name]["loop_us"].append(loop_us(variants[name]["train"], iters))
    return {v: {k: statistics.median(s) for k, s in kinds.items()} for v, kinds in samples.items()}


def _train(forward: Callable[[int], torch.Tensor], grads: list[torch.Tensor], params: list[torch.Tensor],
           leaves: list[torch.Tensor]) -> dict[str, Step]:
    """Forward alone (no autograd graph kept) and forward + backward from fresh gradients."""
    def train(i: int) -> None:
        for p in (*params, *leaves):
            p.grad = None
        forward(i).backward(grads[i % len(grads)])

    def fwd(i: int) -> None:
        with torch.no_grad():
            forward(i)
    return {"forward": fwd, "train": train}


def _ratios(times: dict[str, dict[str, float]], plain: str) -> dict[str, dict[str, float]]:
    return {v: {**t, "train_ratio": t["train_us"] / times[plain]["train_us"],
                "forward_ratio": t["forward_us"] / times[plain]["forward_us"]} for v, t in times.items()}


def mlp_block(tokens: int, hidden: int, ffn: int, iters: int, rounds: int) -> dict:
    from commweave.nn import ColumnParallelLinear, RowParallelLinear

    dev, bf16 = DEVICE, torch.bfloat16
    sets = input_sets_for(2 * tokens * hidden * 2)
    xs = [torch.randn(tokens, hidden, device=dev, dtype=bf16).requires_grad_() for _ in range(sets)]
    grads = [torch.randn(tokens, hidden, device=dev, dtype=bf16) for _ in range(sets)]
    up, down = ColumnParallelLinear(hidden, ffn, device=dev), RowParallelLinear(ffn, hidden, device=dev)
    plain_up = torch.nn.Linear(hidden, ffn, bias=False, device=dev, dtype=bf16)
    plain_down = torch.nn.Linear(ffn, hidden, bias=False, device=dev, dtype=bf16)
    with torch.no_grad():
        plain_up.weight.copy_(up.weight)
        plain_down.weight.copy_(down.weight)
    ours = [up.weight, down.weight]
    variants = {
        "nn.Linear": _train(lambda i: plain_down(F.gelu(plain_up(xs[i % sets]))), grads,
                            [plain_up.weight, plain_down.weight], xs),
        "commweave.nn": _train(lambda i: down(F.gelu(up(xs[i % sets]))), grads, ours, xs),
        "commweave.ops": _train(lambda i: torch.ops.commweave.gemm_reducescatter(
            F.gelu(torch.ops.commweave.gemm_allgather(xs[i % sets], up.weight.t(), "", None)), down.weight.t(), "", None),
            grads, ours, xs),
    }
    flops = 3 * 2 * 2.0 * tokens * hidden * ffn  # two GEMMs forward, four backward
    return {"block": "tp-mlp", "shape": {"T": tokens, "H": hidden, "FF": ffn}, "train_flops": flops,
            "variants": _ratios(time_variants(variants, iters, rounds), "nn.Linear"), "plain": "nn.Linear"}


def moe(iters: int, rounds: int) -> dict:
    from commweave.nn import ExpertParallelMoE
    from commweave.workloads import get_workload

    s, dev, bf16 = MOE_SHAPE, DEVICE, torch.bfloat16
    layer = ExpertParallelMoE(s["H"], s["I"], s["E"], device=dev)
    w13 = layer.w13.detach().clone().requires_grad_()
    w2 = layer.w2.detach().clone().requires_grad_()
    sets = input_sets_for(2 * s["T"] * s["H"] * 2)
    xs = [torch.randn(s["T"], s["H"], device=dev, dtype=bf16).requires_grad_() for _ in range(sets)]
    idx = [torch.rand(s["T"], s["E"], device=dev).topk(s["K"], dim=-1).indices for _ in range(sets)]
    weights = [torch.rand(s["T"], s["K"], device=dev).requires_grad_() for _ in range(sets)]
    grads = [torch.randn(s["T"], s["H"], device=dev, dtype=bf16) for _ in range(sets)]
    local = get_workload("moe").single_rank

    def plain(i: int) -> torch.Tensor:
        j = i % sets
        return local({"x": xs[j], "topk_idx": idx[j], "topk_weights": weights[j], "w13": w13, "w2": w2})

    variants = {
        "local MoE": _train(plain, grads, [w13, w2], xs + weights),
        "ExpertParallelMoE": _train(lambda i: layer(xs[i % sets], idx[i % sets], weights[i % sets]), grads,
                                    [layer.w13, layer.w2], xs + weights),
    }
    flops = 3 * 2.0 * s["T"] * s["K"] * 3 * s["H"] * s["I"]
    return {"block": "moe", "shape": s, "train_flops": flops,
            "variants": _ratios(time_variants(variants, iters, rounds), "local MoE"), "plain": "local MoE"}


def attention(causal: bool, iters: int, rounds: int) -> dict:
    s, dev, bf16 = ATTENTION_SHAPE, DEVICE, torch.bfloat16
    row = {"block": "attention", "shape": {**s, "causal": causal}, "plain": "sdpa flash"}
    try:
        from commweave.nn import ContextParallelAttention
    except ImportError as exc:
        return {**row, "not_present": f"commweave.nn.ContextParallelAttention: {exc}"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sets = input_sets_for(s["B"] * s["S"] * (s["Hq"] + 2 * s["Hkv"]) * s["D"] * 2)
    q = [torch.randn(s["B"], s["S"], s["Hq"], s["D"], device=dev, dtype=bf16).requires_grad_() for _ in range(sets)]
    k = [torch.randn(s["B"], s["S"], s["Hkv"], s["D"], device=dev, dtype=bf16).requires_grad_() for _ in range(sets)]
    v = [torch.randn(s["B"], s["S"], s["Hkv"], s["D"], device=dev, dtype=bf16).requires_grad_() for _ in range(sets)]
    grads = [torch.randn(s["B"], s["S"], s["Hq"], s["D"], device=dev, dtype=bf16) for _ in range(sets)]
    module = ContextParallelAttention(causal=causal)

    def flash(i: int) -> torch.Tensor:  # SDPA on [B, H, S, D] views; GQA by the backend
        j = i % sets
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q[j].transpose(1, 2), k[j].transpose(1, 2), v[j].transpose(1, 2),
                                                 is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2)

    try:
        flash(0).backward(grads[0])
    except RuntimeError as exc:
        return {**row, "error": f"SDPA's flash backend refused the shape: {exc}"}
    leaves = q + k + v
    variants = {"sdpa flash": _train(flash, grads, [], leaves),
                "ContextParallelAttention": _train(lambda i: module(q[i % sets], k[i % sets], v[i % sets]), grads, [],
                                                   leaves)}
    flops = 4.0 * s["B"] * s["S"] ** 2 * s["Hq"] * s["D"] * (0.5 if causal else 1.0) * 3.5  # forward 1, backward 2.5
    return {**row, "train_flops": flops, "variants": _ratios(time_variants(variants, iters, rounds), "sdpa flash")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="+", choices=("mlp", "moe", "attention"), default=["mlp", "moe", "attention"])
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/layers_w1.py times one GPU: no CUDA device here")
    torch.manual_seed(0)
    rows = []
    if "mlp" in args.only:
        rows += [mlp_block(*shape, args.iters, args.rounds) for shape in MLP_SHAPES]
        torch.cuda.empty_cache()
    if "moe" in args.only:
        rows.append(moe(args.iters, args.rounds))
        torch.cuda.empty_cache()
    if "attention" in args.only:
        rows += [attention(causal, args.iters, args.rounds) for causal in (False, True)]
    for row in rows:
        for name, t in row.get("variants", {}).items():
            print(f"{row['block']:9s} {str(row['shape']):60s} {name:26s} forward {t['forward_us']:9.1f} us "
                  f"({t['forward_ratio']:.3f}x)  fwd+bwd {t['train_us']:9.1f} us ({t['train_ratio']:.3f}x)  "
                  f"loop {t['loop_us']:9.1f} us")
        for key in ("not_present", "error"):
            if key in row:
                print(f"{row['block']:9s} {str(row['shape']):60s} {key}: {row[key]}")
    payload = {"device": torch.cuda.get_device_name(), "iters": args.iters, "rounds": args.rounds, "rows": rows}
    path = write_results("layers-w1-1gpu", payload, command=["python", "bench/layers_w1.py", *sys.argv[1:]],
                         out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
