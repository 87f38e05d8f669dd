"""Device-initiated seed: LSA push of every K/V shard into peers' sequence buffers, attention
over this rank's own keys while they fly, then one attention over all the others' keys.

setup: a symmetric `kv_seq` [2, S, Hkv, D] (K then V of keys gathered from peers), a symmetric
counter `flags[0]`, a device comm with `comm_ctas` LSA barriers, the kernels, a high-priority
side stream `comm`. Where a shard lands in a receiver's `kv_seq` (`dest_rows`):
- non-causal: rotated, rank s's block at slot (s - receiver) mod W, so the receiver's remote keys
  are the contiguous rows [S/W, S) and one attention call covers them (order does not matter
  without a mask);
- causal (zigzag shards, chunks r and 2W-1-r): in sequence order, and the receiver copies its own
  shard in too, so query chunk [a, b) sees keys [0, a) as one contiguous unmasked block.

One call:
1. `comm` waits for the current stream (this rank's previous attention and flag reset are done);
   `cw_kv_gather_push` on `comm`: an LSA barrier (CTA b with CTA b of every peer: afterwards no
   rank still reads the rows we overwrite), then one peer per phase, the shard's K and V rows go
   into the peer's `kv_seq` with 16-byte NVLink stores (`ncclGetLsaPointer`); after each peer
   every CTA adds 1 (release, system scope) to that peer's counter; causal: the own shard last.
2. Current stream, concurrently: the local blocks (`local_blocks`: all own keys when non-causal,
   the two diagonal blocks when causal), cuDNN attention returning the LSE.
3. A 1-thread acquire spin (or `cuStreamWaitValue64`) until the counter holds every CTA of every
   writer; the remote block per query segment (`remote_rows`), and `merge_two` (one Triton kernel)
   combines local and remote partials straight into `out`. `flags.zero_()`, join `comm`.

The reset cannot race the next call's signals: the next push opens with the LSA barrier, which no
rank enters before its previous call (reset included) is done. Constant targets make a call
capturable as a CUDA graph, replayed per input/output addresses (the first call runs eagerly so
lazy library handles are created outside a capture). Memory: the whole K and V, as all-gather;
`seed_pull` is the bounded-memory variant.
"""

import ctypes

import torch

from commweave.runtime.graphs import CallGraphs
from commweave.runtime.launch import stream_wait_geq
from commweave.workloads.attention_cp.attention import attention_with_lse, merge_two, shard_ranges

# EVOLVE-BLOCK-START
CONFIG = dict(
    comm_ctas=16,  # CTAs of the push kernel (SMs taken from attention while K/V are in flight)
    threads=512,  # threads per push CTA
    comm_priority=-1,  # stream priority of the push kernel
    wait="kernel",  # "kernel": a 1-thread acquire spin; "stream": cuStreamWaitValue64
    graph=True,  # replay the call as a CUDA graph (captured per input/output addresses)
    backend="auto",  # block attention: "cudnn", "flash" (both return the LSE), "torch" (float32), "auto"
    native_gqa=True,  # the kernel reads grouped KV heads itself (else K/V repeated per query head: ~4 % slower at 32/8)
    communicate=True,  # False: no push and no wait, remote blocks over whatever kv_seq holds (the "ideal"
    # yardstick: this rank's attention computed as here, every key present; wrong output)
)
MAX_GRAPHS = 32
MAX_WORLD = 8

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cstddef>
#include <cstdint>

#define CW_MAX_WORLD 8  // NVLink domains of up to 8 GPUs
#define CW_UNROLL 4     // 16-byte vectors each thread loads before storing

using cw_flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

// Receiver rank -> first row of each of this rank's segments in the receiver's kv_seq.
struct CwRows {
  long long row[CW_MAX_WORLD][2];
};

