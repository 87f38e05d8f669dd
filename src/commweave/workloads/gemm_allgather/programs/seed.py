"""Device-initiated seed: LSA push of A's row shards with per-chunk flags, GEMMs chase the flags.

Placement "split": a communication kernel on a high-priority side stream pushes this rank's A
shard straight into peers' symmetric `a_full` (NVLink stores through `ncclGetLsaPointer`), chunk
by chunk, and after each chunk bumps a counter in that peer's symmetric `flags`. The current
stream first multiplies the local shard (it needs nothing), then for every remote (source, chunk)
in arrival order runs a one-thread kernel that spins until that counter reaches this call's
target, and a cuBLAS GEMM on those rows. Gather and GEMM overlap; no host synchronization.

Order "staggered": in phase j every rank sends its whole shard to rank + j only, so each receiver
gets complete shards one after another (from rank - 1 first) at the full single-peer NVLink rate,
and its GEMMs on early shards overlap the later shards' transfer. Order "broadcast": every chunk
goes to all peers at once (one load, W-1 stores), so all shards arrive together at the end.

Every CTA of the producer signals every chunk once per call, so a piece is complete when its
counter reaches comm_ctas; the consumer zeroes all counters at the end of the call. That reset
cannot race the next call's signals: the push kernel opens with an LSA barrier that no rank enters
before its previous call (reset included) is done, which also guarantees nobody still reads
`a_full` when it is overwritten. Targets are constant, so a whole call can be captured once as a
CUDA graph and replayed: one launch instead of ~10 Python-issued ones (graphs are cached by the
tensors' addresses, which the graph bakes in).

Backend "ce" (copy engines, no SMs for communication): the side stream runs a one-CTA LSA barrier
(the same guarantee as the push kernel's opening barrier), then per peer and chunk a `copy_` of the
shard's rows into the peer's `a_full` through its mapped address (`ctx.peer_tensor`: a device-to-
device memcpy the driver gives a copy engine) followed by a stream write of 1 into the peer's
counter (`stream_write`: after the copy completes, with a memory barrier). Targets are then 1 per
piece, and `comm_ctas` is 0 (no carve-out).

Compression (CONFIG `compression` "fp8_e4m3" / "fp8_e5m2", `group_size`; only for workloads whose
tolerance admits it, e.g. gemm-allgather-lossy): the side stream opens with the same LSA barrier,
then compresses the shard chunk by chunk with TACO's kernel (`commweave.taco.cuda`, Hadamard and
dual scales, as many CTAs as it fills: a short burst per chunk, ~1.6 TB/s on an H200, which a cap
of `comm_ctas` CTAs would slow below the link's rate; `comm_ctas` only sizes the GEMMs' carve-out)
into this rank's symmetric `a_wire` and after each chunk stream-writes 1 into every peer's counter. A
second side stream, `pull`, waits per (source, chunk) as above, then one TACO gather kernel reads
the source's packed chunk straight from its window over NVLink (about half the bytes of BF16) and
decompresses it into `a_full`, and records that piece's event; the current stream multiplies the
own shard meanwhile and each piece once its event fires, so no pull sits between two GEMMs. The own
shard is multiplied exact, never compressed.
"""

import torch

from commweave.runtime.graphs import CallGraphs
from commweave.runtime.launch import stream_wait_geq, stream_write
from commweave.taco import cuda as taco_cuda
from commweave.taco.quant import QuantConfig, packed_view

