"""Device-initiated seed: the source's kernel writes each layer's KV pages into its own cache and
stores them straight into the decode GPU's cache `out` over NVLink (LSA), layer by layer.

`out` is a symmetric tensor (the workload sets `symmetric_output`, so the harness allocates every
rank's cache with `ctx.symmetric`, collectively, at the same offset of the same window): the
source reaches the destination's pages through `ctx.window(out)` and `ncclGetLsaPointer`. There is
no landing buffer and no copy on the destination (they would double the local HBM traffic there).

Source (even rank). Transfer-only shapes (P = 0): one `kv_push` launch over all layers (nothing to
overlap with, so one launch and no per-launch tail). With the stand-in prefill (P > 0): per group
of `layers_per_launch` layers, that group's GEMMs on the current stream, then `kv_push` on a
high-priority side stream, so layer l's transfer overlaps layer l + 1's prefill. In a launch the
pages (layer, K/V, block i) of its layers are dealt to CTAs in one flat order (no restart per
layer, so CTAs stay balanced); a CTA copies `pps` pages per step, one per group of its threads
(`kv_plan`: as many pages as threads x unroll 16-byte vectors cover). A page's 16 new tokens of
kv[layer, K/V] (zeros past S) go to this rank's page src_blocks[i] (vLLM's reshape_and_cache,
fused) and to the destination's page dst_blocks[i]. When a CTA moves past a layer, it adds 1
(release, system scope, after `__syncthreads`) to the destination's flags[layer].

Destination (odd rank): one small `kv_land` kernel per call on its current stream: the LSA barrier,
then one thread waits (acquire) until every flags[layer] reaches `ctas` and sets them back to 0.

Pull mode (`prefill_mode="pull"`, P > 0 only, the default there). Pushing takes `prefill_ctas`
SMs from the prefill's GEMMs for as long as the NVLink stores take (NOTES.md has the cost). In pull mode the source's `kv_push` only writes its own cache (the
write a prefill does anyway: on the current stream between the GEMMs, with `ctas` CTAs, a few µs
of HBM time a layer) and releases the layer; the destination,
whose SMs are idle, runs one `kv_pull` over all layers with `pull_ctas` CTAs: per layer, wait for
the counter, then copy the layer's pages from the source's cache (through `out`'s window, the
source's own `out`) into its own. The source's GEMMs lose only the cache write's SM time.

Why this is safe (push; pull below):
- Nobody stores into the destination's `out` too early. The first push launch of a call opens with
  an LSA barrier (every rank, CTA b with CTA b); a source CTA stores nothing before its barrier
  completes, and the destination enters it only from `kv_land`, which its stream runs after
  everything queued before this call: the harness's poison of `out` and whatever read the previous
  call's result (judging, readiness checks). Those writes happen-before the barrier's release, so
  none of them can land after (and clobber) a page of this call.
- The source's own cache: its side stream waits for the current stream before the first push.
- Flags: in one call every layer's counter gets exactly `ctas` increments (each CTA of the launch
  covering that layer signals it once, even with no page in it), so the target is the constant
  `ctas`, and `kv_land` resets the counters once it has seen them all. No signal of the next call
  can race that reset: the next call's pushes start after the next barrier, which the destination
  enters only after this `kv_land` finished (stream order). A constant target is what lets a call
  be replayed as a CUDA graph.
- Visibility: a CTA's stores of a layer are ordered before its release by `__syncthreads` (bar.sync
  is cumulative, NCCL's barrier relies on the same); the waiter's acquire, then the kernel
  boundary, make every page visible to what the destination's stream runs next.

Pull: the source writes its pages only after its first `kv_push` passed the barrier, which the
destination enters only from this call's `kv_pull`, after the previous call's `kv_pull` (all its
reads of the source's cache) and everything queued before this call on its stream finished; the
destination writes only its own pages, after its poison in stream order. Counters get exactly
`prefill_ctas` increments per layer and call; the last `kv_pull` CTA to finish resets them (and its
`done` counter) when every CTA has passed every wait; the next call's increments come after the
next barrier, so they cannot race the reset.

A transfer-only call is replayed as a CUDA graph (`graph`), captured per input/output addresses:
one launch instead of a few Python-issued ones. Calls with the stand-in prefill run eagerly: its
cuBLAS GEMMs ran slower inside a captured graph (NOTES.md).
"""

import torch

