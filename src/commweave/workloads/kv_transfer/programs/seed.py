"""Device-initiated seed: the source's kernel writes each layer's KV pages into its own cache and
stores them straight into the decode GPU's symmetric window over NVLink (LSA), layer by layer.

Source (even rank): for each group of `layers_per_launch` layers, after that group's stand-in
prefill GEMMs on the current stream, `kv_push` runs on a high-priority side stream: every CTA takes
pages (layer, K/V, block i) in turn, loads the 16 new tokens of kv[layer, K/V] (16-byte vectors,
zeros past S), stores them to its cache page src_blocks[i] (vLLM's reshape_and_cache, fused) and
to page dst_blocks[i] of the destination's symmetric `land` cache (`ncclGetLsaPointer`), then
after each layer adds 1 (release, system scope) to the destination's flags[layer]. So the transfer
of layer l overlaps the prefill of layer l + 1, and no gather, staging buffer or host copy sits
between source pages and destination pages.

Destination (odd rank): one persistent `kv_land` kernel per call; for each layer its CTAs wait
until flags[layer] reaches this call's target (push CTAs x call number; flags only grow, so
nothing is reset) and copy that layer's pages from `land` into `out`. That copy exists only
because the harness's output is not in a symmetric window (NOTES.md: the proposed
`symmetric_output` hook lets `kv_push` store into `out` directly); it is local HBM traffic that
overlaps the next layers' arrival.

Reuse: the first push of a call and the destination's kernel open with an LSA barrier (every rank,
CTA b with CTA b), which no rank reaches before its previous call is finished, so `land` is never
overwritten while the destination still reads it. All ranks launch `ctas` CTAs per barrier.
"""

import torch

# EVOLVE-BLOCK-START
CONFIG = dict(
    ctas=16,  # CTAs of the push kernel (and of the destination's landing kernel)
    threads=512,  # threads per CTA
    layers_per_launch=1,  # layers per push launch: 1 = layer by layer; more = fewer launches, less overlap
    comm_priority=-1,  # stream priority of the push (negative: scheduled ahead of the prefill's GEMMs)
)

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cstddef>
#include <cstdint>

#define KV_UNROLL 4  // 16-byte vectors each thread loads before it stores them

using kv_flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

// Page (layer, half, block) of a cache [L, 2, nb_total, 16, KV, D] as a vector index.
__host__ __device__ inline size_t kv_page(int layer, int half, long long block, long long nb_total,
                                          long long page_units) {
  return ((size_t)(layer * 2 + half) * (size_t)nb_total + (size_t)block) * (size_t)page_units;
}

// Page p (half = p / nb, block i = p % nb) of one layer, the share of thread tid of nthreads: the
// 16 tokens [16i, 16i + 16) of kv[layer, half] (zeros past `tokens`) to this rank's cache page
// src_blocks[i] and to the landing page dst_blocks[i] (`land`: the peer's window, or any buffer).
__host__ __device__ inline void kv_push_page(const uint4* kv, uint4* cache, uint4* land, const long long* src_blocks,
                                             const long long* dst_blocks, long long nb, long long src_total,
                                             long long dst_total, long long tokens, long long token_units, int layer,
                                             long long p, long long tid, long long nthreads) {
  const long long page_units = 16 * token_units;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const int half = (int)(p / nb);
  const long long i = p % nb;
  const long long valid = (tokens - 16 * i < 16 ? tokens - 16 * i : 16) * token_units;
  const uint4* from = kv + ((size_t)(layer * 2 + half) * (size_t)tokens + 16 * (size_t)i) * token_units;
  uint4* mine = cache + kv_page(layer, half, src_blocks[i], src_total, page_units);
  uint4* theirs = land + kv_page(layer, half, dst_blocks[i], dst_total, page_units);
  long long u = tid;
  for (; u + (KV_UNROLL - 1) * nthreads < page_units; u += KV_UNROLL * nthreads) {
    uint4 v[KV_UNROLL];
#pragma unroll
    for (int k = 0; k < KV_UNROLL; k++) {
      long long w = u + k * nthreads;
      v[k] = w < valid ? from[w] : zero;
    }
#pragma unroll
    for (int k = 0; k < KV_UNROLL; k++) {
      long long w = u + k * nthreads;
      mine[w] = v[k];
      theirs[w] = v[k];
    }
  }
  for (; u < page_units; u += nthreads) {
    uint4 v = u < valid ? from[u] : zero;
    mine[u] = v;
    theirs[u] = v;
  }
}

// All ranks: CTA b meets CTA b of every rank (ranks line up between calls).
__device__ inline void kv_barrier(ncclDevComm& dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

// Source. kv: [L, 2, tokens, KV, D] (token_units 16-byte vectors per token); cache: this rank's
// [L, 2, src_total, 16, KV, D]; the peer's landing cache [L, 2, dst_total, 16, KV, D] is reached
// through land_win. Layers [l0, l1); each CTA signals flags[layer] on the peer once per layer.
extern "C" __global__ void kv_push(const uint4* kv, uint4* cache, const long long* src_blocks,
                                   const long long* dst_blocks, long long nb, long long src_total,
                                   long long dst_total, long long tokens, long long token_units, int l0,
                                   int l1, int peer, ncclWindow_t land_win, size_t land_offset,
                                   ncclWindow_t flag_win, size_t flag_offset, int open_barrier,
                                   ncclDevComm dc) {
  if (open_barrier) kv_barrier(dc);
  uint4* land = (uint4*)ncclGetLsaPointer(land_win, land_offset, peer);
  for (int layer = l0; layer < l1; layer++) {
    for (long long p = blockIdx.x; p < 2 * nb; p += gridDim.x) {
      kv_push_page(kv, cache, land, src_blocks, dst_blocks, nb, src_total, dst_total, tokens, token_units, layer, p,
                   threadIdx.x, blockDim.x);
    }
    // The whole CTA's stores of this layer before the release (bar.sync is cumulative).
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long* flags = (unsigned long long*)ncclGetLsaPointer(flag_win, flag_offset, peer);
      kv_flag(flags[layer]).fetch_add(1ull, cuda::memory_order_release);
    }
  }
}

