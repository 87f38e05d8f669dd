"""The workloads as PyTorch functions for users' distributed models.

Every function is collective over its `group` (a ProcessGroup, a 1-D DeviceMesh, (mesh, dim), or
None: the default group, or this process alone when torch.distributed is not initialized): call it
on every rank of the group, in the same order, with tensors of the same shapes (the first call for
a shape runs the program's setup on all its ranks: symmetric windows, device communicators, kernel
compiles; later calls reuse it, and may run inside a CUDA graph capture; the first may not). On a
group of one rank the call computes locally with no communication. Each function calls a
`torch.ops.commweave.*` custom op, so torch.compile(fullgraph=True) keeps it in its graph.
`program` picks what runs: None for the workload's seed (its baseline program where the seed
cannot run, e.g. on CPU, with one warning), a program name (`commweave list`), or a file that
`commweave export` wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from commweave.ops.exported import export_info
from commweave.ops.groups import SINGLE, GroupLike, group_name
from commweave.ops import library, runner
from commweave.ops.runner import Op, ProgramSpec, op
from commweave.workloads.attention_cp.ring import check_inputs as ring_check


def _spec(program: ProgramSpec) -> str | None:
    return None if program is None else os.fspath(program)


def gemm_allgather(a_shard: torch.Tensor, b_local: torch.Tensor, program: ProgramSpec = None,
                   group: GroupLike = None) -> torch.Tensor:
    """out [M, N/W] = all_gather(A) @ B_local: a column-parallel linear layer whose input rows are
    sharded over the W ranks, the gather hidden behind the GEMM. Has a backward.

    a_shard: this rank's rows of A, [M/W, K] bf16 (rank r holds rows r*M/W ...). b_local: this
    rank's columns of B, [K, N/W] bf16. Returns this rank's columns of the product, [M, N/W] bf16.
    """
    return torch.ops.commweave.gemm_allgather(a_shard, b_local, group_name(group), _spec(program))


def gemm_reducescatter(a_local: torch.Tensor, b_local: torch.Tensor, program: ProgramSpec = None,
                       group: GroupLike = None) -> torch.Tensor:
    """out [M/W, N] = reduce_scatter(A_local @ B_local) over rows: a row-parallel linear layer whose
    output goes back to sequence-sharded rows. Has a backward.

    a_local [M, K/W] (this rank's columns of A), b_local [K/W, N] (its rows of B). Returns this
    rank's rows r*M/W ... of the summed product, [M/W, N]. Runs the `gemm-reducescatter` workload's
    program where that workload is installed, else torch.matmul and NCCL's reduce-scatter (with one
    warning).
    """
    return torch.ops.commweave.gemm_reducescatter(a_local, b_local, group_name(group), _spec(program))


LAYOUTS = ("contiguous", "zigzag")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                               program: ProgramSpec = None, group: GroupLike = None,
                               layout: str | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of the whole sequence, which is
    sharded over the W ranks (context parallelism), with a backward.

    q [B, S/W, Hq, D] (or [S/W, Hq, D]: batch 1), k and v [B, S/W, Hkv, D], sequence-major (Hq a
    multiple of Hkv: grouped-query attention). `layout` (default zigzag when causal, else
    contiguous): contiguous, rank r holds block r of W; zigzag balances causal work, the sequence
    cut in 2W chunks and rank r holding chunks r and 2W-1-r, in that order
    (`commweave.workloads.attention_cp.attention.shard_ranges` gives them). Returns q's shape.
    Where q, k or v require grad (or the batch, or a layout the programs lack), the ring forward
    keeps the LSE and the ring backward runs (`context_parallel_attention_lse`); otherwise
    `program` runs (bf16, one call per sequence of the batch). In one process (no group) this is
    SDPA on [B, H, S, D] views: its fused kernels, forward and backward.
    """
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, not {causal!r}")
    zigzag = layout_is_zigzag(layout, causal)
    name = group_name(group)
    if name == SINGLE:
        if program is not None:
            op("attention-cp", program)  # a wrong name fails alike on any W
        return local_attention(q, k, v, causal)
    return sharded_attention(q, k, v, causal, zigzag, name, program)


def layout_is_zigzag(layout: str | None, causal: bool) -> bool:
    """Whether `layout` (None: zigzag for causal, contiguous for full attention) is zigzag."""
    if layout is None:
        return causal
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', not {layout!r}")
    return layout == "zigzag"


def _batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as [B, S, H, D] (a 3-D [S, H, D] gets batch 1); a ValueError for other ranks."""
    if not q.dim() == k.dim() == v.dim() or q.dim() not in (3, 4):
        raise ValueError(f"q, k, v must all be [B, S/W, H, D] or all [S/W, H, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    return (q, k, v) if q.dim() == 4 else (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """One rank holds the whole sequence: SDPA on [B, H, S, D] views of the sequence-major tensors
    (4-D, so its flash / efficient kernels run; GQA native), no copies; torch's own backward."""
    qb, kb, vb = _batched(q, k, v)
    ring_check(qb, kb, vb)
    out = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                         is_causal=causal, enable_gqa=qb.shape[2] != kb.shape[2]).transpose(1, 2)
    return out if q.dim() == 4 else out[0]