from commweave.runtime.graphs import CallGraphs

# EVOLVE-BLOCK-START
CONFIG = dict(
    ctas=132,  # source CTAs with every SM free: transfer only (P = 0; sweep on 2 GPUs: 132 > 64 by 3-4 %), pull mode's cache write
    prefill_ctas=16,  # push mode, P > 0: push CTAs beside the stand-in prefill (SMs taken from its GEMMs)
    threads=512,  # threads per push CTA (compiled in as the kernel's launch bound)
    unroll=4,  # 16-byte vectors a thread loads before it stores them (in flight: ctas x threads x unroll x 16 B)
    layers_per_launch=1,  # P > 0: layers per push launch (1: each layer right after its prefill); P = 0: all
    comm_priority=-1,  # stream priority of the push (negative: scheduled ahead of the prefill's GEMMs)
    prefill_mode="pull",  # P > 0: "pull" (the destination's CTAs read the pages; the source only writes its own
    #                       cache and signals) or "push" (the source's prefill_ctas also store into the peer's cache)
    pull_ctas=132,  # P > 0, pull: the destination's CTAs that read pages over NVLink (its SMs are otherwise idle)
    graph=True,  # replay each transfer-only call (P = 0) as a CUDA graph, captured per input/output addresses
    #              (calls with the stand-in prefill run eagerly: its GEMMs ran ~4 % slower captured, S2048-P13)
    communicate=True,  # False: the stand-in prefill and its own cache write, no transfer ("prefill_alone"; wrong output)
)
MAX_CTAS = 1024  # one LSA barrier per CTA
LAND_THREADS = 128  # kv_land only meets the barrier and waits
KV_OWN, KV_SIGNAL, KV_PUSH = 0, 1, 2  # kv_push's mode (CUDA_SRC's defines)
MAX_GRAPHS = 32  # captured calls kept per setup (the benchmark rotates a few input sets)

