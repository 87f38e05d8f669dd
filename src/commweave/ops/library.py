"""The ops as `torch.library` custom ops in the `commweave` namespace: torch.compile sees each call
as one opaque op with a fake (meta) implementation, so `fullgraph=True` compiles without graph
breaks; autograd where a backward exists (the tensor-parallel pair, attention's `_lse` op, the MoE
layer through moe_layer_train / moe_layer_backward); the group travels by name.

    torch.ops.commweave.gemm_allgather(a, b, group, program)           -> [M, N/W]
    torch.ops.commweave.gemm_reducescatter(a, b, group, program)       -> [M/W, N]
    torch.ops.commweave.context_parallel_attention(q, k, v, causal, group, program)
    torch.ops.commweave.context_parallel_attention_lse(q, k, v, causal, zigzag, group) -> (out, lse)  (autograd)
    torch.ops.commweave.moe_layer(x, topk_idx, topk_weights, w13, w2, group, program)
    torch.ops.commweave.moe_layer_train(x, topk_idx, topk_weights, w13, w2, group) -> (out, *saved)
    torch.ops.commweave.moe_layer_backward(grad, topk_idx, topk_weights, w13, w2, *saved, group)
    torch.ops.commweave.transfer_kv(kv, src_blocks, dst_blocks, cache!, group, program) (cache written)
    torch.ops.commweave.call(workload, program, group, names, inputs, options) / call_out(..., out!)

`group` is a process group's name ("" for a single process); `program` None for the workload's
seed. With W = 1 every op computes locally with no communication (its workload's
`single_rank`; a named program is still looked up, so a wrong name fails alike on any W); with W >= 2 the
real implementation runs the workload's program through `runner.Op` (setup per shape,
collectives), opaque to dynamo.
"""

from __future__ import annotations

import ast
import functools
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from commweave.contracts.workload import check_matmul_operands
from commweave.ops import runner
from commweave.ops.groups import group_rank, group_size, process_group
from commweave.workloads.attention_cp.ring import check_inputs as check_attention_inputs
from commweave.workloads.attention_cp.ring import ring_backward, ring_forward

GEMM_RS = "gemm-reducescatter"  # the workload gemm_reducescatter runs where it is registered


# -- collectives of the torch paths (functional: traceable inside compiled backward graphs) --------
def _all_gather_rows(t: Tensor, group: str, wait: bool = True) -> Tensor:
    """Every rank's `t` stacked along dim 0, in rank order (itself on one rank). `wait=False`
    returns the collective's pending result: pass it to `_waited` once the work to overlap with it
    is queued."""
    world = group_size(group)
    if world == 1:
        return t
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(t.contiguous(), world, group)
    return _waited(gathered, group) if wait else gathered


def _waited(t: Tensor, group: str) -> Tensor:
    return t if group_size(group) == 1 else torch.ops._c10d_functional.wait_tensor(t)


