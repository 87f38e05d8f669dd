"""Attention math shared by the workload, its reference and its programs.

Layout everywhere: sequence-major, batch 1 dropped. Queries [Sq, Hq, D], keys and values
[Sk, Hkv, D] with Hq a multiple of Hkv (grouped-query attention: query head h reads KV head
h // (Hq // Hkv)). Outputs are [Sq, Hq, D]; log-sum-exps [Sq, Hq] in float32 (natural log of
the softmax denominator, scores already scaled).

- `shard_ranges`: which global positions a rank holds (contiguous, or zigzag for causal).
- `block_kind`: how a block of queries sees a block of keys under the causal mask.
- `attention_with_lse`: one block's attention and its LSE (plain torch, or torch's flash kernel).
- `attention_backward_block`: one block's dq, dk, dv from the queries' global output and LSE.
- `merge_partials`: the online-softmax merge of two partial results by their LSEs.
- `chunked_attention`: exact fp32 attention at arbitrary positions, in blocks (the reference).
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


# -- sharding -------------------------------------------------------------------------------------
def shard_ranges(seq: int, world: int, rank: int, causal: bool) -> list[tuple[int, int]]:
    """Global position ranges [start, end) of `rank`'s tokens, in the order they are stored.

    Non-causal: one contiguous block of seq/W. Causal: zigzag (head-tail) load balancing, the
    sequence cut into 2W chunks and rank r holding chunks r and 2W-1-r, so every rank has the
    same number of visible (query, key) pairs. This is the layout torch's context parallelism
    uses with load balancing on.
    """
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    parts = 2 * world if causal else world
    if seq <= 0 or seq % parts:
        how = "2 x world size (zigzag causal sharding)" if causal else "the world size"
        raise ValueError(f"sequence length {seq} is not a positive multiple of {how} = {parts}")
    chunk = seq // parts
    if not causal:
        return [(rank * chunk, (rank + 1) * chunk)]
    return [(rank * chunk, (rank + 1) * chunk), ((parts - 1 - rank) * chunk, (parts - rank) * chunk)]


def shard_positions(seq: int, world: int, rank: int, causal: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of `rank`'s tokens in local order (int64)."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in shard_ranges(seq, world, rank, causal)])


def visible_pairs(seq: int, world: int, rank: int, causal: bool) -> int:
    """(query, key) pairs `rank`'s queries attend to: seq/W * seq, or under the causal mask the
    sum over its positions p of p + 1."""
    total = 0
    for a, b in shard_ranges(seq, world, rank, causal):
        total += (b - a) * seq if not causal else (a + b + 1) * (b - a) // 2
    return total


def block_kind(q_range: tuple[int, int], k_range: tuple[int, int], causal: bool) -> str:
    """How queries at positions q_range see keys at k_range: 'full', 'causal' (the same range:
    the square diagonal block, top-left aligned), 'skip' (all masked) or 'partial' (anything else;
    no program here produces it, since blocks follow the zigzag chunks)."""
    (qa, qb), (ka, kb) = q_range, k_range
    if not causal or kb - 1 <= qa:
        return "full"
    if ka > qb - 1:
        return "skip"
    if (qa, qb) == (ka, kb):
        return "causal"
    return "partial"


# -- one block's attention with its log-sum-exp ---------------------------------------------------
def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [seq, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match each other and q's head dim {q.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    return q.shape[1] // k.shape[1]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: float | None = None, backend: str = "auto",
                       native_gqa: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T [+ causal mask]) v for one block, and the rows' log-sum-exp.

    `causal`: the top-left aligned diagonal mask (query i sees keys j <= i), for square blocks.
    Returns (out [Sq, Hq, D] in q's dtype for 'cudnn'/'flash', float32 for 'torch'; lse [Sq, Hq]
    float32). Rows with every key masked have lse -inf and out 0.
    backend 'torch': float32 math (any device; memory Sq*Sk*Hq floats). 'cudnn': cuDNN's fused
    attention (`aten._scaled_dot_product_cudnn_attention`, what SDPA runs on Hopper: ~1.7x torch's
    flash-attention-2 kernel there). 'flash': torch's flash kernel. For the GPU kernels KV heads are
    repeated for GQA unless `native_gqa` (the kernel reads KV head h // group itself). 'auto':
    cudnn on CUDA half tensors where cuDNN takes the head dim, else flash, else torch.
    """
    group = _check_qkv(q, k, v)
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"a causal block must be square, got {q.shape[0]} queries and {k.shape[0]} keys")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    if backend == "auto":
        backend = pick_backend(q)
    if backend in ("flash", "cudnn"):
        if group > 1 and not native_gqa:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, S, D] views
        if backend == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, causal, False, scale=scale)
        else:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]  # [1, Hq, Sq, D] (a view of [1, Sq, Hq, D]), [1, Hq, Sq] (cuDNN: [.., 1])
        return out[0].transpose(0, 1), lse.reshape(q.shape[1], q.shape[0]).transpose(0, 1)
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'torch', 'cudnn' or 'flash', not {backend!r}")
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    qg = q.float().reshape(sq, hkv, group, d)
    scores = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale  # [Hkv, g, Sq, Sk]
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores.masked_fill_(mask, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, g, Sq]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe.unsqueeze(-1))
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float()).reshape(sq, hq, d)
    return out, lse.reshape(hq, sq).transpose(0, 1).contiguous()


