"""Device-initiated seed: LSA dispatch straight into an expert-major receive pool, one pair
of grouped GEMMs over the pool as it lies, one LSA combine kernel back to the tokens' owners.

Symmetric buffers on every rank (W ranks, T tokens, top-k K, P = E/W local experts, R = T*K):
  pool [W*R, H] bf16   received rows, expert-major: local expert 0's rows from source 0, then
                       from source 1, ..., then expert 1's; rows past the total are unused
  pair [W*R] int32     for each row, the pair id t*K + k at its source
  src  [W*R] int32     for each row, its source rank
  wt   [W*R] float32   for each row, the routing weight
  sent [E] int64       this rank's pairs per global expert (read by every rank's dispatch)
  back [T*K, H] bf16   this rank's pairs' weighted expert outputs, written by the experts' ranks
  flags [2W] int64     [s]: source s's dispatch landed here; [W + d]: rank d's combine landed here
and a local cnt [W, P] int64 (rows per (source, local expert) received), written by the own
dispatch kernel. The pool holds W*R rows because no source can send more than its R pairs, so no
routing (not even one with repeated experts) overflows it and nothing is ever dropped.

One call (captured once per input/output addresses as a CUDA graph and replayed):
 1. current stream: the sender-side slot layout with torch ops (`routing.slot_layout`: pairs
    sorted stably by expert, hence grouped by destination then local expert; a pair's slot is its
    position minus its destination's first position) and `sent` = this rank's per-expert counts.
    No host synchronization.
 2. side stream `comm` (high priority): `moe_dispatch`, `comm_ctas` CTAs. An LSA barrier (every
    rank's `sent` is written, and no rank still reads its pool, `back` or flags from the previous
    call), then every CTA pulls all W ranks' `sent` over NVLink into shared memory (CTA 0 also
    stores the counts for this rank's experts into the local `cnt`). Phase j = 0..W-1 serves
    destination d = me + j (own rank first): per local expert e of d the CTA computes the base
    `moe_expert_base` (e's start in d's pool + rows of lower sources for e - this rank's own slot
    of its first pair for e; `routing.expert_major_bases` is the same formula in torch); a pair's
    row in d's pool is its slot + base[e]. Each warp copies whole token rows (16-byte vectors)
    there, lane 0 writes pair id, source and weight. After `__syncthreads` one thread adds 1 to
    d's flags[me] (release, system scope). Pulling the counts needs no second barrier: pushing
    them into each destination's `cnt` would, and since LSA barrier sessions are per CTA index
    (CTA b meets only CTA b of the other ranks), every CTA would have to push them.
 3. current stream: wait until flags[0..W) all == comm_ctas, then the SwiGLU over pool[0:W*R]
    with group ends cumsum_e(sum_s cnt[s, e]) (`routing.expert_group_ends`, on device; rows past
    the last end are ignored). CONFIG `experts`: "grouped" runs two `torch._grouped_mm` (with
    `swiglu="fused"` a SiLU*up kernel between them that reads the row total from cnt); "streamed"
    runs the weight-streaming Triton pair of `workloads/moe/experts.py` (SiLU*up fused into the
    first), faster at decode sizes; "auto" picks streamed when the balanced rows per local expert,
    T*K*W/E, are at most `experts.STREAMED_MAX_ROWS`. Each expert's weights are read once.
 4. current stream: `moe_combine` (`combine_ctas` CTAs) walks the valid rows: scales row i by its
    weight (fp32, rounded to bf16) and stores it at row pair[i] of rank src[i]'s `back`; then
    every CTA adds 1 to every rank's flags[W + me].
 5. current stream: wait until flags[W..2W) all == combine_ctas, out = sum over k of `back` (fp32,
    then bf16), zero the flags, join `comm`.

FP8 dispatch (CONFIG `compression` "fp8_e4m3" / "fp8_e5m2", lossy: only where the workload declares
a tolerance, e.g. moe-lossy): before the dispatch, TACO's compress kernel turns every token row into
its own packed message (FP8 values, then one FP32 absmax scale per `group_size` of them; no
Hadamard transform, one scale: DeepSeek-V3's 1 x 128 activation quantization), once per token, not
per pair; the dispatch copies those messages (7392 bytes a DeepSeek-V3 row instead of 14336) into a
symmetric byte pool; after the wait, `moe_dequant` turns the valid rows back into the bf16 pool
the GEMMs read (the same bits as `taco.quant.decompress`). Rows, slots, flags and the combine are
unchanged.

Flags protocol, and why the reset cannot race: in one call rank r's flags[s] receives exactly
comm_ctas increments (one per CTA of s's dispatch) and flags[W + d] exactly combine_ctas (one per
CTA of d's combine), each a release after the CTA's stores; r waits (acquire) for every flag to
reach its target before zeroing them, so no increment of this call is still to come. Increments of
the next call are issued only after the issuing kernel passed the next call's opening barrier
(combines run after their rank's dispatch), and r enters that barrier only after its `comm`
stream waited for the current stream, i.e. after the reset. The same barrier orders the reuse of
`sent`, pool, pair, src, wt and `back`: peers read r's `sent` in their dispatch, which finished
before their combine signalled r, which r waited for before overwriting `sent` in the next call.
Constant targets make the whole call capturable as a CUDA graph.

An expert id out of range or on the wrong rank, or a row outside its (source, expert) range,
stops the kernel with `__trap()` (a sticky error the harness reports), as does a pair id or source
rank out of range in the combine: never a silent skip.
"""