def _product_like(b: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """left @ right, the gradient of `b`, laid out as `b` is: where b is the transpose of a
    row-major matrix (a layer passes weight.t()), as (right^T @ left^T)^T, the same GEMM, so the
    gradient reaches that weight row-major and autograd does not copy it into the weight's layout
    (a transposing copy of the whole weight, per weight and step)."""
    if b.shape[1] > 1 and b.stride(0) == 1 and b.stride(1) >= b.shape[0]:
        return (right.t() @ left.t()).t()
    return left @ right


@functools.cache
def _registered(workload: str) -> bool:
    from commweave.workloads import registry

    return workload in registry()


# -- gemm_allgather: out [M, N/W] = all_gather(a) @ b ---------------------------------------------
@torch.library.custom_op("commweave::gemm_allgather", mutates_args=())
def gemm_allgather(a: Tensor, b: Tensor, group: str, program: Optional[str]) -> Tensor:
    op = runner.op("gemm-allgather", program)
    if group_size(group) == 1:
        return op.workload.single_rank({"a": a, "b": b})
    return op.run(group, {"a": a, "b": b})


@gemm_allgather.register_fake
def _(a: Tensor, b: Tensor, group: str, program: Optional[str]) -> Tensor:
    check_matmul_operands(a, b)
    return a.new_empty(a.shape[0] * group_size(group), b.shape[1])


def _save_ab(ctx: Any, inputs: tuple, output: Tensor) -> None:
    a, b, group, _ = inputs
    ctx.group = group
    ctx.save_for_backward(a, b)


def _gemm_allgather_backward(ctx: Any, grad: Tensor) -> tuple:
    """grad_a = reduce_scatter(grad @ b^T) (the GEMM+RS op); grad_b = all_gather(a)^T @ grad, A
    gathered again here (as Megatron's sequence parallelism does: no [M, K] kept from forward),
    the gather started first so it overlaps grad_a's op."""
    a, b = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = grad_b = None
    pending = _all_gather_rows(a, ctx.group, wait=False) if ctx.needs_input_grad[1] else None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.commweave.gemm_reducescatter(grad, b.t(), ctx.group, None)
    if pending is not None:
        grad_b = _product_like(b, _waited(pending, ctx.group).t(), grad)
    return grad_a, grad_b, None, None


gemm_allgather.register_autograd(_gemm_allgather_backward, setup_context=_save_ab)


# -- gemm_reducescatter: out [M/W, N] = reduce_scatter(a @ b) over rows ---------------------------
_rs_warned: list[bool] = []


@torch.library.custom_op("commweave::gemm_reducescatter", mutates_args=())
def gemm_reducescatter(a: Tensor, b: Tensor, group: str, program: Optional[str]) -> Tensor:
    world = group_size(group)
    if _registered(GEMM_RS):
        op = runner.op(GEMM_RS, program)
        return op.workload.single_rank({"a": a, "b": b}) if world == 1 else op.run(group, {"a": a, "b": b})
    if program is not None:
        raise ValueError(f"program {program!r} is for workload {GEMM_RS!r}, which is not registered in this install")
    check_matmul_operands(a, b)
    if world == 1:
        return a @ b
    if a.shape[0] % world:
        raise ValueError(f"a has {a.shape[0]} rows, not divisible by the group's {world} ranks (each gets M/W rows)")
    if not _rs_warned:
        _rs_warned.append(True)
        warnings.warn(f"commweave.ops: no workload {GEMM_RS!r} is registered; gemm_reducescatter runs torch.matmul "
                      "and NCCL's reduce-scatter (no overlap)", RuntimeWarning, stacklevel=2)
    out = a.new_empty(a.shape[0] // world, b.shape[1])
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (torch 2.11: old name)
    scatter(out, a @ b, group=process_group(group))
    return out


@gemm_reducescatter.register_fake
def _(a: Tensor, b: Tensor, group: str, program: Optional[str]) -> Tensor:
    check_matmul_operands(a, b)
    world = group_size(group)
    torch._check(a.shape[0] % world == 0, lambda: f"a's rows are not divisible by the group's {world} ranks")
    return a.new_empty(a.shape[0] // world, b.shape[1])


def _gemm_reducescatter_backward(ctx: Any, grad: Tensor) -> tuple:
    """grad_a = all_gather(grad) @ b^T (the GEMM+AG op when b needs no gradient); grad_b =
    a^T @ all_gather(grad), the gathered gradient shared by both."""
    a, b = ctx.saved_tensors
    grad = grad.contiguous()
    if ctx.needs_input_grad[0] and not ctx.needs_input_grad[1]:
        return torch.ops.commweave.gemm_allgather(grad, b.t(), ctx.group, None), None, None, None
    gathered = _all_gather_rows(grad, ctx.group)
    grad_a = gathered @ b.t() if ctx.needs_input_grad[0] else None
    return grad_a, _product_like(b, a.t(), gathered), None, None


gemm_reducescatter.register_autograd(_gemm_reducescatter_backward, setup_context=_save_ab)


# -- forward-only ops (their training paths are the `_lse` and `_train` ops below) ---------------
@torch.library.custom_op("commweave::context_parallel_attention", mutates_args=())
def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, group: str,
                               program: Optional[str]) -> Tensor:
    op = runner.op("attention-cp", program)
    if group_size(group) == 1:
        return op.workload.single_rank({"q": q, "k": k, "v": v}, causal=causal)
    return op.run(group, {"q": q, "k": k, "v": v}, causal=causal)


@context_parallel_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, group: str, program: Optional[str]) -> Tensor:
    return q.new_empty(q.shape)


def _no_attention_backward(ctx: Any, grad: Tensor) -> tuple:
    raise RuntimeError("torch.ops.commweave.context_parallel_attention runs forward-only programs: train through "
                       "commweave.ops.context_parallel_attention or commweave.nn.ContextParallelAttention (the op "
                       "context_parallel_attention_lse, which has a backward)")


context_parallel_attention.register_autograd(_no_attention_backward)


# -- context_parallel_attention_lse: the differentiable attention (ring forward and backward) ------
def _group_or_none(group: str) -> Optional[dist.ProcessGroup]:
    return None if group_size(group) == 1 else process_group(group)


@torch.library.custom_op("commweave::context_parallel_attention_lse", mutates_args=())
def context_parallel_attention_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool, zigzag: bool,
                                   group: str) -> tuple[Tensor, Tensor]:
    return ring_forward(q, k, v, causal, zigzag, _group_or_none(group))


