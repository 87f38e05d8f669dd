"""Device-initiated seed: LSA push of K/V pieces into peers' symmetric windows with per-piece
flags; the attention on the current stream chases the flags and merges blocks by LSE.

setup: a symmetric `kv_full` [W, 2, S/W, Hkv, D] (slot r: rank r's K then V), symmetric `flags`
[W * pieces] (int64), a device comm with `comm_ctas` LSA barriers, the kernels, a high-priority
side stream `comm`. A rank's shard is cut into pieces: each of its segments (1 contiguous block,
or the 2 zigzag chunks when causal) into `chunks` pieces along the sequence.

One call:
1. `comm` waits for the current stream (this rank's previous attention and flag reset are done).
2. `cw_kv_push` on `comm`: an LSA barrier (CTA b with CTA b of every peer: afterwards no rank
   still reads the slot we overwrite), then piece by piece this rank's K and V rows go into slot
   `rank` of the peers' `kv_full` with 16-byte NVLink stores (`ncclGetLsaPointer`), and after each
   piece every CTA adds 1 (release, system scope) to the receiver's `flags[rank*pieces + p]`.
   Order "staggered": in phase j the whole shard goes to rank + j only; "broadcast": each piece
   to all peers at once.
3. On the current stream: the local block (own K, V: no wait; the causal diagonal blocks), then
   for every remote piece in arrival order a 1-thread kernel (or `cuStreamWaitValue64`) waits until
   its counter reaches `comm_ctas`, and the piece's attention (flash kernel returning the LSE) is
   merged into float32 accumulators. Zigzag pieces of a remote rank are always wholly visible or
   wholly masked for a query chunk; masked ones are still waited for (the reset needs every
   signal in). Then `out` <- accumulator, `flags.zero_()`, join with `comm`.

The reset cannot race the next call's signals: the next push opens with the LSA barrier, which no
rank enters before its previous call (reset included) is done. Constant targets make a call
capturable as a CUDA graph, replayed per input/output addresses (the first call runs eagerly so
lazy library handles are created outside a capture).
"""

import torch

from commweave.runtime.graphs import CallGraphs
from commweave.runtime.launch import stream_wait_geq
from commweave.workloads.attention_cp.attention import attend_segments, shard_ranges

# EVOLVE-BLOCK-START
CONFIG = dict(
    comm_ctas=8,  # CTAs of the push kernel (SMs taken from attention while K/V are in flight)
    threads=512,  # threads per push CTA
    chunks=2,  # pieces per segment (contiguous shard, or zigzag chunk): finer waits, smaller blocks
    order="staggered",  # "staggered": one peer per phase; "broadcast": each piece to all peers at once
    comm_priority=-1,  # stream priority of the push kernel
    wait="kernel",  # "kernel": a 1-thread acquire spin per piece; "stream": cuStreamWaitValue64
    graph=True,  # replay the call as a CUDA graph (captured per input/output addresses)
    backend="auto",  # block attention: "flash" (returns LSE), "torch" (float32 math), "auto"
    native_gqa=False,  # flash reads grouped KV heads itself (else K/V repeated per query head); untried
)
MAX_GRAPHS = 32

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cstddef>
#include <cstdint>

#define CW_MAX_PEERS 7  // NVLink domains of up to 8 GPUs
#define CW_UNROLL 4     // 16-byte vectors each thread loads before storing

using cw_flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

struct CwDst {
  uint4* dst[CW_MAX_PEERS];
  int count;
};

// Rows [begin(c), begin(c + 1)) of a segment of seg_rows rows cut into `chunks` pieces (the host
// uses the same formula; a piece may be empty).
__host__ __device__ inline long long cw_piece_begin(long long seg_rows, int chunks, int c) {
  return seg_rows * c / chunks;
}

// Copies n 16-byte units from src to every destination; this thread takes tid, tid + nthreads, ...
__host__ __device__ inline void cw_copy16(const uint4* src, const CwDst& to, size_t n, size_t tid, size_t nthreads) {
  size_t i = tid;
  for (; i + (CW_UNROLL - 1) * nthreads < n; i += CW_UNROLL * nthreads) {
    uint4 v[CW_UNROLL];
#pragma unroll
    for (int u = 0; u < CW_UNROLL; u++) v[u] = src[i + u * nthreads];
#pragma unroll
    for (int p = 0; p < CW_MAX_PEERS; p++) {
      if (p < to.count) {
#pragma unroll
        for (int u = 0; u < CW_UNROLL; u++) to.dst[p][i + u * nthreads] = v[u];
      }
    }
  }
  for (; i < n; i += nthreads) {
    uint4 v = src[i];
#pragma unroll
    for (int p = 0; p < CW_MAX_PEERS; p++) {
      if (p < to.count) to.dst[p][i] = v;
    }
  }
}

__host__ __device__ inline int cw_peer(int me, int n, int staggered, int phase, int p) {
  return (me + 1 + (staggered ? phase : p)) % n;
}