CUDA_SRC = r"""
#include <nccl_device.h>
#include <cuda/atomic>
#include <cstddef>
#include <cstdint>

#ifndef KV_UNROLL
#define KV_UNROLL 4  // 16-byte vectors each thread loads before it stores them
#endif
#ifndef KV_MAX_THREADS
#define KV_MAX_THREADS 512  // the push kernel's launch bound (threads per CTA)
#endif

using kv_flag = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

// Page (layer, half, block) of a cache [L, 2, nb_total, 16, KV, D] as a vector index.
__host__ __device__ inline size_t kv_page(int layer, int half, long long block, long long nb_total,
                                          long long page_units) {
  return ((size_t)(layer * 2 + half) * (size_t)nb_total + (size_t)block) * (size_t)page_units;
}

// How a launch deals its pages: `pages` in flat order (layer-major, then K/V, then block), 2 * nb a
// layer; a CTA copies `pps` consecutive pages per step, `group` threads on each.
struct KvPlan {
  long long per_layer;
  long long pages;
  int pps;
  int group;
};

// pps: the largest power of two such that pps pages still fill nthreads x unroll vectors and each
// page keeps at least a warp (so a 1024-thread CTA copies two 2048-vector pages at once instead
// of leaving half its vector slots empty).
__host__ __device__ inline KvPlan kv_plan(long long nb, int l0, int l1, long long page_units, int nthreads,
                                          int unroll) {
  KvPlan plan;
  plan.per_layer = 2 * nb;
  plan.pages = (long long)(l1 - l0) * plan.per_layer;
  int pps = 1;
  while (pps * 2 <= nthreads / 32 && (long long)(pps * 2) * page_units <= (long long)nthreads * unroll) pps *= 2;
  plan.pps = pps;
  plan.group = nthreads / pps;
  return plan;
}

// CTA `cta` of `ctas` in a launch over layers [l0, l1): copy(q0) copies the step's pages q0 .. q0 +
// pps - 1 (those < pages); signal(from, to) releases layers [from, to), called once the CTA has
// moved past them (pages are visited in increasing order, so all of its pages of those layers are
// done) and at the end for the rest: every layer of the launch exactly once.
#pragma nv_exec_check_disable
template <typename Copy, typename Signal>
__host__ __device__ __forceinline__ void kv_cta_loop(const KvPlan plan, long long cta, long long ctas, int l0, int l1,
                                                     Copy copy, Signal signal) {
  int signalled = l0;
  for (long long q0 = cta * plan.pps; q0 < plan.pages; q0 += ctas * plan.pps) {
    const int first = l0 + (int)(q0 / plan.per_layer);
    if (first > signalled) {
      signal(signalled, first);
      signalled = first;
    }
    copy(q0);
  }
  signal(signalled, l1);
}

// Page p (half = p / nb, block i = p % nb) of one layer, the share of thread tid of nthreads: the
// 16 tokens [16i, 16i + 16) of kv[layer, half] (zeros past `tokens`) to this rank's cache page
// src_blocks[i] and to page dst_blocks[i] of `theirs` (the peer's cache through its window, or any
// buffer of the same layout; nullptr: this rank's page only). Each pass loads KV_UNROLL vectors
// before storing them.
__host__ __device__ __forceinline__ void kv_push_page(const uint4* __restrict__ kv, uint4* cache, uint4* theirs,
                                                      const long long* src_blocks, const long long* dst_blocks,
                                                      long long nb, long long total, long long tokens,
                                                      int token_units, int layer, long long p, int tid, int nthreads) {
  // Offsets inside a page fit an int (a page is 16 tokens of KV x D bf16).
  const int page_units = 16 * token_units;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const int half = (int)(p / nb);
  const long long i = p % nb;
  const int valid = (int)(tokens - 16 * i < 16 ? tokens - 16 * i : 16) * token_units;
  const uint4* from = kv + ((size_t)(layer * 2 + half) * (size_t)tokens + 16 * (size_t)i) * (size_t)token_units;
  uint4* mine = cache + kv_page(layer, half, src_blocks[i], total, page_units);
  uint4* peer = theirs ? theirs + kv_page(layer, half, dst_blocks[i], total, page_units) : nullptr;
  for (int base = tid; base < page_units; base += KV_UNROLL * nthreads) {
    uint4 v[KV_UNROLL];
#pragma unroll
    for (int k = 0; k < KV_UNROLL; k++) {
      const int w = base + k * nthreads;
      v[k] = w < valid ? from[w] : zero;
    }
#pragma unroll
    for (int k = 0; k < KV_UNROLL; k++) {
      const int w = base + k * nthreads;
      if (w < page_units) {
        if (peer) peer[w] = v[k];  // NVLink first: the remote stores are the long pole
        mine[w] = v[k];
      }
    }
  }
}

// All ranks: CTA b meets CTA b of every rank (ranks line up between calls).
__device__ inline void kv_barrier(ncclDevComm& dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

// What kv_push does besides writing this rank's cache pages.
#define KV_OWN 0     // nothing (the prefill_alone yardstick: the cache write a prefill does anyway)
#define KV_SIGNAL 1  // release each layer to the peer, which pulls the pages (kv_pull)
#define KV_PUSH 2    // store each page into the peer's cache too, then release the layer

// Source. kv: [L, 2, tokens, KV, D] (token_units 16-byte vectors per token); cache: this rank's
// [L, 2, total, 16, KV, D]; the peer's cache (same layout) is out_win at out_offset. Layers
// [l0, l1); unless mode is KV_OWN, each CTA adds 1 to the peer's flags[layer] once per layer of
// the launch.
extern "C" __global__ void __launch_bounds__(KV_MAX_THREADS)
kv_push(const uint4* __restrict__ kv, uint4* cache, const long long* src_blocks, const long long* dst_blocks,
        long long nb, long long total, long long tokens, int token_units, int l0, int l1, int peer,
        ncclWindow_t out_win, size_t out_offset, ncclWindow_t flag_win, size_t flag_offset, int open_barrier,
        int mode, ncclDevComm dc) {
  if (open_barrier) kv_barrier(dc);
  uint4* theirs = mode == KV_PUSH ? (uint4*)ncclGetLsaPointer(out_win, out_offset, peer) : nullptr;
  unsigned long long* flags = (unsigned long long*)ncclGetLsaPointer(flag_win, flag_offset, peer);
  const KvPlan plan = kv_plan(nb, l0, l1, 16 * token_units, (int)blockDim.x, KV_UNROLL);
  const int j = (int)threadIdx.x / plan.group, lane = (int)threadIdx.x % plan.group;
  kv_cta_loop(
      plan, blockIdx.x, gridDim.x, l0, l1,
      [=](long long q0) {
        const long long q = q0 + j;
        if (q < plan.pages) {
          kv_push_page(kv, cache, theirs, src_blocks, dst_blocks, nb, total, tokens, token_units,
                       l0 + (int)(q / plan.per_layer), q % plan.per_layer, lane, plan.group);
        }
      },
      [=](int from, int to) {
        __syncthreads();  // the whole CTA's stores of these layers before the release
        if (threadIdx.x == 0 && mode != KV_OWN) {
          // one system-scope release fence, then relaxed increments: a release on each increment
          // would fence once per layer (up to L fences a CTA at the end of a launch)
          cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_system);
          for (int layer = from; layer < to; layer++) kv_flag(flags[layer]).fetch_add(1ull, cuda::memory_order_relaxed);
        }
      });
}

// Destination: meet the sources' opening barrier (so they may overwrite `out`), then one thread
// waits until every layer's counter reaches target (= push CTAs) and resets them for the next call.
extern "C" __global__ void kv_land(unsigned long long* flags, int layers, unsigned long long target, ncclDevComm dc) {
  kv_barrier(dc);
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (int layer = 0; layer < layers; layer++) {
    kv_flag flag(flags[layer]);
    while (flag.load(cuda::memory_order_acquire) < target) {
    }
  }
  for (int layer = 0; layer < layers; layer++) kv_flag(flags[layer]).store(0ull, cuda::memory_order_relaxed);
}

// Page p (half = p / nb, block i = p % nb) of one layer, the share of thread tid of nthreads: the
// source's page src_blocks[i] (`theirs`: its cache through its window) to this rank's page
// dst_blocks[i], as it is (zeros past S included).
__host__ __device__ __forceinline__ void kv_pull_page(const uint4* theirs, uint4* cache, const long long* src_blocks,
                                                      const long long* dst_blocks, long long nb, long long total,
                                                      int page_units, int layer, long long p, int tid, int nthreads) {
  const int half = (int)(p / nb);
  const long long i = p % nb;
  const uint4* from = theirs + kv_page(layer, half, src_blocks[i], total, page_units);
  uint4* to = cache + kv_page(layer, half, dst_blocks[i], total, page_units);
  for (int base = tid; base < page_units; base += KV_UNROLL * nthreads) {
    uint4 v[KV_UNROLL];
#pragma unroll
    for (int k = 0; k < KV_UNROLL; k++) {
      const int w = base + k * nthreads;
      if (w < page_units) v[k] = from[w];
    }
#pragma unroll
    for (int k = 0; k < KV_UNROLL; k++) {
      const int w = base + k * nthreads;
      if (w < page_units) to[w] = v[k];
    }
  }
}

// Destination, pull mode: meet the source's opening barrier (indices 0 .. barriers - 1, as many as
// the source has CTAs), then layer by layer: one thread per CTA waits (acquire) until the layer's
// counter reaches target (every source CTA has written its pages of it and released them), then
// the CTAs copy the layer's pages from the source's cache into this rank's. The last CTA to finish
// resets the counters (and `done`) for the next call: every CTA has passed every wait by then.
extern "C" __global__ void __launch_bounds__(KV_MAX_THREADS)
kv_pull(uint4* cache, const long long* src_blocks, const long long* dst_blocks, long long nb, long long total,
        int token_units, int layers, int peer, ncclWindow_t out_win, size_t out_offset, unsigned long long* flags,
        unsigned long long target, unsigned int* done, int barriers, ncclDevComm dc) {
  for (int b = blockIdx.x; b < barriers; b += gridDim.x) {
    ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, (uint32_t)b};
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  }
  const uint4* theirs = (const uint4*)ncclGetLsaPointer(out_win, out_offset, peer);
  const int page_units = 16 * token_units;
  for (int layer = 0; layer < layers; layer++) {
    if (threadIdx.x == 0) {
      kv_flag flag(flags[layer]);
      while (flag.load(cuda::memory_order_acquire) < target) {
      }
    }
    __syncthreads();  // the acquire, then the CTA's loads of the layer's pages
    const KvPlan plan = kv_plan(nb, layer, layer + 1, page_units, (int)blockDim.x, KV_UNROLL);
    const int j = (int)threadIdx.x / plan.group, lane = (int)threadIdx.x % plan.group;
    for (long long q0 = (long long)blockIdx.x * plan.pps; q0 < plan.pages; q0 += (long long)gridDim.x * plan.pps) {
      if (q0 + j < plan.pages) kv_pull_page(theirs, cache, src_blocks, dst_blocks, nb, total, page_units, layer, q0 + j, lane, plan.group);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    cuda::atomic_ref<unsigned int, cuda::thread_scope_device> finished(*done);
    if (finished.fetch_add(1u, cuda::memory_order_acq_rel) == gridDim.x - 1) {
      for (int layer = 0; layer < layers; layer++) kv_flag(flags[layer]).store(0ull, cuda::memory_order_relaxed);
      finished.store(0u, cuda::memory_order_relaxed);
    }
  }
}
"""