def sharded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, zigzag: bool, group: str,
                      program: ProgramSpec = None) -> torch.Tensor:
    """`context_parallel_attention` over the group named `group` (W >= 2, or a group of one)."""
    qb, kb, vb = _batched(q, k, v)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if training and program is not None:
        raise ValueError(f"program {os.fspath(program)!r} is forward-only; q, k or v require grad, so the ring "
                         "forward and backward run: drop program= or call under torch.no_grad()")
    if zigzag != causal and program is not None:
        raise ValueError(f"program {os.fspath(program)!r} runs zigzag causal or contiguous full attention, not "
                         f"{'zigzag' if zigzag else 'contiguous'} {'causal' if causal else 'full'}: drop program=")
    if training or zigzag != causal:
        out = torch.ops.commweave.context_parallel_attention_lse(qb, kb, vb, causal, zigzag, group)[0]
        return out if q.dim() == 4 else out[0]
    if q.dim() == 3:
        return torch.ops.commweave.context_parallel_attention(q, k, v, causal, group, _spec(program))
    return torch.stack([torch.ops.commweave.context_parallel_attention(qb[b], kb[b], vb[b], causal, group,
                                                                       _spec(program)) for b in range(qb.shape[0])])


def moe_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, program: ProgramSpec = None, group: GroupLike = None) -> torch.Tensor:
    """An expert-parallel MoE layer (routed experts, SwiGLU): each token goes to its top-k experts
    wherever they live and comes back as sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]).
    Has a backward (x, topk_weights, w13, w2): where one of them requires grad the call takes the
    training path, the host all-to-all exchange, and keeps what the backward needs; `program` then
    must be None.

    x [T, H] bf16 (T equal on every rank); topk_idx [T, k] int64, global expert ids in [0, E),
    distinct per token (not checked: that would stall the GPU every call); topk_weights [T, k]
    float32; w13 [E/W, 2I, H] bf16 (gate rows, then up rows) and w2 [E/W, H, I] bf16, this rank's
    experts r*E/W ... (r+1)*E/W - 1. Returns [T, H] bf16.
    """
    return library.moe_forward(x, topk_idx, topk_weights, w13, w2, group_name(group), _spec(program))


def transfer_kv(kv: torch.Tensor | None, src_blocks: torch.Tensor, dst_blocks: torch.Tensor, cache: torch.Tensor,
                program: ProgramSpec = None, group: GroupLike = None) -> torch.Tensor:
    """Move one sequence's paged KV cache from a prefill GPU to a decode GPU (disaggregated
    serving). The group's ranks pair up as (0 -> 1), (2 -> 3): an even rank is the source, the next
    odd rank its destination; both call this together. On one rank, that rank is both.

    cache: this rank's paged cache [L, 2, NB, 16, KV, 128] bf16 (vLLM's per-layer [2, NB, 16, KV,
    D] stacked over layers; the same geometry on both ranks), written in place and returned. On
    GPUs the source stores straight into the destination's cache, so every rank allocates its
    cache once with `commweave.ops.symmetric_zeros(..., group=)` (a symmetric window).
    src_blocks, dst_blocks: int64 [nb], the sequence's pages in the source's and the destination's
    cache, the same tables on both ranks (distinct, in [0, NB): not checked). kv: on the source,
    the sequence's new K/V [L, 2, S, KV, 128] bf16 with ceil(S/16) = nb, which it writes into its
    pages src_blocks (zeros past S in the last page) and sends; on the destination None. After the
    call the destination's page dst_blocks[i] holds the source's page src_blocks[i], bit for bit;
    no other block of either cache is written.
    """
    runner.no_backward("transfer_kv", {"kv": kv, "cache": cache})
    torch.ops.commweave.transfer_kv(kv, src_blocks, dst_blocks, cache, group_name(group), _spec(program))
    return cache


def load(path: str | os.PathLike, workload: str | None = None) -> Op:
    """The op of a program file `commweave export` wrote; its export line names the workload, so
    `load(path)(**tensors, group=...)` runs it (tensors named as in the workload's inputs, an output
    the caller owns as `out=`). A file without that line needs `workload`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no program file at {path}")
    info = export_info(path.read_text())
    named = info["workload"] if info is not None else None
    if named is None and workload is None:
        raise ValueError(f"{path} has no '# commweave-export:' line naming its workload (write it with "
                         "`commweave export`, or pass workload=)")
    if named is not None and workload is not None and named != workload:
        raise ValueError(f"{path} was exported for workload {named!r}, not {workload!r}")
    return op(named or workload, path)


__all__ = ["context_parallel_attention", "gemm_allgather", "gemm_reducescatter", "load", "moe_layer", "op",
           "transfer_kv"]