import torch
import torch.nn.functional as F

from commweave.runtime.graphs import CallGraphs
from commweave.runtime.launch import stream_wait_geq
from commweave.taco import cuda as taco_cuda
from commweave.taco.quant import QuantConfig
from commweave.workloads.moe import routing

# EVOLVE-BLOCK-START
CONFIG = dict(
    comm_ctas=16,  # CTAs of the dispatch kernel (one warp per token row at a time)
    threads=512,  # threads per dispatch CTA
    combine_ctas=64,  # CTAs of the combine kernel (nothing overlaps it: give it bandwidth)
    combine_threads=512,  # threads per combine CTA
    comm_priority=-1,  # stream priority of the dispatch (negative: ahead of other work's CTAs)
    experts="auto",  # "grouped": torch._grouped_mm pair; "streamed": weight-streaming Triton pair;
    # "auto": streamed up to experts.STREAMED_MAX_ROWS balanced rows per local expert (decode);
    # "none": no expert computation, the dispatched rows are combined as they are (a wrong result:
    # the workload's `exchange` yardstick, the dispatch and combine alone)
    swiglu="fused",  # with "grouped": "fused": one kernel, SiLU(gate)*up in fp32 over the valid rows
    # only; "torch": F.silu(gate) * up over the whole pool (rows past the total included)
    wait="kernel",  # "kernel": a 1-thread acquire spin; "stream": cuStreamWaitValue64, no SM
    graph=True,  # replay the call as a CUDA graph (captured per input/output addresses)
    compression="none",  # "fp8_e4m3" / "fp8_e5m2": tokens dispatched as FP8 with one absmax scale per
    # `group_size` values (lossy: for workloads that declare a tolerance, e.g. moe-lossy)
    group_size=128,  # values sharing one FP32 scale (with compression; 32..512, a power of two)
)
MAX_GRAPHS = 32  # captured calls kept per setup (the benchmark rotates up to 16 input sets)
SWIGLU_CTAS_PER_SM = 4
MAX_SHARED_BYTES = 48 << 10  # dynamic shared memory without an opt-in attribute

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstddef>
#include <cstdint>

using moe_flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

// Where a pair of source `src` for local expert e goes in the destination's expert-major pool,
// relative to the pair's slot in src's sorted routing (slots of e start at sum_{f<e} counts[src][f]).
// counts[s * stride + f]: rows source s sends to the destination's local expert f. Expert e's rows
// start after all rows of experts f < e, and within e source s's rows come after those of sources
// s' < s; subtracting src's own rows of experts f < e turns src's slot into that row.
__host__ __device__ inline long long moe_expert_base(const long long* counts, long long stride, int world, int src, int e) {
  long long base = 0;
  for (int s = 0; s < src; s++) base += counts[s * stride + e];
  for (int f = 0; f < e; f++) {
    for (int s = 0; s < world; s++) base += counts[s * stride + f];
    base -= counts[src * stride + f];
  }
  return base;
}

// Adds 1 to flags[index] in `peer`'s window after the whole CTA's stores: bar.sync orders them
// before the release RMW (cumulativity), the pattern NCCL's barrier arrive() uses.
__device__ inline void moe_signal(ncclWindow_t flag_win, size_t flag_offset, int peer, size_t index) {
  unsigned long long* flags = (unsigned long long*)ncclGetLsaPointer(flag_win, flag_offset, peer);
  moe_flag(flags[index]).fetch_add(1ull, cuda::memory_order_release);
}

