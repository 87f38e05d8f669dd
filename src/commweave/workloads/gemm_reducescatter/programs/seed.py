"""Device-initiated seed: per-piece partial GEMMs signal their owners, who pull and sum the W partials
over NVLink (LSA loads) while the remaining GEMMs run.

Each rank's partial product A_r @ B_r is [M, N]; row block b (M/W rows) belongs to rank b. Blocks
are cut into `chunks` row pieces, and the work goes in rounds: round c multiplies piece c of every
block with cuBLAS into this rank's symmetric `part` [M, N], order "staggered" from the block of
rank + 1 to its own block last (so in each round every rank starts on a different block), order
"aligned" from block 0 to W - 1 on every rank. After a peer's piece the current stream writes 1
into that peer's `flags[rank*chunks + c]` (`cuStreamWriteValue64`: after the GEMM, with a memory
barrier; no kernel); after its own piece it records an event.

A high-priority side stream then, per round: waits for the own piece's event, and launches the
reduction kernel (`comm_ctas` CTAs), whose threads first spin (system-scope acquire) until every
peer's flag for that piece is set (wait "stream": `cuStreamWaitValue64` per flag instead, no SM),
then load the piece from all W ranks' `part` windows (`ncclGetLsaPointer`: NVLink loads), sum in
fp32 in rank order (the same bits whichever rank reduces) and store bf16 into `out`. So round c's
pull overlaps round c + 1's GEMMs (cuBLASLt told to leave `comm_ctas` SMs free), and only the
last round's pull is exposed. The side stream zeroes the flags after the last round.

Reuse across calls: a call opens with an LSA barrier on the current stream, which no rank enters
before its previous call is over (reductions joined, flags zeroed), so no peer still reads a
`part` it is about to overwrite, and no flag of the new call can be set before its owner's reset.
Targets are constant, so a call is captured once per input/output addresses as a CUDA graph and
replayed. `overlap=False` (placement deferred, sync global: the conservative strategy): every
GEMM, a second LSA barrier, then one reduction of the whole block with no flags. At W = 1 the
seed is the plain GEMM.
"""

import torch

from commweave.runtime.graphs import CallGraphs
from commweave.runtime.launch import stream_wait_geq, stream_write

# EVOLVE-BLOCK-START
CONFIG = dict(
    comm_ctas=16,  # CTAs of each reduction kernel (SMs taken from the GEMMs while a pull runs)
    threads=512,  # threads per reduction CTA (at least W: one waits on each peer's flag)
    chunks=4,  # row pieces per block = rounds: more overlap, but smaller GEMMs and more launches
    order="staggered",  # within a round: "staggered" block rank+1 first, own last; "aligned" block 0 first everywhere
    comm_priority=-1,  # stream priority of the reductions (negative: scheduled ahead of GEMM CTAs)
    wait="kernel",  # "kernel": the reduction's threads spin on the flags; "stream": cuStreamWaitValue64, no SM
    carveout=True,  # GEMMs target SMs minus comm_ctas (cuBLASLt), so a pull never waits for a GEMM wave
    graph=True,  # replay the call as a CUDA graph (captured per input/output addresses)
    overlap=True,  # False: every GEMM, one LSA barrier, then one reduction (placement deferred, sync global)
)
MAX_GRAPHS = 32  # captured calls kept per setup (the benchmark rotates up to 16 input sets)
MAX_RANKS = 8  # the reduction kernel's source table (NVLink domains of up to 8 GPUs)

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#define CW_MAX_RANKS 8  // NVLink domains of up to 8 GPUs
#define CW_UNROLL 2     // units each thread loads from every source before summing (memory-level parallelism)

using cw_flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

// One piece in every rank's partial buffer, in rank order (the sum's order).
struct CwSources {
  const unsigned short* src[CW_MAX_RANKS];
  int count;
};

// Rows [first, end) of piece c when `rows` rows are cut into `chunks` pieces (the host uses the
// same formula; a piece may be empty when rows < chunks).
__host__ __device__ inline long long cw_chunk_begin(long long rows, int chunks, int c) {
  return rows * c / chunks;
}

