"""Host baseline: ring attention. K and V blocks rotate one hop per step with NCCL P2P
(`batch_isend_irecv` on a side stream), overlapped with the attention of the block already here
(a flash kernel that returns the log-sum-exp), merged into float32 accumulators by LSE.

Step s computes this rank's queries against the K/V shard of rank - s while that shard moves on
to rank + 1 and the shard of rank - s - 1 arrives. Causal (zigzag shards): each pair of
(query chunk, key chunk) is full, the square diagonal, or skipped (`block_kind`). On CPU workers
(gloo) the same code runs with a float32 torch block attention, for the CPU tests.
"""

import torch
import torch.distributed as dist

from commweave.workloads.attention_cp.attention import attention_with_lse, block_kind, merge_into, shard_ranges

# EVOLVE-BLOCK-START
CONFIG = dict(
    backend="auto",  # block attention: "cudnn", "flash" (CUDA bf16, both return the LSE), "torch" (float32 math), "auto"
    native_gqa=True,  # the kernel reads grouped KV heads itself (measured faster than repeating K/V per query head)
)


def setup(ctx, shape):
    world, causal = ctx.world_size, bool(shape["CAUSAL"])
    local, hq, hkv, d = shape["S"] // world, shape["HQ"], shape["HKV"], shape["D"]
    segments = {}
    for r in range(world):  # (global range, local row offset) of every rank's chunks
        row, segs = 0, []
        for a, b in shard_ranges(shape["S"], world, r, causal):
            segs.append(((a, b), row))
            row += b - a
        segments[r] = segs
    return {
        "kv": [torch.empty(2, local, hkv, d, dtype=torch.bfloat16, device=ctx.device) for _ in range(2)],
        "acc": torch.empty(local, hq, d, dtype=torch.float32, device=ctx.device),
        "lse": torch.empty(local, hq, dtype=torch.float32, device=ctx.device),
        "segments": segments, "causal": causal, "scale": d ** -0.5,
        "stream": ctx.stream("ring") if ctx.is_cuda else None,
    }


def _attend(ctx, state, q, kv, src):
    for (q_range, q_row) in state["segments"][ctx.rank]:
        qn = q_range[1] - q_range[0]
        for (k_range, k_row) in state["segments"][src]:
            kind = block_kind(q_range, k_range, state["causal"])
            if kind == "skip":
                continue
            if kind == "partial":
                raise RuntimeError(f"block {q_range} x {k_range} is neither full, diagonal nor masked")
            kn = k_range[1] - k_range[0]
            o, lse = attention_with_lse(q[q_row:q_row + qn], kv[0, k_row:k_row + kn], kv[1, k_row:k_row + kn],
                                        causal=kind == "causal", scale=state["scale"], backend=CONFIG["backend"],
                                        native_gqa=CONFIG["native_gqa"])
            merge_into(state["acc"][q_row:q_row + qn], state["lse"][q_row:q_row + qn], o, lse)


def run(ctx, state, inputs, out):
    world, rank = ctx.world_size, ctx.rank
    cur = state["kv"][0]
    cur[0].copy_(inputs["k"])
    cur[1].copy_(inputs["v"])
    state["acc"].zero_()
    state["lse"].fill_(float("-inf"))
    comm = state["stream"]
    for step in range(world):
        src = (rank - step) % world
        reqs = []
        if step < world - 1:
            nxt = state["kv"][(step + 1) % 2]
            ops = [dist.P2POp(dist.isend, cur, group=ctx.group, group_peer=(rank + 1) % world),
                   dist.P2POp(dist.irecv, nxt, group=ctx.group, group_peer=(rank - 1) % world)]
            if comm is not None:
                # cur is filled and nxt no longer read (last step's attention) on the current stream.
                comm.wait_stream(torch.cuda.current_stream(ctx.device))
                with torch.cuda.stream(comm):
                    reqs = dist.batch_isend_irecv(ops)
            else:
                reqs = dist.batch_isend_irecv(ops)
        _attend(ctx, state, inputs["q"], cur, src)
        for req in reqs:
            req.wait()  # on CUDA: the current stream waits for the transfer
        if step < world - 1:
            cur = nxt
    out.copy_(state["acc"])
# EVOLVE-BLOCK-END