# EVOLVE-BLOCK-START
CONFIG = dict(
    backend="lsa",  # "lsa": the push kernel's NVLink stores; "ce": copy-engine copies + stream-written flags
    comm_ctas=8,  # CTAs of the push kernel (SMs taken from the GEMMs while A is in flight); 0 with "ce"
    threads=512,  # threads per push CTA
    chunks=1,  # pieces per shard: more overlap, but more (smaller, less efficient) GEMMs
    order="staggered",  # "staggered": one peer per phase, shards arrive in turn; "broadcast": all at once
    comm_priority=-1,  # stream priority of the push kernel (negative: scheduled ahead of GEMM CTAs)
    wait="kernel",  # "kernel": a 1-thread acquire spin per chunk; "stream": cuStreamWaitValue64, no SM
    carveout=True,  # GEMMs target SMs minus comm_ctas (cuBLASLt), so a shard's GEMM fits one wave
    graph=True,  # replay the call as a CUDA graph (captured per input/output addresses)
    overlap=True,  # False: push every shard, one LSA barrier across ranks, then the GEMMs (placement
    #                deferred, sync global: the conservative strategy the fast path starts from)
    compression="none",  # "fp8_e4m3" / "fp8_e5m2": peers pull TACO-compressed chunks (lossy: the
    #                      workload's tolerance must admit it); needs backend "lsa" and overlap
    group_size=128,  # elements sharing one pair of FP8 scales (with compression)
)
MAX_GRAPHS = 32  # captured calls kept per setup (the benchmark rotates up to 16 input sets)

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cstddef>
#include <cstdint>

#define CW_MAX_PEERS 7  // NVLink domains of up to 8 GPUs
#define CW_UNROLL 4     // vectors each thread loads before storing, for memory-level parallelism

using cw_flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

// Where one chunk goes: the same byte offset in each peer's window (peers are 4 GiB apart in the
// LSA flat mapping, so every destination has the same alignment).
struct CwPeers {
  char* dst[CW_MAX_PEERS];
  int count;
};

// Rows [first, end) of chunk c when `rows` rows are cut into `chunks` pieces (the host uses the
// same formula; a piece may be empty when rows < chunks).
__host__ __device__ inline long long cw_chunk_begin(long long rows, int chunks, int c) {
  return rows * c / chunks;
}

// Copies n units of V from src to every peer; this thread handles units tid, tid+nthreads, ...
// src and all destinations must be aligned to sizeof(V).
template <typename V>
__host__ __device__ inline void cw_push_units(const char* src, const CwPeers& to, size_t offset, size_t n,
                                              size_t tid, size_t nthreads) {
  const V* s = reinterpret_cast<const V*>(src + offset);
  size_t i = tid;
  for (; i + (CW_UNROLL - 1) * nthreads < n; i += CW_UNROLL * nthreads) {
    V v[CW_UNROLL];
#pragma unroll
    for (int u = 0; u < CW_UNROLL; u++) v[u] = s[i + u * nthreads];
#pragma unroll
    for (int p = 0; p < CW_MAX_PEERS; p++) {
      if (p < to.count) {
        V* d = reinterpret_cast<V*>(to.dst[p] + offset);
#pragma unroll
        for (int u = 0; u < CW_UNROLL; u++) d[i + u * nthreads] = v[u];
      }
    }
  }
  for (; i < n; i += nthreads) {
    V v = s[i];
#pragma unroll
    for (int p = 0; p < CW_MAX_PEERS; p++) {
      if (p < to.count) reinterpret_cast<V*>(to.dst[p] + offset)[i] = v;
    }
  }
}

// Copies nbytes with the widest vector that source and destinations share: bytes up to the first
// V boundary, then whole Vs, then the remaining bytes.
template <typename V>
__host__ __device__ inline void cw_push_aligned(const char* src, const CwPeers& to, size_t nbytes, size_t tid,
                                                size_t nthreads) {
  size_t head = (sizeof(V) - reinterpret_cast<uintptr_t>(src) % sizeof(V)) % sizeof(V);
  if (head > nbytes) head = nbytes;
  size_t body = (nbytes - head) / sizeof(V);
  cw_push_units<unsigned char>(src, to, 0, head, tid, nthreads);
  cw_push_units<V>(src, to, head, body, tid, nthreads);
  size_t done = head + body * sizeof(V);
  cw_push_units<unsigned char>(src, to, done, nbytes - done, tid, nthreads);
}

