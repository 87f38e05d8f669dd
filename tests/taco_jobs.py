"""Job functions for the TACO CPU tests (the pool's workers import them by name).

Every rank builds the same full tensors from a seed, so each rank can check its own result against
the uncompressed torch collective and against a single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commweave.taco import collectives as cc
from commweave.taco.quant import QuantConfig


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _inputs(seed: int, world: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * (1 + r) for r in range(world)]


def collectives_vs_torch(ctx, fmt: str, group_size: int, rows: int, cols: int, seed: int = 0,
                         hadamard: bool | str = True) -> dict:
    """Each compressed collective against its uncompressed torch result: relative errors, and the
    bound each one should meet (one quantization step, two for two-shot)."""
    world, rank = ctx.world_size, ctx.rank
    cfg = QuantConfig(group_size, fmt, hadamard=hadamard)
    xs = _inputs(seed + 1, world, (rows, cols))
    x = xs[rank]
    out = {}
    exact_gather = torch.cat(xs, dim=0)
    out["all_gather"] = _rel(cc.all_gather(x, cfg), exact_gather)
    out["all_gather_plain"] = _rel(cc.all_gather(x), exact_gather)
    exact_sum = sum(xs[1:], xs[0])
    exact_rs = exact_sum.chunk(world, dim=0)[rank]
    out["reduce_scatter"] = _rel(cc.reduce_scatter(x, cfg), exact_rs)
    out["reduce_scatter_plain"] = _rel(cc.reduce_scatter(x), exact_rs)
    one = cc.all_reduce(x, cfg, "one_shot")
    two = cc.all_reduce(x, cfg, "two_shot")
    out["all_reduce_one_shot"] = _rel(one, exact_sum)
    out["all_reduce_two_shot"] = _rel(two, exact_sum)
    out["all_reduce_plain"] = _rel(cc.all_reduce(x), exact_sum)
    # every rank must hold bit-identical all-reduce results
    for name, t in (("one", one), ("two", two)):
        ref = t.clone()
        dist.broadcast(ref, src=0)
        out[f"identical_{name}"] = bool(torch.equal(ref, t))
    out["x_untouched"] = bool(torch.equal(x, xs[rank]))
    return out


def odd_sizes(ctx) -> dict:
    """Sizes that are not multiples of G (padding) and an all-reduce whose numel is not a multiple of
    world * G; also bf16 inputs keep their dtype."""
    world, rank = ctx.world_size, ctx.rank
    cfg = QuantConfig(64, "e4m3")
    xs = _inputs(7, world, (world * 3, 37))
    x = xs[rank]
    exact_sum = sum(xs[1:], xs[0])
    res = {
        "all_gather": _rel(cc.all_gather(x, cfg), torch.cat(xs)),
        "reduce_scatter": _rel(cc.reduce_scatter(x, cfg), exact_sum.chunk(world)[rank]),
        "two_shot": _rel(cc.all_reduce(x, cfg, "two_shot"), exact_sum),
    }
    xb = x.bfloat16()
    yb = cc.all_reduce(xb, cfg, "one_shot")
    res["bf16_dtype"] = str(yb.dtype)
    res["bf16"] = _rel(yb, sum(t.bfloat16().float() for t in xs))
    return res


def compressed_all_reduce_auto(ctx, one_shot_max_bytes: int) -> list[float]:
    x = torch.ones(4, 256) * (ctx.rank + 1)
    cfg = QuantConfig(128, "e4m3")
    return cc.compressed_all_reduce(x, cfg, one_shot_max_bytes=one_shot_max_bytes).flatten()[:3].tolist()


def tp_mlp_vs_reference(ctx, compression: str | None, seq: int = 8, batch: int = 2, hidden: int = 64,
                        ffn: int = 128, seed: int = 0, grad_compression: str | None = "same") -> dict:
    """A column -> GELU -> row MLP with sequence parallelism against the same MLP on one process:
    output and every gradient (input, weights, biases)."""
    from commweave.taco.tp import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads

    world, rank = ctx.world_size, ctx.rank
    cfg = None if compression is None else QuantConfig(64, compression)
    grad_cfg = cfg if grad_compression == "same" else (None if grad_compression is None else QuantConfig(64, grad_compression))
    gen = torch.Generator().manual_seed(seed)
    x_full = torch.randn(seq, batch, hidden, generator=gen)
    w1 = torch.randn(ffn, hidden, generator=gen) / hidden ** 0.5
    b1 = torch.randn(ffn, generator=gen) * 0.1
    w2 = torch.randn(hidden, ffn, generator=gen) / ffn ** 0.5
    b2 = torch.randn(hidden, generator=gen) * 0.1
    probe = torch.randn(seq, batch, hidden, generator=gen)

    # single-process reference
    xr = x_full.clone().requires_grad_()
    w1r, b1r, w2r, b2r = (t.clone().requires_grad_() for t in (w1, b1, w2, b2))
    yr = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(xr, w1r, b1r)), w2r, b2r)
    (yr * probe).sum().backward()

    col = ColumnParallelLinear(hidden, ffn, bias=True, compression=cfg, grad_compression=grad_cfg)
    row = RowParallelLinear(ffn, hidden, bias=True, compression=cfg, grad_compression=grad_cfg)
    col.load_full_weight(w1, b1)
    row.load_full_weight(w2, b2)
    s = seq // world
    x = x_full[rank * s:(rank + 1) * s].clone().requires_grad_()
    y = row(torch.nn.functional.gelu(col(x)))
    (y * probe[rank * s:(rank + 1) * s]).sum().backward()
    allreduce_sequence_parallel_grads([col, row])

    f = ffn // world
    return {
        "out": _rel(y.detach(), yr.detach()[rank * s:(rank + 1) * s]),
        "grad_x": _rel(x.grad, xr.grad[rank * s:(rank + 1) * s]),
        "grad_w1": _rel(col.weight.grad, w1r.grad[rank * f:(rank + 1) * f]),
        "grad_b1": _rel(col.bias.grad, b1r.grad[rank * f:(rank + 1) * f]),
        "grad_w2": _rel(row.weight.grad, w2r.grad[:, rank * f:(rank + 1) * f]),
        "grad_b2": _rel(row.bias.grad, b2r.grad),
        "out_shape": list(y.shape),
    }