// Destination. For each layer: wait until flags[layer] >= target, then copy the layer's pages
// dst_blocks from land into cache (both [L, 2, dst_total, 16, KV, D], local). land is read with
// ld.global.cg (L2): its lines were written by the peer during this kernel.
extern "C" __global__ void kv_land(const uint4* land, uint4* cache, const long long* dst_blocks, long long nb,
                                   long long dst_total, long long page_units, int layers,
                                   unsigned long long* flags, unsigned long long target, ncclDevComm dc) {
  kv_barrier(dc);
  for (int layer = 0; layer < layers; layer++) {
    if (threadIdx.x == 0) {
      kv_flag flag(flags[layer]);
      while (flag.load(cuda::memory_order_acquire) < target) {
      }
    }
    __syncthreads();
    for (long long p = blockIdx.x; p < 2 * nb; p += gridDim.x) {
      const size_t at = kv_page(layer, (int)(p / nb), dst_blocks[p % nb], dst_total, page_units);
      for (long long u = threadIdx.x; u < page_units; u += blockDim.x) cache[at + u] = __ldcg(land + at + u);
    }
  }
}
"""


def available(ctx):
    if not ctx.is_cuda:
        return "the seed stores KV pages over NVLink with NCCL's device API and needs CUDA GPUs"
    return None


def setup(ctx, shape):
    world, rank = ctx.world_size, ctx.rank
    layers, per_launch = shape["L"], CONFIG["layers_per_launch"]
    if not 1 <= per_launch:
        raise ValueError(f"CONFIG['layers_per_launch'] must be >= 1, not {per_launch}")
    if world % 2:
        raise ValueError(f"ranks pair up as prefill -> decode; {world} ranks do not")
    cache = (layers, 2, shape["NB"], 16, shape["KV"], shape["D"])
    # Collective: every rank allocates the same windows (only destinations' `land` is written).
    land = ctx.symmetric(cache, torch.bfloat16, zero=False)
    flags = ctx.symmetric((layers,), torch.int64)
    dc = ctx.dev_comm(lsa_barriers=CONFIG["ctas"])
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    module = ctx.compile(CUDA_SRC, "kv_transfer_seed")
    token_bytes = shape["KV"] * shape["D"] * 2
    return {
        "is_src": rank % 2 == 0, "peer": rank ^ 1, "land": land, "flags": flags, "dc": dc,
        "land_win": ctx.window(land), "flag_win": ctx.window(flags),
        "push": module.kernel("kv_push"), "landing": module.kernel("kv_land"),
        "stream": ctx.stream("kv_push", priority=CONFIG["comm_priority"]),
        "token_units": token_bytes // 16, "passes": shape["P"], "calls": 0,
        "scratch": torch.empty(shape["S"], 4096, dtype=torch.bfloat16, device=ctx.device) if shape["P"] and rank % 2 == 0 else None,
    }


def run(ctx, state, inputs, out):
    state["calls"] += 1
    main = torch.cuda.current_stream(ctx.device)
    src_blocks, dst_blocks = inputs["src_blocks"], inputs["dst_blocks"]
    nb, total, layers = dst_blocks.numel(), out.shape[2], out.shape[0]
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError("the cache must be contiguous and 16-byte aligned")
    if not state["is_src"]:
        state["landing"].launch(CONFIG["ctas"], CONFIG["threads"], [
            state["land"], out, dst_blocks, nb, total, 16 * state["token_units"], layers,
            state["flags"], CONFIG["ctas"] * state["calls"], state["dc"],
        ], stream=main)
        return
    kv = inputs["kv"]
    if not kv.is_contiguous() or kv.data_ptr() % 16:
        raise ValueError("the new K/V must be contiguous and 16-byte aligned")
    comm = state["stream"]
    comm.wait_stream(main)  # this rank's previous call is done with `out`
    per_launch = CONFIG["layers_per_launch"]
    for l0 in range(0, layers, per_launch):
        l1 = min(layers, l0 + per_launch)
        if state["passes"]:
            for _ in range(state["passes"] * (l1 - l0)):  # the stand-in prefill of layers [l0, l1)
                torch.matmul(inputs["x"], inputs["w"], out=state["scratch"])
            comm.wait_stream(main)
        state["push"].launch(CONFIG["ctas"], CONFIG["threads"], [
            kv, out, src_blocks, dst_blocks, nb, total, total, kv.shape[2], state["token_units"], l0, l1,
            state["peer"], state["land_win"], state["land_win"].offset, state["flag_win"],
            state["flag_win"].offset, int(l0 == 0), state["dc"],
        ], stream=comm)
    main.wait_stream(comm)
# EVOLVE-BLOCK-END
