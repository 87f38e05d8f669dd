"""Device-initiated variant with bounded memory: peers *pull* K/V pieces over NVLink (LSA loads)
into a small ring of local slots; no rank ever holds the whole K and V.

setup: a symmetric `own_kv` [2, S/W, Hkv, D] (this rank's K and V, readable by peers), a local
ring of `slots` piece buffers [2, piece rows, Hkv, D], a dev comm with one LSA barrier, the
kernels, a high-priority side stream `comm`, and a pair of CUDA events per remote piece.

One call (replayed as a CUDA graph per input/output addresses after one eager call):
1. `comm` waits for the current stream; `cw_kv_barrier` (B0): every rank has finished the
   previous call's pulls, so `own_kv` may be overwritten; `own_kv` <- (k, v) on `comm`;
   `cw_kv_barrier` (B1): every rank's `own_kv` holds this call's K and V.
2. Meanwhile the current stream computes the local blocks from the inputs (no wait).
3. For remote piece i (sources rank-1, rank-2, ..., each shard's pieces in order): on `comm`,
   wait for the current stream's event `done[i - slots]` (the slot is free again), then
   `cw_kv_pull` copies the piece's K and V rows from the source's `own_kv` into slot i % slots
   with 16-byte NVLink loads, and records `ready[i]`; the current stream waits for `ready[i]`,
   runs the piece's attention (flash with LSE, merged into the output: CONFIG `accumulate`),
   records `done[i]`. All ordering is by stream events: no flags, no counters to reset.
4. The current stream joins `comm` (with `accumulate="float32"`: `out` <- the accumulator).

Peak extra memory: one shard of K/V plus `slots` pieces (the push seed and all-gather hold all W
shards), one attention call's partial output (`q_block` bounds it) and the float32 LSEs; with
`accumulate="float32"` also a float32 accumulator of the output's size (4x this rank's K/V at GQA
32/8). The price: B0 and B1 per call, and a local copy of the shard into `own_kv`.
"""

import torch

from commweave.runtime.graphs import CallGraphs
from commweave.workloads.attention_cp.attention import attend_segments, piece_plan

# EVOLVE-BLOCK-START
CONFIG = dict(
    comm_ctas=16,  # CTAs of each pull kernel
    threads=512,  # threads per pull CTA
    chunks=1,  # pieces per segment (contiguous shard, or zigzag chunk); 1 measured fastest on 2 GPUs
    #            (32k: 1 / 2 / 4 = 14.6 / 15.4 / 16.1 ms full, 7.3 / 8.0 / 8.4 ms causal) at 260 MiB
    #            beside all-gather's 448 (sweep-attention-cp-2gpu-20261201T095857Z.json)
    slots=2,  # local piece buffers: pulls run up to slots - 1 pieces ahead of the attention
    comm_priority=-1,  # stream priority of the pulls
    graph=True,  # replay the call as a CUDA graph (captured per input/output addresses)
    backend="auto",  # block attention: "cudnn", "flash" (both return the LSE), "torch" (float32 math), "auto"
    native_gqa=True,  # the kernel reads grouped KV heads itself (measured faster than repeating K/V per query head)
    accumulate="out",  # "out": merge every piece straight into the bf16 output (LSEs in float32; each
    #                    merge rounds once): no float32 accumulator, which at GQA 32/8 is 4x the size of
    #                    this rank's K/V; "float32": a float32 accumulator, copied to out at the end
    q_block=0,  # queries per attention call (0: whole segments); smaller bounds the partial output
)
MAX_GRAPHS = 32

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cstddef>
#include <cstdint>

#define CW_UNROLL 4  // 16-byte vectors each thread loads before storing

// Copies n 16-byte units from src (a peer's memory) to dst; this thread takes tid, tid + nthreads, ...
__host__ __device__ inline void cw_pull16(const uint4* src, uint4* dst, size_t n, size_t tid, size_t nthreads) {
  size_t i = tid;
  for (; i + (CW_UNROLL - 1) * nthreads < n; i += CW_UNROLL * nthreads) {
    uint4 v[CW_UNROLL];
#pragma unroll
    for (int u = 0; u < CW_UNROLL; u++) v[u] = src[i + u * nthreads];
#pragma unroll
    for (int u = 0; u < CW_UNROLL; u++) dst[i + u * nthreads] = v[u];
  }
  for (; i < n; i += nthreads) dst[i] = src[i];
}