@context_parallel_attention_lse.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, zigzag: bool, group: str) -> tuple[Tensor, Tensor]:
    check_attention_inputs(q, k, v)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("commweave::context_parallel_attention_backward", mutates_args=())
def context_parallel_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                        causal: bool, zigzag: bool, group: str) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, causal, zigzag, _group_or_none(group))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@context_parallel_attention_backward.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, zigzag: bool,
      group: str) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_attention(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, ctx.causal, ctx.zigzag, ctx.group = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.mark_non_differentiable(output[1])


def _attention_backward(ctx: Any, dout: Tensor, _: Optional[Tensor]) -> tuple:
    """dq, dk, dv by the ring backward (the LSE output carries no gradient)."""
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.commweave.context_parallel_attention_backward(dout.contiguous(), q, k, v, out, lse,
                                                                        ctx.causal, ctx.zigzag, ctx.group)
    return dq, dk, dv, None, None, None


context_parallel_attention_lse.register_autograd(_attention_backward, setup_context=_save_attention)


@torch.library.custom_op("commweave::moe_layer", mutates_args=())
def moe_layer(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, group: str,
              program: Optional[str]) -> Tensor:
    op = runner.op("moe", program)
    inputs = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    return op.workload.single_rank(inputs) if group_size(group) == 1 else op.run(group, inputs)


@moe_layer.register_fake
def _(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, group: str,
      program: Optional[str]) -> Tensor:
    return x.new_empty(x.shape)


# -- the MoE layer with a backward: moe_layer_train keeps what moe_layer_backward needs -------------
MOE = "moe"


@torch.library.custom_op("commweave::moe_layer_train", mutates_args=())
def moe_layer_train(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                    group: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, *saved): moe_layer's output by the host all-to-all exchange (none on one rank) and the
    tensors its backward needs (`workloads.moe.training.Saved`, static shapes)."""
    inputs = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    out, saved = runner.op(MOE).workload.train_forward(inputs, _moe_group(group))
    return (out, *saved)


def _moe_group(group: str) -> Optional[dist.ProcessGroup]:
    return None if group_size(group) == 1 else process_group(group)


@moe_layer_train.register_fake
def _(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
      group: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    world = group_size(group)
    pairs, (per_rank, two_i, hidden) = topk_idx.numel(), w13.shape
    rows = world * pairs  # the expert side's bound: no source sends more than its T*K pairs
    return (x.new_empty(x.shape), x.new_empty(pairs, hidden), x.new_empty(rows, hidden), x.new_empty(rows, two_i),
            x.new_empty(rows, two_i // 2), topk_idx.new_empty(pairs), topk_idx.new_empty(per_rank * world),
            topk_idx.new_empty(per_rank * world))


def _save_moe(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, topk_idx, topk_weights, w13, w2, group = inputs
    ctx.group = group
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(topk_idx, topk_weights, w13, w2, *output[1:])


def _moe_layer_backward(ctx: Any, grad: Tensor, *_unused: Optional[Tensor]) -> tuple:
    """Through moe_layer_backward: the combine's backward a dispatch, the dispatch's a combine."""
    topk_idx, topk_weights, w13, w2, *saved = ctx.saved_tensors
    grads = torch.ops.commweave.moe_layer_backward(grad.contiguous(), topk_idx, topk_weights, w13, w2, *saved,
                                                   ctx.group)
    grad_x, grad_weights, grad_w13, grad_w2 = (g if ctx.needs_input_grad[i] else None
                                               for i, g in zip((0, 2, 3, 4), grads))
    return grad_x, None, grad_weights, grad_w13, grad_w2, None


moe_layer_train.register_autograd(_moe_layer_backward, setup_context=_save_moe)


@torch.library.custom_op("commweave::moe_layer_backward", mutates_args=())
def moe_layer_backward(grad: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                       pair_outputs: Tensor, rows: Tensor, gate_up: Tensor, hidden: Tensor, order: Tensor,
                       counts: Tensor, recv_counts: Tensor, group: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_topk_weights, grad_w13, grad_w2) of moe_layer_train's output gradient."""
    inputs = {"topk_idx": topk_idx, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    saved = (pair_outputs, rows, gate_up, hidden, order, counts, recv_counts)
    return runner.op(MOE).workload.train_backward(grad, inputs, saved, _moe_group(group))


@moe_layer_backward.register_fake
def _(grad: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, pair_outputs: Tensor,
      rows: Tensor, gate_up: Tensor, hidden: Tensor, order: Tensor, counts: Tensor, recv_counts: Tensor,
      group: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return grad.new_empty(grad.shape), topk_weights.new_empty(topk_weights.shape), w13.new_empty(w13.shape), \
        w2.new_empty(w2.shape)


def moe_forward(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, group: str,
                program: Optional[str]) -> Tensor:
    """The MoE layer as a model calls it: `moe_layer` (the workload's program), or, where autograd
    will need a gradient of x, topk_weights, w13 or w2, `moe_layer_train` (the host all-to-all
    exchange, whose backward is `moe_layer_backward`; there is no device-initiated backward yet,
    so a named program is refused there rather than silently not run)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2)):
        if program is not None:
            raise ValueError(f"program {program!r} runs moe_layer's forward only; a call that needs a gradient runs "
                             "the training path (host all-to-all): pass program=None, or call under torch.no_grad()")
        return torch.ops.commweave.moe_layer_train(x, topk_idx, topk_weights, w13, w2, group)[0]
    return torch.ops.commweave.moe_layer(x, topk_idx, topk_weights, w13, w2, group, program)


@torch.library.custom_op("commweave::transfer_kv", mutates_args=("cache",))
def transfer_kv(kv: Optional[Tensor], src_blocks: Tensor, dst_blocks: Tensor, cache: Tensor, group: str,
                program: Optional[str]) -> None:
    op = runner.op("kv-transfer", program)
    inputs = {"kv": kv, "src_blocks": src_blocks, "dst_blocks": dst_blocks}
    if group_size(group) == 1:
        op.workload.single_rank(inputs, cache)
    else:
        op.run(group, inputs, out=cache)


@transfer_kv.register_fake
def _(kv: Optional[Tensor], src_blocks: Tensor, dst_blocks: Tensor, cache: Tensor, group: str,
      program: Optional[str]) -> None:
    return None



def _moe_layer_forward_only(ctx: Any, *grads: Tensor) -> tuple:
    raise RuntimeError("torch.ops.commweave.moe_layer is forward-only: call commweave.ops.moe_layer or "
                       "commweave.nn.ExpertParallelMoE, which take the training path (moe_layer_train) when a "
                       "gradient is needed")


moe_layer.register_autograd(_moe_layer_forward_only)


# -- any workload's program: Op objects (`commweave.ops.op(name)`, `load(path)`) ----------------
def _named(names: str, inputs: list[Optional[Tensor]]) -> dict[str, Tensor | None]:
    return dict(zip(names.split(","), inputs))


def _options(encoded: str) -> dict[str, Any]:
    """The options `Op.__call__` encoded as "name=repr,..." (Python literals: bools, numbers,
    strings; a format dynamo traces, which JSON is not)."""
    pairs = (item.split("=", 1) for item in encoded.split(",") if item)
    return {name: ast.literal_eval(value) for name, value in pairs}


@torch.library.custom_op("commweave::call", mutates_args=())
def call(workload: str, program: Optional[str], group: str, names: str, inputs: list[Optional[Tensor]],
         options: str) -> Tensor:
    op = runner.op(workload, program)
    if group_size(group) == 1:
        return op.workload.single_rank(_named(names, inputs), **_options(options))
    return op.run(group, _named(names, inputs), None, **_options(options))


@call.register_fake
def _(workload: str, program: Optional[str], group: str, names: str, inputs: list[Optional[Tensor]],
      options: str) -> Tensor:
    op, named, opts = runner.op(workload, program), _named(names, inputs), _options(options)
    world = group_size(group)
    if world == 1:
        return op.workload.single_rank(named, **opts)
    rank = group_rank(group)
    shape = op.shape(named, world, rank, None, opts)
    like = op.workload.make_output(shape, world, rank, torch.device("meta"))
    first = next(t for t in named.values() if t is not None)
    return first.new_empty(like.shape, dtype=like.dtype)


@torch.library.custom_op("commweave::call_out", mutates_args=("out",))
def call_out(workload: str, program: Optional[str], group: str, names: str, inputs: list[Optional[Tensor]],
             options: str, out: Tensor) -> None:
    op = runner.op(workload, program)
    if group_size(group) == 1:
        op.workload.single_rank(_named(names, inputs), out, **_options(options))
    else:
        op.run(group, _named(names, inputs), out, **_options(options))


@call_out.register_fake
def _(workload: str, program: Optional[str], group: str, names: str, inputs: list[Optional[Tensor]],
      options: str, out: Tensor) -> None:
    return None