// One warp copies a row of `units` 16-byte vectors, four loads in flight per lane.
__device__ inline void moe_copy_row(uint4* dst, const uint4* src, int units, int lane) {
  int i = lane;
  for (; i + 96 < units; i += 128) {
    uint4 v0 = src[i], v1 = src[i + 32], v2 = src[i + 64], v3 = src[i + 96];
    dst[i] = v0;
    dst[i + 32] = v1;
    dst[i + 64] = v2;
    dst[i + 96] = v3;
  }
  for (; i < units; i += 32) dst[i] = src[i];
}

// 8 bf16 values times w, rounded back to bf16.
__device__ inline uint4 moe_scale(uint4 v, float w) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    float2 f = __bfloat1622float2(h[k]);
    f.x *= w;
    f.y *= w;
    h[k] = __float22bfloat162_rn(f);
  }
  return v;
}

// One warp scales a row by w into dst, four loads in flight per lane.
__device__ inline void moe_scale_row(uint4* dst, const uint4* src, float w, int units, int lane) {
  int i = lane;
  for (; i + 96 < units; i += 128) {
    uint4 v0 = src[i], v1 = src[i + 32], v2 = src[i + 64], v3 = src[i + 96];
    dst[i] = moe_scale(v0, w);
    dst[i + 32] = moe_scale(v1, w);
    dst[i + 64] = moe_scale(v2, w);
    dst[i + 96] = moe_scale(v3, w);
  }
  for (; i < units; i += 32) dst[i] = moe_scale(src[i], w);
}

// An FP8 byte (E4M3 when fmt == 0, else E5M2) as a float: exact, both formats are subsets of FP16.
__host__ __device__ inline float moe_fp8_value(unsigned char q, int fmt) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, fmt ? __NV_E5M2 : __NV_E4M3)));
}

// 8 FP8 values (an 8-byte unit of a row's payload) times their group's scale, each rounded to bf16:
// taco.quant.decompress's `payload.float() * scale` then `.to(bfloat16)`.
__host__ __device__ inline uint4 moe_dequant_unit(uint2 q, float scale, int fmt) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(&q);
  uint4 out;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&out);
  for (int k = 0; k < 4; k++)
    h[k] = __floats2bfloat162_rn(moe_fp8_value(b[2 * k], fmt) * scale, moe_fp8_value(b[2 * k + 1], fmt) * scale);
  return out;
}

// Rows received (sum of cnt), computed by each warp on its own (blockDim a multiple of 32).
__device__ inline long long moe_total(const long long* cnt, int n_counts, int lane) {
  long long rows = 0;
  for (int j = lane; j < n_counts; j += 32) rows += cnt[j];
  for (int o = 16; o; o >>= 1) rows += __shfl_xor_sync(0xffffffffu, rows, o);
  return rows;
}