// All ranks' GPUs meet here (one CTA each); memory before it is visible to peers after it.
extern "C" __global__ void cw_kv_barrier(ncclDevComm dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

// Rows [r0, r1) of K and V from `src`'s own_kv ([2][rows][row_units] at kv_offset of its window)
// into dst_k and dst_v (row_units units per row, contiguous).
extern "C" __global__ void cw_kv_pull(uint4* dst_k, uint4* dst_v, ncclWindow_t kv_win, size_t kv_offset, int src,
                                      long long rows, long long row_units, long long r0, long long r1) {
  const uint4* base = (const uint4*)ncclGetLsaPointer(kv_win, kv_offset, src);
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t nthreads = (size_t)gridDim.x * blockDim.x;
  const size_t n = (size_t)((r1 - r0) * row_units);
  cw_pull16(base + r0 * row_units, dst_k, n, tid, nthreads);
  cw_pull16(base + (rows + r0) * row_units, dst_v, n, tid, nthreads);
}
"""


def available(ctx):
    if not ctx.is_cuda:
        return "the pull seed loads K and V over NVLink with NCCL's device API and needs CUDA GPUs"
    return None


def setup(ctx, shape):
    world, rank, causal = ctx.world_size, ctx.rank, bool(shape["CAUSAL"])
    local, hq, hkv, d = shape["S"] // world, shape["HQ"], shape["HKV"], shape["D"]
    chunks, slots = CONFIG["chunks"], CONFIG["slots"]
    if slots < 1 or CONFIG["comm_ctas"] < 1:
        raise ValueError(f"CONFIG slots ({slots}) and comm_ctas ({CONFIG['comm_ctas']}) must be at least 1")
    if CONFIG["accumulate"] not in ("out", "float32"):
        raise ValueError(f"CONFIG['accumulate'] must be 'out' or 'float32', not {CONFIG['accumulate']!r}")
    if CONFIG["q_block"] < 0:
        raise ValueError(f"CONFIG['q_block'] must be 0 (whole segments) or positive, not {CONFIG['q_block']}")
    row_bytes = hkv * d * 2
    if row_bytes % 16:
        raise ValueError(f"a K/V row of {hkv} heads x {d} bf16 is {row_bytes} bytes, not a multiple of 16")
    q_segments, piece_ranges = piece_plan(shape["S"], world, rank, causal, chunks)
    # remote pieces in pull order (sources rank-1, rank-2, ...), empty ones (rows < chunks) left out
    order = [((rank - j) % world, p) for j in range(1, world) for p, ((a, b), _) in enumerate(piece_ranges[(rank - j) % world]) if b > a]
    piece_rows = max(b - a for r in range(world) for (a, b), _ in piece_ranges[r])
    own_kv = ctx.symmetric((2, local, hkv, d), torch.bfloat16)
    dc = ctx.dev_comm(lsa_barriers=1)
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    module = ctx.compile(CUDA_SRC, "attention_cp_seed_pull")
    return {
        "own_kv": own_kv, "kv_win": ctx.window(own_kv), "dc": dc,
        "barrier": module.kernel("cw_kv_barrier"), "pull": module.kernel("cw_kv_pull"),
        "slots": [torch.empty(2, piece_rows, hkv, d, dtype=torch.bfloat16, device=ctx.device) for _ in range(min(slots, max(1, len(order))))],
        "ready": [torch.cuda.Event() for _ in order], "done": [torch.cuda.Event() for _ in order],
        "stream": ctx.stream("comm", priority=CONFIG["comm_priority"]), "graphs": CallGraphs(MAX_GRAPHS),
        "acc": torch.empty(local, hq, d, dtype=torch.float32, device=ctx.device) if CONFIG["accumulate"] == "float32" else None,
        "lse": torch.empty(local, hq, dtype=torch.float32, device=ctx.device),
        "rows": local, "row_units": row_bytes // 16, "order": order,
        "piece_ranges": piece_ranges, "q_segments": q_segments, "causal": causal, "scale": d ** -0.5,
    }


def run(ctx, state, inputs, out):
    if CONFIG["graph"]:
        state["graphs"](lambda: _call(ctx, state, inputs, out), [*inputs.values(), out])
    else:
        _call(ctx, state, inputs, out)


def _attend(state, acc, q, k, v, k_range, q_segments):
    """Merge q's attention over keys k, v at global positions k_range into acc (and the LSEs)."""
    attend_segments(acc, state["lse"], q, k, v, k_range, q_segments, state["causal"], state["scale"],
                    q_block=CONFIG["q_block"], backend=CONFIG["backend"], native_gqa=CONFIG["native_gqa"])


def _call(ctx, state, inputs, out):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    main, comm = torch.cuda.current_stream(ctx.device), state["stream"]
    own, slots = state["own_kv"], state["slots"]
    comm.wait_stream(main)  # this rank's previous call is done (its attention read every slot)
    state["barrier"].launch(1, 128, [state["dc"]], stream=comm)  # B0: nobody still pulls from own_kv
    with torch.cuda.stream(comm):
        own[0].copy_(k)
        own[1].copy_(v)
    state["barrier"].launch(1, 128, [state["dc"]], stream=comm)  # B1: every own_kv holds this call's K, V

    acc = out if state["acc"] is None else state["acc"]
    acc.zero_()  # (out arrives poisoned: a merge weighs it by 0, and 0 * NaN is NaN)
    state["lse"].fill_(float("-inf"))
    q_segments = state["q_segments"]
    for (a, b), row in q_segments:  # the local blocks: own K and V from the inputs, nothing to wait for
        _attend(state, acc, q, k[row:row + b - a], v[row:row + b - a], (a, b), q_segments)
    for i, (src, p) in enumerate(state["order"]):
        (a, b), row = state["piece_ranges"][src][p]
        n = b - a
        slot = slots[i % len(slots)]
        if i >= len(slots):
            comm.wait_event(state["done"][i - len(slots)])  # the slot's previous piece was consumed
        state["pull"].launch(CONFIG["comm_ctas"], CONFIG["threads"], [
            slot[0], slot[1], state["kv_win"], state["kv_win"].offset, src, state["rows"], state["row_units"], row, row + n,
        ], stream=comm)
        state["ready"][i].record(comm)
        main.wait_event(state["ready"][i])
        _attend(state, acc, q, slot[0, :n], slot[1, :n], (a, b), q_segments)
        state["done"][i].record(main)
    main.wait_stream(comm)
    if state["acc"] is not None:
        out.copy_(state["acc"])
# EVOLVE-BLOCK-END