def cuda_source():
    """CUDA_SRC with CONFIG's compile-time knobs (unroll, the threads launch bound) defined."""
    return f"#define KV_UNROLL {CONFIG['unroll']}\n#define KV_MAX_THREADS {CONFIG['threads']}\n" + CUDA_SRC


def push_ctas(shape):
    """The source's CTAs for `shape`: all SMs when nothing runs beside them (transfer only, or pull
    mode's cache write, queued between the prefill's GEMMs), few when they push beside the GEMMs."""
    return CONFIG["prefill_ctas"] if shape["P"] and CONFIG["prefill_mode"] == "push" else CONFIG["ctas"]


def available(ctx):
    if not ctx.is_cuda:
        return "the seed stores KV pages over NVLink with NCCL's device API and needs CUDA GPUs"
    return None


def _check_config(shape):
    threads, unroll, per_launch, ctas = CONFIG["threads"], CONFIG["unroll"], CONFIG["layers_per_launch"], push_ctas(shape)
    if not (isinstance(threads, int) and 32 <= threads <= 1024 and threads % 32 == 0):
        raise ValueError(f"CONFIG['threads'] must be a multiple of 32 in [32, 1024], not {threads!r}")
    if not (isinstance(unroll, int) and 1 <= unroll <= 16):
        raise ValueError(f"CONFIG['unroll'] must be an int in [1, 16], not {unroll!r}")
    if not (isinstance(per_launch, int) and per_launch >= 1):
        raise ValueError(f"CONFIG['layers_per_launch'] must be an int >= 1, not {per_launch!r}")
    which = "prefill_ctas" if shape["P"] and CONFIG["prefill_mode"] == "push" else "ctas"
    if not (isinstance(ctas, int) and 1 <= ctas <= MAX_CTAS):
        raise ValueError(f"CONFIG[{which!r}] must be an int in [1, {MAX_CTAS}], not {ctas!r}")
    if CONFIG["prefill_mode"] not in ("pull", "push"):
        raise ValueError(f"CONFIG['prefill_mode'] must be 'pull' or 'push', not {CONFIG['prefill_mode']!r}")
    pull = CONFIG["pull_ctas"]
    if not (isinstance(pull, int) and 1 <= pull <= MAX_CTAS):
        raise ValueError(f"CONFIG['pull_ctas'] must be an int in [1, {MAX_CTAS}], not {pull!r}")