// Dispatch: this rank's pairs, sorted by expert (`order`), go to their experts' ranks. Pair p =
// t*top_k + k with expert idx[p]; sorted position i; destination d's pairs are
// [dest_start[d], dest_start[d+1]), pair i has slot i - dest_start[d] and lands at row
// slot + base[e] of d's pool (see moe_expert_base). Every CTA signals every destination once, so
// flags[me] at d reaches gridDim.x. Dynamic shared memory: world * n_experts + 2 * per_rank
// long longs.
extern "C" __global__ void moe_dispatch(const uint4* x, const long long* idx, const float* weights,
                                        const long long* order, const long long* dest_start, int top_k,
                                        int experts_per_rank, int n_experts, int row_units, long long pool_rows,
                                        ncclWindow_t pool_win, size_t pool_off, ncclWindow_t pair_win,
                                        size_t pair_off, ncclWindow_t src_win, size_t src_off, ncclWindow_t wt_win,
                                        size_t wt_off, ncclWindow_t sent_win, size_t sent_off, long long* cnt,
                                        ncclWindow_t flag_win, size_t flag_off, ncclDevComm dc) {
  {
    // Every rank has written its `sent` counts and finished its previous call (its side stream
    // waited for its current stream before this kernel): nobody still reads the pool, `back` or
    // flags we are about to write.
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
  extern __shared__ long long moe_smem[];
  const int me = dc.lsaRank, n = dc.lsaSize, P = experts_per_rank;
  long long* all = moe_smem;                     // [n][n_experts]: every source's `sent`
  long long* base = all + (long long)n * n_experts;  // [P]: row = slot + base[e]
  long long* limit = base + P;                   // [P]: end of this rank's rows for e in d's pool
  for (int j = threadIdx.x; j < n * n_experts; j += blockDim.x) {
    const long long* sent = (const long long*)ncclGetLsaPointer(sent_win, sent_off, j / n_experts);
    all[j] = sent[j % n_experts];
  }
  __syncthreads();
  if (blockIdx.x == 0)  // rows per (source, local expert) received here, for the GEMMs and combine
    for (int j = threadIdx.x; j < n * P; j += blockDim.x) cnt[j] = all[(long long)(j / P) * n_experts + (long long)me * P + j % P];
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  const size_t row_bytes = (size_t)row_units * 16;
  for (int phase = 0; phase < n; phase++) {
    const int d = (me + phase) % n;
    const long long* counts = all + (long long)d * P;  // counts[s * n_experts + f]: s -> d's expert f
    for (int e = threadIdx.x; e < P; e += blockDim.x) {
      base[e] = moe_expert_base(counts, n_experts, n, me, e);
      long long first = 0;  // this rank's slot of its first pair for e
      for (int f = 0; f < e; f++) first += counts[(long long)me * n_experts + f];
      limit[e] = base[e] + first + counts[(long long)me * n_experts + e];
    }
    __syncthreads();
    char* pool = (char*)ncclGetLsaPointer(pool_win, pool_off, d);
    int* pairs = (int*)ncclGetLsaPointer(pair_win, pair_off, d);
    int* srcs = (int*)ncclGetLsaPointer(src_win, src_off, d);
    float* wts = (float*)ncclGetLsaPointer(wt_win, wt_off, d);
    const long long begin = dest_start[d], end = dest_start[d + 1];
    for (long long i = begin + warp; i < end; i += nwarps) {
      const long long p = order[i];
      const long long e = idx[p];
      // Never drop silently: a bad expert id or a row outside this rank's range for e stops the kernel.
      if (e < 0 || e >= n_experts || e / P != d) __trap();
      const int local = (int)(e - (long long)d * P);
      const long long row = (i - begin) + base[local];
      if (row < limit[local] - counts[(long long)me * n_experts + local] || row >= limit[local] || row >= pool_rows) __trap();
      moe_copy_row(reinterpret_cast<uint4*>(pool + row * row_bytes), x + (p / top_k) * row_units, row_units, lane);
      if (lane == 0) {
        pairs[row] = (int)p;
        srcs[row] = me;
        wts[row] = weights[p];
      }
    }
    __syncthreads();  // the CTA's stores before its signal; base and limit before the next phase
    if (threadIdx.x == 0) moe_signal(flag_win, flag_off, d, (size_t)me);
  }
}

// SwiGLU between the grouped GEMMs: h[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:] in fp32,
// rounded once, for the valid rows r < sum(cnt) only (a CTA per row at a time).
extern "C" __global__ void moe_swiglu(const uint4* gate_up, uint4* h, const long long* cnt, int n_counts, int inter_units) {
  const long long rows = moe_total(cnt, n_counts, threadIdx.x & 31);
  for (long long r = blockIdx.x; r < rows; r += gridDim.x)
  for (int u = threadIdx.x; u < inter_units; u += blockDim.x) {
    uint4 g = gate_up[r * 2 * inter_units + u], up = gate_up[r * 2 * inter_units + inter_units + u];
    __nv_bfloat162* gh = reinterpret_cast<__nv_bfloat162*>(&g);
    const __nv_bfloat162* uh = reinterpret_cast<const __nv_bfloat162*>(&up);
#pragma unroll
    for (int k = 0; k < 4; k++) {
      float2 a = __bfloat1622float2(gh[k]), b = __bfloat1622float2(uh[k]);
      a.x = a.x / (1.0f + __expf(-a.x)) * b.x;
      a.y = a.y / (1.0f + __expf(-a.y)) * b.y;
      gh[k] = __float22bfloat162_rn(a);
    }
    h[r * inter_units + u] = g;
  }
}

// FP8 dispatch: the valid rows [0, sum(cnt)) of the received byte pool, each a packed message
// (`payload` bytes of FP8 values, then one FP32 scale per `group` values; `wire` bytes a row), back
// to bf16 rows of `hidden` values. A thread converts 8 values (one group's) at a time.
extern "C" __global__ void moe_dequant(const uint8_t* pool8, uint4* pool, const long long* cnt, int n_counts,
                                       int hidden, int group, int payload, int wire, int fmt) {
  const long long rows = moe_total(cnt, n_counts, threadIdx.x & 31);
  const int units = hidden / 8;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * units;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / units;
    const int u = (int)(i - r * units);
    const uint8_t* row = pool8 + r * wire;
    const float scale = reinterpret_cast<const float*>(row + payload)[u * 8 / group];
    pool[i] = moe_dequant_unit(reinterpret_cast<const uint2*>(row)[u], scale, fmt);
  }
}