// Copies n 16-byte units from src to dst; this thread takes tid, tid + nthreads, ...
__host__ __device__ inline void cw_copy16(const uint4* src, uint4* dst, size_t n, size_t tid, size_t nthreads) {
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

// This rank's K and V shards ([segments * seg_rows][row_units] 16-byte units each) into a
// receiver's kv_seq ([2][total_rows][row_units]: K rows, then V rows), segment s at row s ? row1 : row0.
__host__ __device__ inline void cw_scatter_shard(const uint4* k_local, const uint4* v_local, uint4* kv_seq,
                                                 long long row0, long long row1, int segments, long long seg_rows,
                                                 long long row_units, long long total_rows, size_t tid,
                                                 size_t nthreads) {
  const size_t units = (size_t)(seg_rows * row_units);
  for (int s = 0; s < segments; s++) {
    const long long row = s == 0 ? row0 : row1;
    cw_copy16(k_local + s * units, kv_seq + row * row_units, units, tid, nthreads);
    cw_copy16(v_local + s * units, kv_seq + (total_rows + row) * row_units, units, tid, nthreads);
  }
}

// Receivers in push order: the peers one per phase (me+1, me+2, ...), then this rank itself when
// include_self (causal: the own shard must sit in sequence order too).
__host__ __device__ inline int cw_receiver(int me, int n, int phase) {
  return (me + 1 + phase) % n;
}

extern "C" __global__ void cw_kv_gather_push(const uint4* k_local, const uint4* v_local, ncclWindow_t kv_win,
                                             size_t kv_offset, ncclWindow_t flag_win, size_t flag_offset,
                                             long long seg_rows, int segments, long long row_units,
                                             long long total_rows, CwRows dest, int include_self, ncclDevComm dc) {
  {
    // Every rank has finished the previous call's attention (its side stream waited for it before
    // this kernel), so no row we overwrite is still being read.
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
  const int me = dc.lsaRank, n = dc.lsaSize;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t nthreads = (size_t)gridDim.x * blockDim.x;
  const int phases = n - 1 + (include_self ? 1 : 0);
  for (int phase = 0; phase < phases; phase++) {
    const int to = cw_receiver(me, n, phase);
    uint4* kv_seq = (uint4*)ncclGetLsaPointer(kv_win, kv_offset, to);
    long long row0 = 0, row1 = 0;  // dest.row[to] picked by an unrolled select: no local-memory copy
#pragma unroll
    for (int r = 0; r < CW_MAX_WORLD; r++) {
      if (r == to) {
        row0 = dest.row[r][0];
        row1 = dest.row[r][1];
      }
    }
    cw_scatter_shard(k_local, v_local, kv_seq, row0, row1, segments, seg_rows, row_units, total_rows, tid, nthreads);
    // bar.sync orders the CTA's stores before the release RMW (cumulativity), as NCCL's barrier
    // arrive() does.
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long* flag = (unsigned long long*)ncclGetLsaPointer(flag_win, flag_offset, to);
      cw_flag(*flag).fetch_add(1ull, cuda::memory_order_release);
    }
  }
}

// Blocks its stream until *flag >= target; kernels queued after it see the pushed rows.
extern "C" __global__ void cw_kv_wait(unsigned long long* flag, unsigned long long target) {
  cw_flag f(*flag);
  while (f.load(cuda::memory_order_acquire) < target) {
  }
}
"""


def available(ctx):
    if not ctx.is_cuda:
        return "the seed pushes K and V over NVLink with NCCL's device API and needs CUDA GPUs"
    return None


def dest_rows(shape, world, sender):
    """For each receiver rank, the first kv_seq row of each of `sender`'s segments there."""
    causal, seq = bool(shape["CAUSAL"]), shape["S"]
    ranges = shard_ranges(seq, world, sender, causal)
    if causal:
        return [[a for a, _ in ranges] for _ in range(world)]
    block = seq // world
    return [[((sender - receiver) % world) * block] for receiver in range(world)]


def blocks(shape, world, rank):
    """This rank's attention plan: per query segment its first row and rows (its local block is the
    own keys: all of them non-causal, the diagonal causal) and the kv_seq rows [k0, k1) of the
    remote block (None when no remote key is visible)."""
    causal, seq = bool(shape["CAUSAL"]), shape["S"]
    plan, row = [], 0
    for a, b in shard_ranges(seq, world, rank, causal):
        n = b - a
        remote = (0, a) if causal else (seq // world, seq)
        plan.append({"row": row, "rows": n, "remote": remote if remote[1] > remote[0] else None})
        row += n
    return plan


def setup(ctx, shape):
    world, rank, causal = ctx.world_size, ctx.rank, bool(shape["CAUSAL"])
    seq, hkv, d = shape["S"], shape["HKV"], shape["D"]
    ctas = CONFIG["comm_ctas"]
    if CONFIG["wait"] not in ("kernel", "stream"):
        raise ValueError(f"CONFIG['wait'] must be 'kernel' or 'stream', not {CONFIG['wait']!r}")
    if ctas < 1:
        raise ValueError(f"CONFIG comm_ctas ({ctas}) must be at least 1")
    if world > MAX_WORLD:
        raise ValueError(f"the push kernel addresses at most {MAX_WORLD} ranks, not {world}")
    row_bytes = hkv * d * 2
    if row_bytes % 16:
        raise ValueError(f"a K/V row of {hkv} heads x {d} bf16 is {row_bytes} bytes, not a multiple of 16")
    segments = 2 if causal else 1
    rows = (ctypes.c_longlong * (MAX_WORLD * 2))()
    for receiver, firsts in enumerate(dest_rows(shape, world, rank)):
        for s, first in enumerate(firsts):
            rows[receiver * 2 + s] = first
    kv_seq = ctx.symmetric((2, seq, hkv, d), torch.bfloat16)
    flags = ctx.symmetric((1,), torch.int64)
    dc = ctx.dev_comm(lsa_barriers=ctas)
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    if not CONFIG["communicate"]:
        kv_seq.normal_()  # keys like the inputs' (N(0, 1)), so the attention's work is the same
    module = ctx.compile(CUDA_SRC, "attention_cp_seed")
    writers = world - 1 + int(causal)
    return {
        "kv_seq": kv_seq, "flags": flags, "dc": dc, "kv_win": ctx.window(kv_seq), "flag_win": ctx.window(flags),
        "push": module.kernel("cw_kv_gather_push"), "wait": module.kernel("cw_kv_wait"),
        "stream": ctx.stream("comm", priority=CONFIG["comm_priority"]), "graphs": CallGraphs(MAX_GRAPHS),
        "dest": rows, "seg_rows": seq // world // segments, "segments": segments, "row_units": row_bytes // 16,
        "causal": causal, "target": ctas * writers, "blocks": blocks(shape, world, rank), "scale": d ** -0.5,
    }


def run(ctx, state, inputs, out):
    if CONFIG["graph"]:
        state["graphs"](lambda: _call(ctx, state, inputs, out), [*inputs.values(), out])
    else:
        _call(ctx, state, inputs, out)


def _attention(state, q, k, v, causal):
    return attention_with_lse(q, k, v, causal=causal, scale=state["scale"], backend=CONFIG["backend"],
                              native_gqa=CONFIG["native_gqa"])


def _call(ctx, state, inputs, out):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    for name, t in (("k", k), ("v", v)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"the push kernel copies {name} as one contiguous, 16-byte aligned block")
    main, comm = torch.cuda.current_stream(ctx.device), state["stream"]
    comm.wait_stream(main)  # this rank's previous attention and flag reset are done
    if CONFIG["communicate"]:
        _push(ctx, state, k, v, comm)
    local = []
    for blk in state["blocks"]:  # own keys: nothing to wait for
        r0, r1 = blk["row"], blk["row"] + blk["rows"]
        kr = slice(r0, r1) if state["causal"] else slice(None)
        local.append(_attention(state, q[r0:r1], k[kr], v[kr], state["causal"]))
    flags, kv_seq = state["flags"], state["kv_seq"]
    if CONFIG["communicate"] and CONFIG["wait"] == "stream":
        stream_wait_geq(flags.data_ptr(), state["target"], main)
    elif CONFIG["communicate"]:
        state["wait"].launch(1, 1, [flags, state["target"]], stream=main)
    for blk, (o_local, lse_local) in zip(state["blocks"], local):
        r0, r1 = blk["row"], blk["row"] + blk["rows"]
        if blk["remote"] is None:
            out[r0:r1].copy_(o_local)
            continue
        k0, k1 = blk["remote"]
        o_remote, lse_remote = _attention(state, q[r0:r1], kv_seq[0, k0:k1], kv_seq[1, k0:k1], False)
        merge_two(out[r0:r1], o_local, lse_local, o_remote, lse_remote)
    flags.zero_()  # every writer's signal was waited for above; see the module docstring
    main.wait_stream(comm)


def _push(ctx, state, k, v, comm):
    state["push"].launch(CONFIG["comm_ctas"], CONFIG["threads"], [
        k, v, state["kv_win"], state["kv_win"].offset, state["flag_win"], state["flag_win"].offset,
        state["seg_rows"], state["segments"], state["row_units"], state["kv_seq"].shape[1],
        state["dest"], int(state["causal"]), state["dc"],
    ], stream=comm)
# EVOLVE-BLOCK-END