__host__ __device__ inline void cw_push_bytes(const char* src, const CwPeers& to, size_t nbytes, size_t tid,
                                              size_t nthreads) {
  if (to.count == 0 || nbytes == 0) return;
  uintptr_t mis = reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(to.dst[0]);
  if (mis % 16 == 0) cw_push_aligned<uint4>(src, to, nbytes, tid, nthreads);
  else if (mis % 8 == 0) cw_push_aligned<uint2>(src, to, nbytes, tid, nthreads);
  else if (mis % 4 == 0) cw_push_aligned<unsigned int>(src, to, nbytes, tid, nthreads);
  else if (mis % 2 == 0) cw_push_aligned<unsigned short>(src, to, nbytes, tid, nthreads);
  else cw_push_units<unsigned char>(src, to, 0, nbytes, tid, nthreads);
}

// Adds 1 to flags[index] in `peer`'s window, after the whole CTA's stores of that chunk: bar.sync
// orders them before the release RMW (cumulativity), the same pattern NCCL's barrier arrive() uses.
__device__ inline void cw_signal(ncclWindow_t flag_win, size_t flag_offset, int peer, size_t index) {
  unsigned long long* flags = (unsigned long long*)ncclGetLsaPointer(flag_win, flag_offset, peer);
  cw_flag(flags[index]).fetch_add(1ull, cuda::memory_order_release);
}