// Combine: the valid rows y[0, sum(cnt)) of the expert-major pool are scaled by their weights and
// stored at row pairs[i] of rank srcs[i]'s `back`; then each CTA adds 1 to flags[world + me] at
// every rank.
extern "C" __global__ void moe_combine(const uint4* y, const int* pairs, const int* srcs, const float* weights,
                                       const long long* cnt, int n_counts, int row_units, long long pairs_per_rank,
                                       int me, int world, ncclWindow_t back_win, size_t back_off,
                                       ncclWindow_t flag_win, size_t flag_off) {
  const int lane = threadIdx.x & 31;
  const long long rows = moe_total(cnt, n_counts, lane);
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
  const size_t row_bytes = (size_t)row_units * 16;
  for (long long i = warp; i < rows; i += nwarps) {
    const int s = srcs[i], p = pairs[i];
    if (s < 0 || s >= world || p < 0 || p >= pairs_per_rank) __trap();
    char* back = (char*)ncclGetLsaPointer(back_win, back_off, s);
    moe_scale_row(reinterpret_cast<uint4*>(back + (size_t)p * row_bytes), y + i * row_units, weights[i], row_units, lane);
  }
  __syncthreads();
  for (int r = threadIdx.x; r < world; r += blockDim.x) moe_signal(flag_win, flag_off, r, (size_t)(world + me));
}