__host__ __device__ inline float cw_bf16_to_float(unsigned short h) {
  unsigned int bits = (unsigned int)h << 16;
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// float -> bfloat16 rounded to nearest even, as torch converts (a NaN becomes the quiet NaN 0x7FC0).
__host__ __device__ inline unsigned short cw_float_to_bf16(float f) {
  unsigned int bits;
#ifdef __CUDA_ARCH__
  bits = __float_as_uint(f);
#else
  memcpy(&bits, &f, sizeof bits);
#endif
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// E bf16 values moved as one load or store (E = 8: 16 bytes).
template <int E>
struct alignas(2 * E) CwUnit {
  unsigned short h[E];
};

// K units i, i + stride, ...: out = sum of the sources in rank order, in fp32, rounded once to bf16.
// `first` is an element offset at which every source and out are aligned to a unit.
template <int E, int K>
__host__ __device__ inline void cw_sum_group(const CwSources& s, unsigned short* out, size_t first, size_t i,
                                             size_t stride) {
  typedef CwUnit<E> U;
  float acc[K][E];
#pragma unroll
  for (int p = 0; p < CW_MAX_RANKS; p++) {
    if (p < s.count) {
      const U* src = reinterpret_cast<const U*>(s.src[p] + first);
      U v[K];
#pragma unroll
      for (int k = 0; k < K; k++) v[k] = src[i + k * stride];
#pragma unroll
      for (int k = 0; k < K; k++) {
#pragma unroll
        for (int e = 0; e < E; e++) {
          float x = cw_bf16_to_float(v[k].h[e]);
          acc[k][e] = p == 0 ? x : acc[k][e] + x;
        }
      }
    }
  }
  U* dst = reinterpret_cast<U*>(out + first);
#pragma unroll
  for (int k = 0; k < K; k++) {
    U o;
#pragma unroll
    for (int e = 0; e < E; e++) o.h[e] = cw_float_to_bf16(acc[k][e]);
    dst[i + k * stride] = o;
  }
}

// n units of E values from element `first` on; this thread handles units tid, tid + nthreads, ...
template <int E>
__host__ __device__ inline void cw_sum_units(const CwSources& s, unsigned short* out, size_t first, size_t n,
                                             size_t tid, size_t nthreads) {
  size_t i = tid;
  for (; i + (CW_UNROLL - 1) * nthreads < n; i += CW_UNROLL * nthreads) cw_sum_group<E, CW_UNROLL>(s, out, first, i, nthreads);
  for (; i < n; i += nthreads) cw_sum_group<E, 1>(s, out, first, i, nthreads);
}

// count values: single values up to the first E-unit boundary, then whole units, then the rest.
template <int E>
__host__ __device__ inline void cw_sum_aligned(const CwSources& s, unsigned short* out, size_t count, size_t tid,
                                               size_t nthreads) {
  size_t head = ((2 * E - reinterpret_cast<uintptr_t>(s.src[0]) % (2 * E)) % (2 * E)) / 2;
  if (head > count) head = count;
  size_t body = (count - head) / E;
  cw_sum_units<1>(s, out, 0, head, tid, nthreads);
  cw_sum_units<E>(s, out, head, body, tid, nthreads);
  size_t done = head + body * E;
  cw_sum_units<1>(s, out, done, count - done, tid, nthreads);
}

// out[0, count) = sum over ranks of src[p][0, count), with the widest unit all pointers share.
__host__ __device__ inline void cw_sum_piece(const CwSources& s, unsigned short* out, size_t count, size_t tid,
                                             size_t nthreads) {
  if (count == 0) return;
  uintptr_t base = reinterpret_cast<uintptr_t>(s.src[0]);
  uintptr_t mis = base ^ reinterpret_cast<uintptr_t>(out);
#pragma unroll
  for (int p = 1; p < CW_MAX_RANKS; p++) {
    if (p < s.count) mis |= base ^ reinterpret_cast<uintptr_t>(s.src[p]);
  }
  if (mis % 16 == 0) cw_sum_aligned<8>(s, out, count, tid, nthreads);
  else if (mis % 8 == 0) cw_sum_aligned<4>(s, out, count, tid, nthreads);
  else if (mis % 4 == 0) cw_sum_aligned<2>(s, out, count, tid, nthreads);
  else cw_sum_units<1>(s, out, 0, count, tid, nthreads);
}

// out[0, count) = the sum of the piece at byte `piece_offset` of every rank's partial window. With
// `wait`, thread p of each CTA first spins until rank p's flag flags[flag_index + p*flag_stride] is
// set (acquire, system scope), and the CTA syncs: then every rank's GEMM of the piece is visible.
extern "C" __global__ void cw_rs_reduce(ncclWindow_t part_win, size_t piece_offset, unsigned short* out,
                                        long long count, unsigned long long* flags, long long flag_index,
                                        long long flag_stride, int wait, int me, int world) {
  if (wait) {
    int p = threadIdx.x;
    if (p < world && p != me) {
      cw_flag flag(flags[flag_index + p * flag_stride]);
      while (flag.load(cuda::memory_order_acquire) == 0ull) {
      }
    }
    __syncthreads();
  }
  CwSources s;
  s.count = world;
#pragma unroll
  for (int p = 0; p < CW_MAX_RANKS; p++)
    s.src[p] = p < world ? (const unsigned short*)ncclGetLsaPointer(part_win, piece_offset, p) : nullptr;
  cw_sum_piece(s, out, (size_t)count, (size_t)blockIdx.x * blockDim.x + threadIdx.x, (size_t)gridDim.x * blockDim.x);
}

// Every rank's GPU meets here (acquire and release): at a call's start, nobody still reads the
// partials about to be overwritten; with overlap=False, after the GEMMs, every partial is visible.
extern "C" __global__ void cw_rs_barrier(ncclDevComm dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}
"""


def available(ctx):
    if ctx.world_size > 1 and not ctx.is_cuda:
        return "the seed pulls partials over NVLink with NCCL's device API and needs CUDA GPUs"
    return None


def chunk_begin(rows, chunks, c):
    """First row of piece c (the same formula as cw_chunk_begin in the kernel)."""
    return rows * c // chunks


def schedule(rank, world, chunks, order):
    """(block, piece) in the order this rank multiplies them: round by round (piece c of every block
    before piece c + 1); within a round "staggered" from block rank + 1 to its own block last,
    "aligned" from block 0 to W - 1 on every rank."""
    if order == "staggered":
        blocks = [(rank + j) % world for j in range(1, world + 1)]
    elif order == "aligned":
        blocks = list(range(world))
    else:
        raise ValueError(f"CONFIG['order'] must be 'staggered' or 'aligned', not {order!r}")
    return [(b, c) for c in range(chunks) for b in blocks]


def setup(ctx, shape):
    world, rank = ctx.world_size, ctx.rank
    if world == 1:
        return {"local": True}
    m, n = shape["M"], shape["N"]
    chunks = CONFIG["chunks"] if CONFIG["overlap"] else 1
    schedule(rank, world, chunks, CONFIG["order"])  # raises for an unknown order
    if CONFIG["wait"] not in ("kernel", "stream"):
        raise ValueError(f"CONFIG['wait'] must be 'kernel' or 'stream', not {CONFIG['wait']!r}")
    if chunks < 1 or CONFIG["comm_ctas"] < 1:
        raise ValueError(f"CONFIG chunks={chunks} and comm_ctas={CONFIG['comm_ctas']} must both be at least 1")
    if world > MAX_RANKS:
        raise ValueError(f"the reduction kernel sums at most {MAX_RANKS} ranks' partials, not {world}")
    if CONFIG["threads"] < world:
        raise ValueError(f"CONFIG threads={CONFIG['threads']}: one thread a CTA waits on each rank's flag, so at least {world}")
    part = ctx.symmetric((m, n), torch.bfloat16, zero=False)
    flags = ctx.symmetric((world * chunks,), torch.int64)  # zeroed, ranks lined up after
    dc = ctx.dev_comm(lsa_barriers=1)
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    module = ctx.compile(CUDA_SRC, "gemm_reducescatter_seed")
    return {
        "local": False, "part": part, "flags": flags, "dc": dc, "part_win": ctx.window(part),
        "peer_flags": ctx.peer_ptrs(flags), "rows": m // world, "n": n, "chunks": chunks,
        "reduce": module.kernel("cw_rs_reduce"), "barrier": module.kernel("cw_rs_barrier"),
        "stream": ctx.stream("comm", priority=CONFIG["comm_priority"]), "graphs": CallGraphs(MAX_GRAPHS),
        "own": [torch.cuda.Event() for _ in range(chunks)],
    }


def run(ctx, state, inputs, out):
    if state["local"]:
        torch.matmul(inputs["a"], inputs["b"], out=out)
    elif CONFIG["graph"]:
        state["graphs"](lambda: _call(ctx, state, inputs, out), [*inputs.values(), out])
    else:
        _call(ctx, state, inputs, out)


def _call(ctx, state, inputs, out):
    if not out.is_contiguous():
        raise ValueError("the reduction writes the output's rows as one contiguous block")
    main = torch.cuda.current_stream(ctx.device)
    state["barrier"].launch(1, 32, [state["dc"]], stream=main)  # see the module docstring
    if not CONFIG["overlap"]:
        _gemms(ctx, state, inputs, signal=False)
        state["barrier"].launch(1, 32, [state["dc"]], stream=main)  # every rank's partials written and visible
        _reduce(ctx, state, out, 0, state["rows"], wait=False, stream=main)
        return
    comm = state["stream"]
    comm.wait_stream(main)  # the output is ready to be written (the harness poisoned it on this stream)
    if CONFIG["carveout"]:
        # Process-wide torch state: set only while this call's GEMMs are queued, then restored.
        saved = torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()
        torch._C._set_sm_carveout_experimental(CONFIG["comm_ctas"])
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            _gemms(ctx, state, inputs, signal=True)
        finally:
            torch._C._set_sm_carveout_experimental(saved[0])
            torch.backends.cuda.preferred_blas_library(saved[1])
    else:
        _gemms(ctx, state, inputs, signal=True)
    rows, chunks = state["rows"], state["chunks"]
    for c in range(chunks):
        r0, r1 = chunk_begin(rows, chunks, c), chunk_begin(rows, chunks, c + 1)
        if r1 == r0:  # an empty piece (rows < chunks): nobody multiplies or signals it
            continue
        comm.wait_event(state["own"][c])
        if CONFIG["wait"] == "stream":
            for p in range(ctx.world_size):
                if p != ctx.rank:
                    stream_wait_geq(state["flags"][p * chunks + c].data_ptr(), 1, comm)
        _reduce(ctx, state, out, r0, r1, wait=CONFIG["wait"] == "kernel", stream=comm, piece=c)
    with torch.cuda.stream(comm):
        state["flags"].zero_()  # every flag was waited for above; see the module docstring
    main.wait_stream(comm)


def _gemms(ctx, state, inputs, signal):
    """Every non-empty (block, piece) in schedule order into `part`; with `signal`, a peer's piece is
    followed by a write of 1 into its flag for (this rank, piece), the own piece by its event."""
    a, b, part = inputs["a"], inputs["b"], state["part"]
    rank, rows, chunks = ctx.rank, state["rows"], state["chunks"]
    main = torch.cuda.current_stream(ctx.device)
    for block, c in schedule(rank, ctx.world_size, chunks, CONFIG["order"]):
        r0, r1 = block * rows + chunk_begin(rows, chunks, c), block * rows + chunk_begin(rows, chunks, c + 1)
        if r1 == r0:
            continue
        torch.matmul(a[r0:r1], b, out=part[r0:r1])
        if not signal:
            continue
        if block == rank:
            state["own"][c].record(main)
        else:
            stream_write(state["peer_flags"][block] + 8 * (rank * chunks + c), 1, main)


def _reduce(ctx, state, out, r0, r1, wait, stream, piece=0):
    """out[r0:r1] = the sum over ranks of rows [r0, r1) of this rank's block in their `part`."""
    n, win = state["n"], state["part_win"]
    offset = win.offset + (ctx.rank * state["rows"] + r0) * n * 2
    state["reduce"].launch(CONFIG["comm_ctas"], CONFIG["threads"], [
        win, offset, out[r0:r1], (r1 - r0) * n, state["flags"], piece, state["chunks"], int(wait), ctx.rank,
        ctx.world_size,
    ], stream=stream)
# EVOLVE-BLOCK-END