// Pushes this rank's shard (rows x row_bytes, contiguous at a_local) into rows
// [rank*rows, (rank+1)*rows) of peers' a_full, chunk by chunk, and after each chunk adds 1 to
// flags[rank*chunks + c] in the receiving peer's window, once per CTA. Empty chunks still signal,
// so every counter advances by exactly gridDim.x per call.
// staggered != 0: phase j sends the whole shard to rank + j only; else each chunk goes to all peers.
extern "C" __global__ void cw_ag_push(const char* a_local, ncclWindow_t a_win, size_t a_offset,
                                      ncclWindow_t flag_win, size_t flag_offset, long long rows,
                                      long long row_bytes, int chunks, int staggered, ncclDevComm dc) {
  {
    // Every rank has finished the previous call's GEMMs (its side stream waited for them before
    // this kernel), so nobody's a_full is still being read when we start overwriting it.
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
  const int me = dc.lsaRank, n = dc.lsaSize;
  const size_t shard_offset = a_offset + (size_t)me * rows * row_bytes;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t nthreads = (size_t)gridDim.x * blockDim.x;
  const int phases = staggered ? n - 1 : 1;
  for (int phase = 0; phase < phases; phase++) {
    CwPeers to;
    to.count = staggered ? 1 : n - 1;
#pragma unroll
    for (int p = 0; p < CW_MAX_PEERS; p++) {
      int peer = (me + 1 + (staggered ? phase : p)) % n;
      to.dst[p] = p < to.count ? (char*)ncclGetLsaPointer(a_win, shard_offset, peer) : nullptr;
    }
    for (int c = 0; c < chunks; c++) {
      long long r0 = cw_chunk_begin(rows, chunks, c), r1 = cw_chunk_begin(rows, chunks, c + 1);
      CwPeers chunk = to;
#pragma unroll
      for (int p = 0; p < CW_MAX_PEERS; p++) {
        if (p < to.count) chunk.dst[p] += r0 * row_bytes;
      }
      cw_push_bytes(a_local + r0 * row_bytes, chunk, (size_t)((r1 - r0) * row_bytes), tid, nthreads);
      __syncthreads();
      if (threadIdx.x < to.count) {
        int peer = (me + 1 + (staggered ? phase : (int)threadIdx.x)) % n;
        cw_signal(flag_win, flag_offset, peer, (size_t)me * chunks + c);
      }
    }
  }
}

// Backend ce: every rank's GPU meets here before the copy engines overwrite peers' a_full, so no
// peer still reads it or has yet to reset its counters (as the push kernel's opening barrier).
// overlap=False: every rank meets here again after its push, so every shard has landed everywhere.
extern "C" __global__ void cw_ag_barrier(ncclDevComm dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

// Blocks its stream until flags[index] >= target; kernels queued after it see the chunk's data.
extern "C" __global__ void cw_ag_wait(unsigned long long* flags, long long index, unsigned long long target) {
  cw_flag flag(flags[index]);
  while (flag.load(cuda::memory_order_acquire) < target) {
  }
}
"""


def available(ctx):
    if not ctx.is_cuda:
        return "the seed pushes A over NVLink with NCCL's device API and needs CUDA GPUs"
    return None


def chunk_begin(rows, chunks, c):
    """First row of chunk c (the same formula as cw_chunk_begin in the kernel)."""
    return rows * c // chunks


def setup(ctx, shape):
    world, rank = ctx.world_size, ctx.rank
    m, k = shape["M"], shape["K"]
    chunks, ctas = CONFIG["chunks"], CONFIG["comm_ctas"]
    if CONFIG["wait"] not in ("kernel", "stream"):
        raise ValueError(f"CONFIG['wait'] must be 'kernel' or 'stream', not {CONFIG['wait']!r}")
    if CONFIG["order"] not in ("staggered", "broadcast"):
        raise ValueError(f"CONFIG['order'] must be 'staggered' or 'broadcast', not {CONFIG['order']!r}")
    if CONFIG["backend"] not in ("lsa", "ce"):
        raise ValueError(f"CONFIG['backend'] must be 'lsa' or 'ce', not {CONFIG['backend']!r}")
    ce = CONFIG["backend"] == "ce"
    if (ctas != 0) if ce else (ctas < 1):
        raise ValueError(f"CONFIG comm_ctas={ctas}: backend {CONFIG['backend']} needs " + ("0 (copy engines use no SMs)" if ce else "at least 1"))
    if world - 1 > 7:
        raise ValueError(f"the push kernel addresses at most 7 peers, not {world - 1}")
    taco = _taco_setup(ctx, shape, chunks) if CONFIG["compression"] != "none" else None
    a_full = torch.empty((m, k), dtype=torch.bfloat16, device=ctx.device) if taco else ctx.symmetric((m, k), torch.bfloat16)
    flags = ctx.symmetric((world * chunks,), torch.int64)
    dc = ctx.dev_comm(lsa_barriers=max(ctas, 1))
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    module = ctx.compile(CUDA_SRC, "gemm_allgather_seed")
    peers = [(rank + j) % world for j in range(1, world)]
    return {
        "a_full": a_full, "flags": flags, "dc": dc,
        "a_win": None if taco else ctx.window(a_full), "flag_win": ctx.window(flags),
        "push": module.kernel("cw_ag_push"), "wait": module.kernel("cw_ag_wait"), "barrier": module.kernel("cw_ag_barrier"),
        "stream": ctx.stream("comm", priority=CONFIG["comm_priority"]), "graphs": CallGraphs(MAX_GRAPHS),
        "rows": m // world, "chunks": chunks, "ctas": ctas, "target": 1 if ce or taco else ctas,
        # backend ce: each peer's a_full; ce and compression: its counters, addressed from here
        "peer_a": {p: ctx.peer_tensor(a_full, p) for p in peers} if ce else {},
        "peer_flags": {p: ptr for p, ptr in enumerate(ctx.peer_ptrs(flags)) if p in peers} if ce or taco else {},
        "taco": taco,
    }


def _taco_setup(ctx, shape, chunks):
    """Compression: the quantizer's config, this rank's symmetric wire buffer (one packed message
    per chunk, at a fixed stride) and every peer's, as mapped here."""
    fmt = {"fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}.get(CONFIG["compression"])
    if fmt is None:
        raise ValueError(f"CONFIG['compression'] must be 'none', 'fp8_e4m3' or 'fp8_e5m2', not {CONFIG['compression']!r}")
    if CONFIG["backend"] != "lsa" or not CONFIG["overlap"]:
        raise ValueError("compression pulls each chunk as its flag lands: it needs backend 'lsa' and overlap=True, "
                         f"not backend {CONFIG['backend']!r} with overlap={CONFIG['overlap']}")
    cfg = QuantConfig(CONFIG["group_size"], fmt)  # raises for a group size TACO does not take
    rows = shape["M"] // ctx.world_size
    stride = cfg.packed_stride(-(-rows // chunks) * shape["K"])  # the largest chunk's message, 16-byte aligned
    wire = ctx.symmetric((chunks * stride,), torch.uint8, zero=False)
    peers = [p for p in range(ctx.world_size) if p != ctx.rank]
    return {"cfg": cfg, "wire": wire, "stride": stride, "peer_wire": {p: ctx.peer_tensor(wire, p) for p in peers},
            "pull": ctx.stream("pull", priority=CONFIG["comm_priority"]),
            "pulled": {(p, c): torch.cuda.Event() for p in peers for c in range(chunks)}}


def run(ctx, state, inputs, out):
    if CONFIG["graph"]:
        state["graphs"](lambda: _call(ctx, state, inputs, out), [*inputs.values(), out])
    else:
        _call(ctx, state, inputs, out)


def _call(ctx, state, inputs, out):
    a = inputs["a"]
    if not a.is_contiguous():
        raise ValueError("the push kernel copies A's shard as one contiguous block")
    row_bytes = a.shape[1] * a.element_size()
    main, comm = torch.cuda.current_stream(ctx.device), state["stream"]

    comm.wait_stream(main)  # this rank's previous GEMMs and counter reset are done
    if state["taco"] is not None:
        _compress_and_signal(ctx, state, a, comm)
        _pull_all(ctx, state, main)
    elif CONFIG["backend"] == "ce":
        _copy_engine_push(ctx, state, a, comm)
    else:
        state["push"].launch(state["ctas"], CONFIG["threads"], [
            a, state["a_win"], state["a_win"].offset, state["flag_win"], state["flag_win"].offset,
            state["rows"], row_bytes, state["chunks"], int(CONFIG["order"] == "staggered"), state["dc"],
        ], stream=comm)

    if not CONFIG["overlap"]:  # deferred: every rank's push done and visible (acq_rel), then the GEMMs
        state["barrier"].launch(1, 32, [state["dc"]], stream=comm)
        main.wait_stream(comm)
    if CONFIG["carveout"] and CONFIG["overlap"]:  # (deferred: the push is over, the GEMMs may take every SM)
        # Process-wide torch state: set only while this call's GEMMs are queued, then restored.
        saved = torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()
        torch._C._set_sm_carveout_experimental(state["ctas"])
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            _gemms(ctx, state, inputs, out, main)
        finally:
            torch._C._set_sm_carveout_experimental(saved[0])
            torch.backends.cuda.preferred_blas_library(saved[1])
    else:
        _gemms(ctx, state, inputs, out, main)
    state["flags"].zero_()  # every piece was waited for above (or the closing barrier passed); see the module docstring
    main.wait_stream(comm)
    if state["taco"] is not None:
        main.wait_stream(state["taco"]["pull"])


def _copy_engine_push(ctx, state, a, comm):
    """Backend ce: barrier, then per piece a copy-engine copy into the peer and a flag write."""
    world, rank, rows, chunks = ctx.world_size, ctx.rank, state["rows"], state["chunks"]
    state["barrier"].launch(1, 32, [state["dc"]], stream=comm)
    with torch.cuda.stream(comm):
        for j, c in _pieces(world, chunks):  # the receivers' arrival order
            peer = (rank + j) % world
            r0, r1 = chunk_begin(rows, chunks, c), chunk_begin(rows, chunks, c + 1)
            if r1 > r0:
                state["peer_a"][peer][rank * rows + r0:rank * rows + r1].copy_(a[r0:r1])
            stream_write(state["peer_flags"][peer] + 8 * (rank * chunks + c), 1, comm)


def _compress_and_signal(ctx, state, a, comm):
    """Compression: barrier, then per chunk TACO-compress it into this rank's window and tell every
    peer (a stream write after the kernel: its bytes are visible first)."""
    world, rank, rows, chunks, taco = ctx.world_size, ctx.rank, state["rows"], state["chunks"], state["taco"]
    state["barrier"].launch(1, 32, [state["dc"]], stream=comm)  # nobody still reads the previous call's wire
    with torch.cuda.stream(comm):
        for c in range(chunks):
            r0, r1 = chunk_begin(rows, chunks, c), chunk_begin(rows, chunks, c + 1)
            if r1 > r0:
                lo = c * taco["stride"]
                wire = taco["cfg"].wire_bytes((r1 - r0) * a.shape[1])
                taco_cuda.compress_into(a[r0:r1], taco["cfg"], taco["wire"][lo:lo + wire])
            for j in range(1, world):
                stream_write(state["peer_flags"][(rank + j) % world] + 8 * (rank * chunks + c), 1, comm)


def _pieces(world, chunks):
    """Remote (peer offset j, chunk c) in arrival order: staggered sends shards in turn from
    rank - 1, rank - 2, ...; broadcast sends chunk c of every shard before chunk c + 1."""
    if CONFIG["order"] == "staggered":
        return [(j, c) for j in range(1, world) for c in range(chunks)]
    return [(j, c) for c in range(chunks) for j in range(1, world)]


def _wait_flag(state, src, c, stream):
    """`stream` waits until source `src`'s chunk c has landed (its counter reached the target)."""
    chunks = state["chunks"]
    if CONFIG["wait"] == "stream":
        stream_wait_geq(state["flags"][src * chunks + c].data_ptr(), state["target"], stream)
    else:
        state["wait"].launch(1, 1, [state["flags"], src * chunks + c, state["target"]], stream=stream)


def _pull_all(ctx, state, main):
    """Compression: on the pull stream, each remote chunk in arrival order, pulled and decompressed
    as its flag lands; its event tells the GEMMs."""
    world, rank, rows, chunks, taco = ctx.world_size, ctx.rank, state["rows"], state["chunks"], state["taco"]
    pull = taco["pull"]
    pull.wait_stream(main)  # the previous call's GEMMs no longer read a_full
    with torch.cuda.stream(pull):
        for j, c in _pieces(world, chunks):
            r0, r1 = chunk_begin(rows, chunks, c), chunk_begin(rows, chunks, c + 1)
            src = (rank - j) % world
            if r1 > r0:
                _wait_flag(state, src, c, pull)
                _pull(state, src, c, r0, r1, slice(src * rows + r0, src * rows + r1))
            taco["pulled"][(src, c)].record(pull)


def _pull(state, src, c, r0, r1, part):
    """Compression: source `src`'s chunk c, read from its window and decompressed into a_full."""
    taco, k = state["taco"], state["a_full"].shape[1]
    lo = c * taco["stride"]
    message = packed_view(taco["peer_wire"][src][lo:lo + taco["cfg"].wire_bytes((r1 - r0) * k)], (r1 - r0, k),
                          torch.bfloat16, taco["cfg"])
    taco_cuda.gather_into([message], state["a_full"][part])


def _gemms(ctx, state, inputs, out, main):
    """Local shard first, then each remote piece as its flag arrives (deferred: all at once)."""
    a, b = inputs["a"], inputs["b"]
    world, rank, rows, chunks = ctx.world_size, ctx.rank, state["rows"], state["chunks"]
    own = slice(rank * rows, (rank + 1) * rows)
    torch.matmul(a, b, out=out[own])
    for j, c in _pieces(world, chunks):
        r0, r1 = chunk_begin(rows, chunks, c), chunk_begin(rows, chunks, c + 1)
        if r0 == r1:
            continue
        src = (rank - j) % world
        if state["taco"] is not None:
            main.wait_event(state["taco"]["pulled"][(src, c)])  # pulled and decompressed on the pull stream
        elif CONFIG["overlap"]:  # (deferred: the closing barrier covered every piece)
            _wait_flag(state, src, c, main)
        part = slice(src * rows + r0, src * rows + r1)
        torch.matmul(state["a_full"][part], b, out=out[part])
# EVOLVE-BLOCK-END