// Blocks its stream until flags[first .. first+count) all reach target (acquire).
extern "C" __global__ void moe_wait(unsigned long long* flags, long long first, int count, unsigned long long target) {
  for (int i = 0; i < count; i++) {
    moe_flag flag(flags[first + i]);
    while (flag.load(cuda::memory_order_acquire) < target) {
    }
  }
}
"""


def available(ctx):
    if not ctx.is_cuda:
        return "the seed dispatches tokens over NVLink with NCCL's device API and needs CUDA GPUs"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (the experts' grouped GEMMs)"
    return None


def setup(ctx, shape):
    world, rank = ctx.world_size, ctx.rank
    for knob in ("comm_ctas", "threads", "combine_ctas", "combine_threads"):
        if CONFIG[knob] <= 0:
            raise ValueError(f"CONFIG[{knob!r}] must be positive, not {CONFIG[knob]}")
    for knob in ("threads", "combine_threads"):
        if CONFIG[knob] % 32 or CONFIG[knob] > 1024:
            raise ValueError(f"CONFIG[{knob!r}] must be a multiple of 32 up to 1024, not {CONFIG[knob]}")
    if CONFIG["swiglu"] not in ("fused", "torch"):
        raise ValueError(f"CONFIG['swiglu'] must be 'fused' or 'torch', not {CONFIG['swiglu']!r}")
    if CONFIG["experts"] not in ("auto", "grouped", "streamed", "none"):
        raise ValueError(f"CONFIG['experts'] must be 'auto', 'grouped', 'streamed' or 'none', not {CONFIG['experts']!r}")
    if CONFIG["wait"] not in ("kernel", "stream"):
        raise ValueError(f"CONFIG['wait'] must be 'kernel' or 'stream', not {CONFIG['wait']!r}")
    fmt = {"none": None, "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}.get(CONFIG["compression"], "?")
    if fmt == "?":
        raise ValueError(f"CONFIG['compression'] must be 'none', 'fp8_e4m3' or 'fp8_e5m2', not {CONFIG['compression']!r}")
    tokens, hidden, top_k, n_experts = shape["T"], shape["H"], shape["K"], shape["E"]
    if hidden % 8 or shape["I"] % 8:
        raise ValueError(f"rows are handled as 16-byte vectors: H={hidden} and I={shape['I']} must be multiples of 8")
    per_rank = n_experts // world
    shared = (world * n_experts + 2 * per_rank) * 8
    if shared > MAX_SHARED_BYTES:
        raise ValueError(f"the dispatch keeps W * E + 2 * E/W counts in shared memory: {shared} bytes for E={n_experts}, "
                         f"W={world} exceed {MAX_SHARED_BYTES}")
    pool_rows = world * routing.pool_rows_per_source(tokens, top_k)
    if pool_rows >= 2**31:
        raise ValueError(f"pair ids and rows are int32 in the kernels: {pool_rows} pool rows are too many")
    fp8 = None
    if fmt is not None:  # FP8 dispatch: token rows as packed messages into a symmetric byte pool
        cfg = QuantConfig(CONFIG["group_size"], fmt, hadamard=False, dual_scale=False)
        wire = cfg.packed_stride(hidden)  # a row's message, rounded to 16 bytes (the copy's vectors)
        fp8 = {"cfg": cfg, "wire": wire, "payload": cfg.num_groups(hidden) * cfg.group_size, "fmt": int(fmt == "e5m2"),
               "xq": torch.empty(tokens * wire, dtype=torch.uint8, device=ctx.device),
               "pool8": ctx.symmetric((pool_rows, wire), torch.uint8, zero=False)}
    # the bf16 rows the GEMMs read: received there directly, or dequantized from the byte pool
    pool = (ctx.symmetric((pool_rows, hidden), torch.bfloat16, zero=False) if fp8 is None
            else torch.empty((pool_rows, hidden), dtype=torch.bfloat16, device=ctx.device))
    pair = ctx.symmetric((pool_rows,), torch.int32, zero=False)
    src = ctx.symmetric((pool_rows,), torch.int32, zero=False)
    wt = ctx.symmetric((pool_rows,), torch.float32, zero=False)
    sent = ctx.symmetric((n_experts,), torch.int64, zero=False)
    back = ctx.symmetric((tokens * top_k, hidden), torch.bfloat16, zero=False)
    flags = ctx.symmetric((2 * world,), torch.int64)  # zeroed, ranks lined up after
    dc = ctx.dev_comm(lsa_barriers=CONFIG["comm_ctas"])
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    from commweave.workloads.moe import experts as streamed_experts  # Triton: imported on CUDA only

    rows_per_expert = tokens * top_k * world / n_experts  # balanced: T*K rows a rank over its E/W experts
    streamed = CONFIG["experts"] == "streamed" or (
        CONFIG["experts"] == "auto" and rows_per_expert <= streamed_experts.STREAMED_MAX_ROWS)
    module = ctx.compile(CUDA_SRC, "moe_seed")
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    return {
        "pool": pool, "pair": pair, "src": src, "wt": wt, "sent": sent, "back": back, "flags": flags, "dc": dc,
        "cnt": torch.zeros((world, per_rank), dtype=torch.int64, device=ctx.device),  # local: own dispatch writes it
        "wins": {name: ctx.window(t) for name, t in (("pool", pool if fp8 is None else fp8["pool8"]), ("pair", pair),
                                                    ("src", src), ("wt", wt), ("sent", sent), ("back", back),
                                                    ("flags", flags))},
        "dispatch": module.kernel("moe_dispatch"), "combine": module.kernel("moe_combine"),
        "swiglu": module.kernel("moe_swiglu"), "wait": module.kernel("moe_wait"), "dequant": module.kernel("moe_dequant"),
        "fp8": fp8,
        "stream": ctx.stream("comm", priority=CONFIG["comm_priority"]), "shared": shared, "swiglu_ctas": sms * SWIGLU_CTAS_PER_SM,
        "pool_rows": pool_rows, "per_rank": per_rank, "E": n_experts, "K": top_k, "I": shape["I"], "H": hidden,
        "graphs": CallGraphs(MAX_GRAPHS),
        "streamed": (streamed_experts, streamed_experts.tiles_for(min(rows_per_expert, streamed_experts.STREAMED_MAX_ROWS)))
        if streamed else None,
    }


def run(ctx, state, inputs, out):
    for name, dtype in (("x", torch.bfloat16), ("topk_idx", torch.int64), ("topk_weights", torch.float32)):
        t = inputs[name]
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"inputs[{name!r}] must be a contiguous {dtype} tensor, got {t.dtype}")
    if inputs["x"].data_ptr() % 16:
        raise ValueError("inputs['x'] must be 16-byte aligned (rows are copied as 16-byte vectors)")
    if CONFIG["graph"]:
        state["graphs"](lambda: _call(ctx, state, inputs, out), [*inputs.values(), out])
    else:
        _call(ctx, state, inputs, out)


def _wait(state, first, count, target, stream):
    if CONFIG["wait"] == "stream":
        for i in range(first, first + count):
            stream_wait_geq(state["flags"][i].data_ptr(), target, stream)
    else:
        state["wait"].launch(1, 1, [state["flags"], first, count, target], stream=stream)


def _swiglu(state, rows, w13, w2, ends):
    """SwiGLU of the expert-major pool; rows past ends[-1] are garbage and stay unused."""
    if state["streamed"] is not None:
        kernels, (gate_up_tiles, down_tiles) = state["streamed"]
        return kernels.down(kernels.gate_up_swiglu(rows, w13, ends, gate_up_tiles), w2, ends, down_tiles)
    gate_up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=ends)
    inter = state["I"]
    if CONFIG["swiglu"] == "fused":
        h = gate_up.new_empty(gate_up.shape[0], inter)
        state["swiglu"].launch(state["swiglu_ctas"], 256, [gate_up, h, state["cnt"], state["cnt"].numel(), inter // 8])
    else:
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends)


def _call(ctx, state, inputs, out):
    world, rank, wins = ctx.world_size, ctx.rank, state["wins"]
    x, idx, w = inputs["x"], inputs["topk_idx"], inputs["topk_weights"]
    main, comm = torch.cuda.current_stream(ctx.device), state["stream"]
    layout = routing.slot_layout(idx, state["E"], world)
    state["sent"].copy_(layout["counts"])  # peers read it after the dispatch's opening barrier
    fp8, rows, row_units = state["fp8"], x, state["H"] // 8
    if fp8 is not None:  # every token row its own packed message (one message alone: no padding to 16)
        tokens = x.shape[0]
        taco_cuda.compress_into(x, fp8["cfg"], fp8["xq"] if tokens > 1 else fp8["xq"][:fp8["cfg"].wire_bytes(state["H"])],
                                segments=tokens)
        rows, row_units = fp8["xq"], fp8["wire"] // 16

    comm.wait_stream(main)  # layout, counts (and messages) are ready; this rank's previous call (reset included) is done
    state["dispatch"].launch(CONFIG["comm_ctas"], CONFIG["threads"], [
        rows, idx, w, layout["order"], layout["dest_start"], state["K"], state["per_rank"], state["E"], row_units,
        state["pool_rows"], wins["pool"], wins["pool"].offset, wins["pair"], wins["pair"].offset, wins["src"],
        wins["src"].offset, wins["wt"], wins["wt"].offset, wins["sent"], wins["sent"].offset, state["cnt"],
        wins["flags"], wins["flags"].offset, state["dc"],
    ], stream=comm, shared_mem=state["shared"])

    _wait(state, 0, world, CONFIG["comm_ctas"], main)  # every source's rows (and cnt) landed
    if fp8 is not None:
        state["dequant"].launch(state["swiglu_ctas"], 256, [
            fp8["pool8"], state["pool"], state["cnt"], state["cnt"].numel(), state["H"], fp8["cfg"].group_size,
            fp8["payload"], fp8["wire"], fp8["fmt"]])
    if CONFIG["experts"] == "none":
        y = state["pool"]
    else:
        y = _swiglu(state, state["pool"], inputs["w13"], inputs["w2"], routing.expert_group_ends(state["cnt"]))
    state["combine"].launch(CONFIG["combine_ctas"], CONFIG["combine_threads"], [
        y, state["pair"], state["src"], state["wt"], state["cnt"], state["cnt"].numel(), state["H"] // 8,
        x.shape[0] * state["K"], rank, world, wins["back"], wins["back"].offset, wins["flags"], wins["flags"].offset,
    ], stream=main)

    _wait(state, world, world, CONFIG["combine_ctas"], main)
    out.copy_(torch.sum(state["back"].view(x.shape[0], state["K"], -1), dim=1, dtype=torch.float32))
    state["flags"].zero_()  # every flag was waited for above; see the module docstring
    main.wait_stream(comm)
# EVOLVE-BLOCK-END