def pulls(shape):
    """Whether the destination pulls the pages: with the stand-in prefill, in pull mode."""
    return bool(shape["P"]) and CONFIG["prefill_mode"] == "pull"


def setup(ctx, shape):
    world, rank = ctx.world_size, ctx.rank
    if world % 2:
        raise ValueError(f"ranks pair up as prefill -> decode; {world} ranks do not")
    _check_config(shape)
    ctas = push_ctas(shape)
    flags = ctx.symmetric((shape["L"],), torch.int64)  # zeroed, ranks lined up: counters start at 0
    dc = ctx.dev_comm(lsa_barriers=ctas)
    if dc.lsa_size != world or dc.lsa_rank != rank:
        raise RuntimeError(f"all {world} ranks must share one NVLink (LSA) domain; lsa size {dc.lsa_size}, lsa rank {dc.lsa_rank}")
    module = ctx.compile(cuda_source(), "kv_transfer_seed")
    token_bytes = shape["KV"] * shape["D"] * 2
    return {
        "is_src": rank % 2 == 0, "peer": rank ^ 1, "flags": flags, "flag_win": ctx.window(flags), "dc": dc,
        "push": module.kernel("kv_push"), "land": module.kernel("kv_land"), "pull": module.kernel("kv_pull"),
        "ctas": ctas, "pulls": pulls(shape), "done": torch.zeros(1, dtype=torch.int32, device=ctx.device),
        "stream": ctx.stream("kv_push", priority=CONFIG["comm_priority"]), "graphs": CallGraphs(MAX_GRAPHS),
        "token_units": token_bytes // 16, "passes": shape["P"],
        "scratch": torch.empty(shape["S"], 4096, dtype=torch.bfloat16, device=ctx.device) if shape["P"] and rank % 2 == 0 else None,
    }