// Adds 1 to flags[index] in `peer`'s window after the CTA's stores of that piece: bar.sync orders
// them before the release RMW (cumulativity), as NCCL's barrier arrive() does.
__device__ inline void cw_signal(ncclWindow_t flag_win, size_t flag_offset, int peer, size_t index) {
  unsigned long long* flags = (unsigned long long*)ncclGetLsaPointer(flag_win, flag_offset, peer);
  cw_flag(flags[index]).fetch_add(1ull, cuda::memory_order_release);
}

// Pushes this rank's K and V (rows x row_units 16-byte units each, contiguous) into slot `rank` of
// every peer's kv_full ([W][2][rows][row_units]), piece by piece: `segments` segments of
// rows/segments rows, each in `chunks` pieces. After a piece, each CTA adds 1 to
// flags[rank * segments * chunks + s * chunks + c] in the receiver's window (empty pieces too, so
// every counter advances by exactly gridDim.x per call).
extern "C" __global__ void cw_kv_push(const uint4* k_local, const uint4* v_local, ncclWindow_t kv_win,
                                      size_t kv_offset, ncclWindow_t flag_win, size_t flag_offset,
                                      long long rows, long long row_units, int segments, int chunks,
                                      int staggered, ncclDevComm dc) {
  {
    // Every rank has finished the previous call's attention (its side stream waited for it before
    // this kernel), so no slot we overwrite is still being read.
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
  const int me = dc.lsaRank, n = dc.lsaSize;
  const size_t slot_offset = kv_offset + (size_t)me * 2 * rows * row_units * sizeof(uint4);
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t nthreads = (size_t)gridDim.x * blockDim.x;
  const long long seg_rows = rows / segments;
  const int pieces = segments * chunks;
  const int phases = staggered ? n - 1 : 1;
  for (int phase = 0; phase < phases; phase++) {
    CwDst base;
    base.count = staggered ? 1 : n - 1;
#pragma unroll
    for (int p = 0; p < CW_MAX_PEERS; p++) {
      base.dst[p] = p < base.count ? (uint4*)ncclGetLsaPointer(kv_win, slot_offset, cw_peer(me, n, staggered, phase, p)) : nullptr;
    }
    for (int s = 0; s < segments; s++) {
      for (int c = 0; c < chunks; c++) {
        long long r0 = s * seg_rows + cw_piece_begin(seg_rows, chunks, c);
        long long r1 = s * seg_rows + cw_piece_begin(seg_rows, chunks, c + 1);
        size_t units = (size_t)((r1 - r0) * row_units);
        CwDst kd = base, vd = base;
#pragma unroll
        for (int p = 0; p < CW_MAX_PEERS; p++) {
          if (p < base.count) {
            kd.dst[p] = base.dst[p] + r0 * row_units;
            vd.dst[p] = base.dst[p] + (rows + r0) * row_units;
          }
        }
        cw_copy16(k_local + r0 * row_units, kd, units, tid, nthreads);
        cw_copy16(v_local + r0 * row_units, vd, units, tid, nthreads);
        __syncthreads();
        if (threadIdx.x < base.count) {
          cw_signal(flag_win, flag_offset, cw_peer(me, n, staggered, phase, (int)threadIdx.x),
                    (size_t)me * pieces + (size_t)s * chunks + c);
        }
      }
    }
  }
}

// Blocks its stream until flags[index] >= target; kernels queued after it see the piece's data.
extern "C" __global__ void cw_kv_wait(unsigned long long* flags, long long index, unsigned long long target) {
  cw_flag flag(flags[index]);
  while (flag.load(cuda::memory_order_acquire) < target) {
  }
}
"""


def available(ctx):
    if not ctx.is_cuda:
        return "the seed pushes K and V over NVLink with NCCL's device API and needs CUDA GPUs"
    return None


def piece_begin(seg_rows, chunks, c):
    """First row of piece c of a segment (the formula of cw_piece_begin in the kernel)."""
    return seg_rows * c // chunks


def plan(shape, world, rank, chunks):
    """This rank's query chunks [((start, end), first row)], and for every rank r the pieces of its
    shard [((start, end), first row)] in flag order (global positions, rows within the shard)."""
    causal = bool(shape["CAUSAL"])
    piece_ranges = {}
    for r in range(world):
        ranges, row = [], 0
        for a, b in shard_ranges(shape["S"], world, r, causal):
            for c in range(chunks):
                p0, p1 = piece_begin(b - a, chunks, c), piece_begin(b - a, chunks, c + 1)
                ranges.append(((a + p0, a + p1), row + p0))
            row += b - a
        piece_ranges[r] = ranges
    q_segments, row = [], 0
    for a, b in shard_ranges(shape["S"], world, rank, causal):
        q_segments.append(((a, b), row))
        row += b - a
    return q_segments, piece_ranges


def setup(ctx, shape):
    world, rank, causal = ctx.world_size, ctx.rank, bool(shape["CAUSAL"])
    local, hq, hkv, d = shape["S"] // world, shape["HQ"], shape["HKV"], shape["D"]
    chunks, ctas = CONFIG["chunks"], CONFIG["comm_ctas"]
    if CONFIG["wait"] not in ("kernel", "stream"):
        raise ValueError(f"CONFIG['wait'] must be 'kernel' or 'stream', not {CONFIG['wait']!r}")
    if CONFIG["order"] not in ("staggered", "broadcast"):
        raise ValueError(f"CONFIG['order'] must be 'staggered' or 'broadcast', not {CONFIG['order']!r}")
    if chunks < 1 or ctas < 1:
        raise ValueError(f"CONFIG chunks ({chunks}) and comm_ctas ({ctas}) must be at least 1")
    if world - 1 > 7:
        raise ValueError(f"the push kernel addresses at most 7 peers, not {world - 1}")
    row_bytes = hkv * d * 2
    if row_bytes % 16:
        raise ValueError(f"a K/V row of {hkv} heads x {d} bf16 is {row_bytes} bytes, not a multiple of 16")
    segments = 2 if causal else 1
    pieces = segments * chunks
    q_segments, piece_ranges = plan(shape, world, rank, chunks)
    kv_full = ctx.symmetric((world, 2, local, hkv, d), torch.bfloat16)
    flags = ctx.symmetric((world * pieces,), torch.int64)
    dc = ctx.dev_comm(lsa_barriers=ctas)
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    module = ctx.compile(CUDA_SRC, "attention_cp_seed")
    return {
        "kv_full": kv_full, "flags": flags, "dc": dc, "kv_win": ctx.window(kv_full), "flag_win": ctx.window(flags),
        "push": module.kernel("cw_kv_push"), "wait": module.kernel("cw_kv_wait"),
        "stream": ctx.stream("comm", priority=CONFIG["comm_priority"]), "graphs": CallGraphs(MAX_GRAPHS),
        "acc": torch.empty(local, hq, d, dtype=torch.float32, device=ctx.device),
        "lse": torch.empty(local, hq, dtype=torch.float32, device=ctx.device),
        "rows": local, "row_units": row_bytes // 16, "segments": segments, "pieces": pieces, "ctas": ctas,
        "piece_ranges": piece_ranges, "q_segments": q_segments, "causal": causal, "scale": d ** -0.5,
    }


def run(ctx, state, inputs, out):
    if CONFIG["graph"]:
        state["graphs"](lambda: _call(ctx, state, inputs, out), [*inputs.values(), out])
    else:
        _call(ctx, state, inputs, out)


def _attend(state, q, k, v, k_range, q_segments):
    """Merge q's attention over keys k, v at global positions k_range into the accumulators."""
    attend_segments(state["acc"], state["lse"], q, k, v, k_range, q_segments, state["causal"], state["scale"],
                    backend=CONFIG["backend"], native_gqa=CONFIG["native_gqa"])


def _call(ctx, state, inputs, out):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    for name, t in (("k", k), ("v", v)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"the push kernel copies {name} as one contiguous, 16-byte aligned block")
    world, rank = ctx.world_size, ctx.rank
    main, comm = torch.cuda.current_stream(ctx.device), state["stream"]
    comm.wait_stream(main)  # this rank's previous attention and flag reset are done
    state["push"].launch(state["ctas"], CONFIG["threads"], [
        k, v, state["kv_win"], state["kv_win"].offset, state["flag_win"], state["flag_win"].offset,
        state["rows"], state["row_units"], state["segments"], CONFIG["chunks"],
        int(CONFIG["order"] == "staggered"), state["dc"],
    ], stream=comm)

    state["acc"].zero_()
    state["lse"].fill_(float("-inf"))
    q_segments = state["q_segments"]
    for (a, b), row in q_segments:  # the local block: own K and V, nothing to wait for
        _attend(state, q, k[row:row + b - a], v[row:row + b - a], (a, b), q_segments)
    pieces = state["pieces"]
    if CONFIG["order"] == "staggered":
        order = [(j, p) for j in range(1, world) for p in range(pieces)]
    else:
        order = [(j, p) for p in range(pieces) for j in range(1, world)]
    kv_full, flags, target = state["kv_full"], state["flags"], state["ctas"]
    for j, p in order:
        src = (rank - j) % world
        index = src * pieces + p
        if CONFIG["wait"] == "stream":
            stream_wait_geq(flags[index].data_ptr(), target, main)
        else:
            state["wait"].launch(1, 1, [flags, index, target], stream=main)
        (a, b), row = state["piece_ranges"][src][p]
        if a == b:
            continue
        _attend(state, q, kv_full[src, 0, row:row + b - a], kv_full[src, 1, row:row + b - a], (a, b), q_segments)
    out.copy_(state["acc"])
    flags.zero_()  # every piece was waited for above; see the module docstring
    main.wait_stream(comm)
# EVOLVE-BLOCK-END