def pick_backend(q: torch.Tensor) -> str:
    """'auto' resolved for queries like q: cuDNN where it runs (CUDA, fp16/bf16, head dim a
    multiple of 8 up to 128), torch's flash kernel for other half-precision CUDA heads, else the
    float32 torch math."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return "torch"
    d = q.shape[-1]
    return "cudnn" if torch.backends.cudnn.is_available() and d % 8 == 0 and d <= 128 else "flash"


# -- one block's backward, the softmax recomputed from the rows' global log-sum-exp --------------
def attention_backward_block(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False, scale: float | None = None,
                             backend: str = "auto", q_block: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients one block of keys contributes: (dq [Sq, Hq, D], dk, dv [Sk, Hkv, D]), float32.

    `out` [Sq, Hq, D] and `lse` [Sq, Hq] are the queries' final output and log-sum-exp over *every*
    key they see (not this block's), so P = exp(scale q k^T - lse) is this block's share of the
    global softmax and the blocks' gradients simply add up (dq summed over key blocks, dk and dv
    over query blocks): dV = P^T dO, dS = P (dO V^T - rowsum(dO * out)), dQ = scale dS K,
    dK = scale dS^T Q. GQA: a KV head's dk, dv sum over its query heads.
    backend 'torch': float32 math in tiles of `q_block` queries (memory q_block * Sk * Hq floats;
    no Sq x Sk tensor). 'cudnn': cuDNN's fused backward (what SDPA runs on Hopper; GQA native).
    'flash': torch's flash backward kernel (K/V repeated per query head for GQA, their gradients
    summed back). 'auto': `pick_backend` (cudnn, else flash on CUDA half tensors, else torch).
    """
    group = _check_qkv(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:2]:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} its [Sq, Hq]")
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"a causal block must be square, got {q.shape[0]} queries and {k.shape[0]} keys")
    if q_block <= 0:
        raise ValueError(f"q_block must be positive, got {q_block}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    if backend == "auto":
        backend = pick_backend(q)
    if backend in ("flash", "cudnn"):
        return _fused_backward_block(dout, q, k, v, out, lse, causal, scale, group, backend)
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'torch', 'cudnn' or 'flash', not {backend!r}")
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    kf, vf = k.float(), v.float()
    dq = torch.empty(sq, hq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(sk, hkv, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(sk, hkv, d, dtype=torch.float32, device=q.device)
    for r0 in range(0, sq, q_block):
        r1 = min(sq, r0 + q_block)
        qs = q[r0:r1].float().reshape(r1 - r0, hkv, group, d)
        do = dout[r0:r1].float().reshape(r1 - r0, hkv, group, d)
        rows = lse[r0:r1].float().reshape(r1 - r0, hkv, group).permute(1, 2, 0).unsqueeze(-1)  # [Hkv, g, q, 1]
        delta = (do * out[r0:r1].float().reshape(r1 - r0, hkv, group, d)).sum(-1).permute(1, 2, 0).unsqueeze(-1)
        scores = torch.einsum("qhgd,khd->hgqk", qs, kf) * scale
        if causal:
            seen = torch.arange(r0, r1, device=q.device).view(-1, 1) >= torch.arange(sk, device=q.device).view(1, -1)
            scores.masked_fill_(~seen, NEG_INF)
        probs = torch.exp(scores - torch.where(torch.isfinite(rows), rows, torch.zeros_like(rows)))
        dv += torch.einsum("hgqk,qhgd->khd", probs, do)
        dscores = probs * (torch.einsum("qhgd,khd->hgqk", do, vf) - delta)
        dq[r0:r1] = (torch.einsum("hgqk,khd->qhgd", dscores, kf) * scale).reshape(r1 - r0, hq, d)
        dk += torch.einsum("hgqk,qhgd->khd", dscores, qs) * scale
    return dq, dk, dv


def _fused_backward_block(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, causal: bool, scale: float, group: int,
                          backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention_backward_block` by cuDNN's or torch's flash backward kernel on [1, H, S, D] views."""
    if group > 1 and backend == "flash":
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qh, kh, vh, oh, dh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, out.to(q.dtype), dout.to(q.dtype)))
    lse_h = lse.float().transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, Sq], as the forward kernels return it
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
    if backend == "cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dh, qh, kh, vh, oh, lse_h.unsqueeze(-1), no_rng, no_rng, None, None, None, q.shape[0], k.shape[0], 0.0,
            causal, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dh, qh, kh, vh, oh, lse_h, None, None, q.shape[0], k.shape[0], 0.0, causal, no_rng, no_rng, scale=scale)
    dq, dk, dv = (t[0].transpose(0, 1).float() for t in (dq, dk, dv))
    if group > 1 and backend == "flash":
        dk, dv = (t.reshape(t.shape[0], -1, group, t.shape[2]).sum(2) for t in (dk, dv))
    return dq, dk, dv


# -- merging partial results ----------------------------------------------------------------------
def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge: attention over keys A ∪ B from the results over A and over B.

    out_x [..., D] (any float dtype), lse_x [...] (float32). With m = max(lse_a, lse_b),
    w_x = exp(lse_x - m): out = (w_a out_a + w_b out_b) / (w_a + w_b), lse = m + log(w_a + w_b).
    Returns float32. Rows where both sides saw no key (lse -inf) stay out 0, lse -inf (no NaN).
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"cannot merge out {tuple(out_a.shape)}/lse {tuple(lse_a.shape)} with "
                         f"out {tuple(out_b.shape)}/lse {tuple(lse_b.shape)}")
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)  # exp(-inf) = 0
    total = wa + wb
    lse = m + torch.log(total)  # log(0) = -inf where nothing was seen
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    out = out_a.float() * (wa * inv).unsqueeze(-1) + out_b.float() * (wb * inv).unsqueeze(-1)
    return out, lse


def merge_two(out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> None:
    """out <- `merge_partials` of (out_a, lse_a) and (out_b, lse_b), in out's dtype, in one pass.

    On CUDA one Triton kernel reads both partials (any strides, last dim contiguous) and writes
    out: a chain of torch element-wise ops would read and write [Sq, Hq, D] float32 tensors about
    eight times, ~5 % of a 32k attention on 4 GPUs. Elsewhere the torch merge."""
    if out.shape != out_a.shape or out.shape != out_b.shape or out.shape[:-1] != lse_a.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"cannot merge out {tuple(out_a.shape)}/lse {tuple(lse_a.shape)} and "
                         f"out {tuple(out_b.shape)}/lse {tuple(lse_b.shape)} into {tuple(out.shape)}")
    if not out.is_cuda or out.dim() != 3 or any(t.stride(-1) != 1 for t in (out, out_a, out_b)):
        out.copy_(merge_partials(out_a, lse_a, out_b, lse_b)[0])
        return
    from commweave.workloads.attention_cp.merge_kernel import merge_two_cuda

    merge_two_cuda(out, out_a, lse_a, out_b, lse_b)


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """`merge_partials` written into the accumulators (acc_out, acc_lse), which may be views (e.g.
    one zigzag half of a rank's rows). Start them at 0 and -inf. acc_lse is float32; acc_out float32,
    or the bf16/fp16 output itself (the merge's arithmetic stays float32; each merge rounds the
    running result once). On CUDA one Triton kernel reads and writes the accumulators once (the
    torch merge is ~8 passes)."""
    if out.shape != acc_out.shape or lse.shape != acc_lse.shape or out.shape[:-1] != lse.shape:
        raise ValueError(f"cannot merge out {tuple(out.shape)}/lse {tuple(lse.shape)} into "
                         f"accumulators {tuple(acc_out.shape)}/{tuple(acc_lse.shape)}")
    if (acc_out.is_cuda and acc_out.dim() == 3 and acc_lse.dtype == torch.float32
            and all(t.stride(-1) == 1 for t in (acc_out, out))):
        from commweave.workloads.attention_cp.merge_kernel import merge_into_acc

        merge_into_acc(acc_out, acc_lse, out, lse)
        return
    merged, merged_lse = merge_partials(acc_out, acc_lse, out, lse)
    acc_out.copy_(merged)
    acc_lse.copy_(merged_lse)


def attend_segments(acc_out: torch.Tensor, acc_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_range: tuple[int, int], q_segments, causal: bool, scale: float, q_block: int = 0,
                    **attention) -> None:
    """Merge the attention of q's segments ((global q_range, row in q) pairs) over keys k, v at
    global positions k_range into the accumulators; `attention` goes to `attention_with_lse`.
    q_block > 0: at most that many queries an attention call (bounds the partial output's memory;
    a causal diagonal block is never split: its mask is aligned to the block's start)."""
    if q_block < 0:
        raise ValueError(f"q_block must be 0 (whole segments) or positive, got {q_block}")
    for q_range, q_row in q_segments:
        kind = block_kind(q_range, k_range, causal)
        if kind == "skip":
            continue
        if kind == "partial":
            raise RuntimeError(f"block {q_range} x {k_range} is neither full, diagonal nor masked")
        n = q_range[1] - q_range[0]
        step = n if kind == "causal" or q_block == 0 else q_block
        for r in range(q_row, q_row + n, step):
            m = min(step, q_row + n - r)
            o, lse = attention_with_lse(q[r:r + m], k, v, causal=kind == "causal", scale=scale, **attention)
            merge_into(acc_out[r:r + m], acc_lse[r:r + m], o, lse)


# -- the reference --------------------------------------------------------------------------------
def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      causal: bool, scale: float | None = None, q_block: int = 4096, k_block: int = 4096) -> torch.Tensor:
    """Exact float32 attention of queries at global positions q_pos over keys at k_pos (causal:
    query p sees keys at positions <= p), computed in [q_block x k_block] tiles merged by LSE.
    A tile is masked by positions, so any sharding works. One tile when the sizes fit it (then
    this is plain softmax attention); memory per tile q_block * k_block * Hq floats."""
    group = _check_qkv(q, k, v)
    sq, hq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(sq, hq, d, dtype=torch.float32, device=q.device)
    for q0 in range(0, sq, q_block):
        qs = q[q0:q0 + q_block].float().reshape(-1, hkv, group, d)
        qp = q_pos[q0:q0 + q_block]
        acc = torch.zeros(qs.shape[0], hkv, group, d, dtype=torch.float32, device=q.device)
        acc_lse = torch.full((qs.shape[0], hkv, group), NEG_INF, dtype=torch.float32, device=q.device)
        for k0 in range(0, k.shape[0], k_block):
            kp = k_pos[k0:k0 + k_block]
            if causal and int(kp.min()) > int(qp.max()):
                continue
            scores = torch.einsum("qhgd,khd->qhgk", qs, k[k0:k0 + k_block].float()) * scale
            if causal:
                masked = kp.view(1, -1) > qp.view(-1, 1)  # [q, k]
                scores.masked_fill_(masked.view(masked.shape[0], 1, 1, -1), NEG_INF)
            lse = torch.logsumexp(scores, dim=-1)
            safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            part = torch.einsum("qhgk,khd->qhgd", torch.exp(scores - safe.unsqueeze(-1)), v[k0:k0 + k_block].float())
            acc, acc_lse = merge_partials(acc, acc_lse, part, lse)
        out[q0:q0 + q_block] = acc.reshape(-1, hq, d)
    return out


def piece_plan(seq: int, world: int, rank: int, causal: bool,
               chunks: int) -> tuple[list[tuple[tuple[int, int], int]], dict[int, list[tuple[tuple[int, int], int]]]]:
    """How device-initiated programs cut the exchange: `rank`'s query chunks
    [((start, end), first row)], and for every rank r the pieces of its K/V shard
    [((start, end), first row in the shard)] (each shard segment in `chunks` pieces, row
    seg_rows * c // chunks onwards), in order. Global positions; rows within the shard."""
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, not {chunks}")
    pieces = {}
    for r in range(world):
        ranges, row = [], 0
        for a, b in shard_ranges(seq, world, r, causal):
            for c in range(chunks):
                p0, p1 = (b - a) * c // chunks, (b - a) * (c + 1) // chunks
                ranges.append(((a + p0, a + p1), row + p0))
            row += b - a
        pieces[r] = ranges
    queries, row = [], 0
    for a, b in shard_ranges(seq, world, rank, causal):
        queries.append(((a, b), row))
        row += b - a
    return queries, pieces