def out_window(ctx, out):
    """`out`'s window: the seed stores pages into the destination's `out` through it."""
    if not out.is_contiguous() or out.dtype != torch.bfloat16:
        raise ValueError(f"the cache must be a contiguous bf16 tensor, got {out.dtype} with strides {out.stride()}")
    try:
        win = ctx.window(out)
    except ValueError as exc:
        raise ValueError("the seed stores KV pages straight into the destination's cache through its symmetric window, "
                         "so `out` must be allocated with ctx.symmetric() on every rank in the same order (the harness "
                         "does this for workloads with symmetric_output = True)") from exc
    if win.offset % 16:
        raise ValueError(f"the cache must be 16-byte aligned in its window (offset {win.offset})")
    return win


def run(ctx, state, inputs, out):
    # Checked on every rank before anything is queued, so a bad call fails everywhere instead of
    # leaving a peer waiting in the barrier.
    win = out_window(ctx, out)
    if out.shape[0] != state["flags"].numel():
        raise ValueError(f"the cache has {out.shape[0]} layers, but setup() was for {state['flags'].numel()}")
    if state["is_src"]:
        kv = inputs["kv"]
        if not kv.is_contiguous() or kv.data_ptr() % 16:
            raise ValueError("the new K/V must be contiguous and 16-byte aligned")
        if kv.shape[0] != out.shape[0] or kv.shape[3:] != out.shape[4:]:
            raise ValueError(f"kv {tuple(kv.shape)} does not match the cache {tuple(out.shape)} (layers, KV heads, head dim)")
    if CONFIG["graph"] and not state["passes"] and (CONFIG["communicate"] or state["is_src"]):  # (idle decode side: empty)
        state["graphs"](lambda: _call(ctx, state, inputs, out, win), [*inputs.values(), out])
    else:
        _call(ctx, state, inputs, out, win)


def _call(ctx, state, inputs, out, win):
    main = torch.cuda.current_stream(ctx.device)
    layers, ctas = out.shape[0], state["ctas"]
    src_blocks, dst_blocks = inputs["src_blocks"], inputs["dst_blocks"]
    nb, total = dst_blocks.numel(), out.shape[2]
    if not state["is_src"]:
        if not CONFIG["communicate"]:
            return
        if state["pulls"]:
            state["pull"].launch(CONFIG["pull_ctas"], CONFIG["threads"], [
                out, src_blocks, dst_blocks, nb, total, state["token_units"], layers, state["peer"], win, win.offset,
                state["flags"], ctas, state["done"], ctas, state["dc"]], stream=main)
        else:
            state["land"].launch(ctas, LAND_THREADS, [state["flags"], layers, ctas, state["dc"]], stream=main)
        return
    kv = inputs["kv"]
    # pull: the cache write takes every SM for a few µs between GEMMs (beside them, its CTAs would
    # hold SMs the GEMMs' waves need); push: the stores run beside the next layer's GEMMs
    comm = main if state["pulls"] else state["stream"]
    mode = KV_OWN if not CONFIG["communicate"] else KV_SIGNAL if state["pulls"] else KV_PUSH
    per_launch = CONFIG["layers_per_launch"] if state["passes"] else layers
    comm.wait_stream(main)  # this rank's earlier work on `out` is done
    for l0 in range(0, layers, per_launch):
        l1 = min(layers, l0 + per_launch)
        if state["passes"]:
            for _ in range(state["passes"] * (l1 - l0)):  # the stand-in prefill of layers [l0, l1)
                torch.matmul(inputs["x"], inputs["w"], out=state["scratch"])
            comm.wait_stream(main)
        state["push"].launch(ctas, CONFIG["threads"], [
            kv, out, src_blocks, dst_blocks, nb, total, kv.shape[2], state["token_units"], l0, l1,
            state["peer"], win, win.offset, state["flag_win"], state["flag_win"].offset,
            int(l0 == 0 and mode != KV_OWN), mode, state["dc"],
        ], stream=comm)
    main.wait_stream(comm)
# EVOLVE-BLOCK-END
