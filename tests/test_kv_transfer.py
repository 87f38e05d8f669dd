"""CPU checks of the kv-transfer workload: shapes, block tables, reference, strict judge, cost,
programs, CUDA sources, and the host baselines run over gloo on CPU workers.

The seed's kernels need GPUs with NCCL's device API; here they are only compiled.
"""

from __future__ import annotations

import re

import pytest
import torch

from cuda_host import nvcc_host_build, run_host_check, toolchain_or_skip
from commweave.contracts.poison import poison_
from commweave.contracts.program import load_program, parse_program, with_config
from commweave.runtime import WorkerPool
from commweave.runtime.compile import compile_cubin
from commweave.workloads.kv_transfer.workload import KvTransfer, pair_of

CPU = torch.device("cpu")
PROGRAMS = ("host", "host_layerwise", "host_per_block", "seed")
HOST_PROGRAMS = ("host", "host_per_block", "host_layerwise")


@pytest.fixture(scope="module")
def wl() -> KvTransfer:
    return KvTransfer()


# -- shapes ---------------------------------------------------------------------------------------
def test_identity(wl: KvTransfer) -> None:
    assert wl.name == "kv-transfer" and wl.world_sizes == (2, 4) and wl.seed == "seed"
    assert wl.baselines == ("host", "host_per_block", "host_layerwise")
    assert wl.program_names() == sorted(PROGRAMS + ("peer_copy",))  # peer_copy: a yardstick only
    assert wl.tolerance() == 0.0


def test_roles() -> None:
    assert [pair_of(r) for r in range(4)] == [(0, 1, True), (0, 1, False), (2, 3, True), (2, 3, False)]


@pytest.mark.parametrize("world", [2, 4])
def test_bench_and_check_shapes(wl: KvTransfer, world: int) -> None:
    bench = wl.bench_shapes(world)
    assert [s.label for s in bench] == ["S2048", "S4096", "S8192", "S16384", "S32768", "S2048-P13", "S8192-P13"]
    big = bench[4]
    assert (big["L"], big["KV"], big["D"], big["B"], big["blocks"], big["NB"]) == (32, 8, 128, 16, 2048, 2048)
    checks = wl.check_shapes(world)
    assert len(checks) >= 2 and any(s["S"] % 16 for s in checks), "one check shape needs a partial last block"
    for s in bench + checks:
        assert wl.parse_shape(s.label, world) == s


def test_parse_shape(wl: KvTransfer) -> None:
    s = wl.parse_shape(" s4096-kv4-P2-F5-L3 ", 4)
    assert s.label == "S4096-KV4-L3-P2-F5"
    assert (s["S"], s["KV"], s["P"], s["F"], s["L"], s["blocks"], s["NB"]) == (4096, 4, 2, 5, 3, 256, 261)
    assert wl.parse_shape("S17", 2)["blocks"] == 2
    bad = {
        "4096": "is not 'S<tokens>",
        "S4096x8": "is not 'S<tokens>",
        "S4096-Q3": "is not 'S<tokens>",
        "S0": "S \\(tokens\\) must be >= 1",
        "S-5": "S \\(tokens\\) must be >= 1",
        "S64-KV0": "KV \\(KV heads\\) must be >= 1",
        "S64-P-1": "P \\(prefill passes\\) must be >= 0",
        "S64-F-2": "F \\(free blocks\\) must be >= 0",
        "S64-L0": "L \\(layers\\) must be >= 1",
        "S64-KV2-KV4": "gives KV twice",
        "S99999999": "more than",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            wl.parse_shape(text, 2)
    with pytest.raises(ValueError, match="runs on 2, 4 GPUs, not 3"):
        wl.parse_shape("S64", 3)


def test_cost(wl: KvTransfer) -> None:
    s = wl.parse_shape("S32768", 2)
    c = wl.cost(s, 2)
    assert c.comm_bytes == 32 * 2 * 2048 * 16 * 8 * 128 * 2 == 4 << 30  # 4 GiB: the whole sequence
    assert c.flops == 0 and c.memory_bytes == 2 * c.comm_bytes
    p = wl.cost(wl.parse_shape("S2048-P13", 2), 2)
    assert p.flops == 2.0 * 13 * 32 * 2048 * 4096 * 4096
    # a partial block moves a whole page
    assert wl.cost(wl.parse_shape("S17-L1-KV1", 2), 2).comm_bytes == 2 * 2 * 16 * 128 * 2


# -- block tables ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["S37-KV2", "S300-F40", "S2048-F7"])
def test_block_tables(wl: KvTransfer, text: str) -> None:
    s = wl.parse_shape(text, 4)
    tables = {}
    for rank in range(4):
        src, dst = wl.block_tables(s, 4, rank, seed=9)
        assert src.dtype == dst.dtype == torch.int64 and src.shape == dst.shape == (s["blocks"],)
        for t in (src, dst):
            assert int(t.min()) >= 0 and int(t.max()) < s["NB"]
            assert t.unique().numel() == t.numel(), "blocks of a table must be distinct"
        tables[rank] = (src, dst)
    for a, b in ((0, 1), (2, 3)):  # both ranks of a pair hold the same tables
        assert all(torch.equal(x, y) for x, y in zip(tables[a], tables[b]))
    # random: pairs, seeds and the two sides differ, and the tables are not the identity
    if s["blocks"] > 8:
        assert not torch.equal(tables[0][0], tables[2][0])
        assert not torch.equal(tables[0][0], tables[0][1])
        assert not torch.equal(tables[0][0], wl.block_tables(s, 4, 0, seed=10)[0])
        assert not torch.equal(tables[0][0].sort().values, tables[0][0])
    if not s["F"]:
        assert torch.equal(tables[0][0].sort().values, torch.arange(s["NB"]))


def test_inputs(wl: KvTransfer) -> None:
    s = wl.parse_shape("S37-KV2-L3-P1", 2)
    src = wl.make_inputs(s, 2, 0, seed=4, device=CPU)
    dst = wl.make_inputs(s, 2, 1, seed=4, device=CPU)
    assert set(src) == {"kv", "src_blocks", "dst_blocks", "x", "w"} and set(dst) == {"src_blocks", "dst_blocks"}
    assert src["kv"].shape == (3, 2, 37, 2, 128) and src["kv"].dtype == torch.bfloat16
    assert src["x"].shape == (37, 4096) and src["w"].shape == (4096, 4096)
    again = wl.make_inputs(s, 2, 0, seed=4, device=CPU)
    assert all(torch.equal(src[k], again[k]) for k in src)
    assert not torch.equal(src["kv"], wl.make_inputs(s, 2, 0, seed=5, device=CPU)["kv"])
    assert not torch.equal(src["kv"], wl.make_inputs(s, 4, 2, seed=4, device=CPU)["kv"])  # the other pair
    out = wl.make_output(s, 2, 1, CPU)
    assert out.shape == (3, 2, 3, 16, 2, 128) and out.dtype == torch.bfloat16


# -- reference ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["S37-KV2-L2", "S48-KV1-L2-F5"])
def test_reference(wl: KvTransfer, text: str) -> None:
    s = wl.parse_shape(text, 4)
    for src_rank in (0, 2):
        kv = wl.make_inputs(s, 4, src_rank, 3, CPU)["kv"]
        src_blocks, dst_blocks = wl.block_tables(s, 4, src_rank, 3)
        src_ref = wl.reference(s, 4, src_rank, 3, CPU)
        dst_ref = wl.reference(s, 4, src_rank + 1, 3, CPU)
        assert src_ref.dtype == torch.float32 and src_ref.shape == wl.cache_shape(s)
        for layer in range(s["L"]):
            for half in range(2):
                for i in range(s["blocks"]):
                    tokens = kv[layer, half, 16 * i:16 * i + 16].float()
                    page = src_ref[layer, half, src_blocks[i]]
                    assert torch.equal(page[:tokens.shape[0]], tokens)
                    assert not page[tokens.shape[0]:].any()  # zeros past S
                    assert torch.equal(dst_ref[layer, half, dst_blocks[i]], page)
        free = torch.ones(s["NB"], dtype=torch.bool)
        free[dst_blocks] = False
        assert not dst_ref[:, :, free].any()
        assert torch.equal(wl.untouched(s, 4, src_rank + 1, 3, CPU)[:, :, free].all(dim=(-3, -2, -1)),
                           torch.ones(s["L"], 2, int(free.sum()), dtype=torch.bool))


def test_judge_strict(wl: KvTransfer) -> None:
    s = wl.parse_shape("S40-KV1-L2-F3", 2)
    want, written = wl.expected(s, 2, 1, 6, CPU)
    out = poison_(wl.make_output(s, 2, 1, CPU))
    out[written] = want[written]
    assert wl.judge_strict(out, s, 2, 1, 6) is None
    _, dst = wl.block_tables(s, 2, 1, 6)
    free = sorted(set(range(s["NB"])) - set(dst.tolist()))
    stray = out.clone()
    stray[1, 0, free[0], 3, 0, 7] = 1.0
    assert "outside the sequence's pages were written" in wl.judge_strict(stray, s, 2, 1, 6)
    missing = out.clone()
    poison_(missing[0, 1, int(dst[1])])
    assert "were not written" in wl.judge_strict(missing, s, 2, 1, 6)
    wrong = out.clone()
    wrong[0, 0, int(dst[0]), 0, 0, 0] += 1.0
    assert "differ from the source's" in wl.judge_strict(wrong, s, 2, 1, 6)
    swapped = out.clone()
    swapped[0, 0, int(dst[0])], swapped[0, 0, int(dst[1])] = out[0, 0, int(dst[1])], out[0, 0, int(dst[0])]
    assert "differ" in wl.judge_strict(swapped, s, 2, 1, 6)


# -- programs -------------------------------------------------------------------------------------
def seed_source(wl: KvTransfer, **config) -> str:
    """The CUDA the seed compiles for CONFIG changed by `config` (its compile-time knobs defined)."""
    return load_program(with_config(wl.program_text("seed"), **config), "seed").cuda_source()


@pytest.mark.parametrize("name", PROGRAMS)
def test_program_parses(wl: KvTransfer, name: str) -> None:
    parsed = parse_program(wl.program_text(name))
    assert {"setup", "run"} <= parsed.functions
    assert bool(parsed.cuda_sources) == (name == "seed")


def test_yardsticks_parse(wl: KvTransfer) -> None:
    assert set(wl.yardsticks) == {"prefill_alone", "peer_copy"}
    assert wl.comm_yardsticks == ("peer_copy",)  # bench reports its GB/s
    for name in wl.yardsticks:
        assert {"setup", "run"} <= parse_program(wl.yardstick_text(name)).functions
    assert "communicate=False" in wl.yardstick_text("prefill_alone")


def test_seed_knobs(wl: KvTransfer) -> None:
    text = with_config(wl.program_text("seed"), ctas=32, prefill_ctas=8, unroll=2, layers_per_launch=4)
    assert "ctas=32" in text and "prefill_ctas=8" in text and "layers_per_launch=4" in text
    seed = load_program(text, "seed")
    # pull mode (the default) writes the source's cache with every SM between GEMMs; push mode pushes beside them
    assert seed.push_ctas(wl.parse_shape("S2048", 2)) == 32 and seed.push_ctas(wl.parse_shape("S2048-P13", 2)) == 32
    pushing = load_program(with_config(text, prefill_mode="push"), "seed")
    assert pushing.push_ctas(wl.parse_shape("S2048-P13", 2)) == 8 and pushing.push_ctas(wl.parse_shape("S2048", 2)) == 32
    bad = {
        "threads": (100, "multiple of 32"), "unroll": (0, "unroll"), "layers_per_launch": (0, "layers_per_launch"),
        "ctas": (2000, "CONFIG\\['ctas'\\] must be an int in \\[1, 1024\\]"),
        "prefill_mode": ("both", "'pull' or 'push'"), "pull_ctas": (0, "CONFIG\\['pull_ctas'\\]"),
    }
    for knob, (value, message) in bad.items():
        broken = load_program(with_config(text, **{knob: value}), "seed")
        with pytest.raises(ValueError, match=message):
            broken._check_config(wl.parse_shape("S64", 2))


def test_seed_needs_a_symmetric_cache(wl: KvTransfer) -> None:
    """The seed stores into the destination's `out` through its window: an ordinary tensor is a
    clear error before anything is launched (so no rank is left waiting in a barrier)."""
    from types import SimpleNamespace

    seed = load_program(wl.program_text("seed"), "seed")

    class Windows:
        def __init__(self, offset: int | None):
            self.offset = offset

        def window(self, tensor: torch.Tensor):
            if self.offset is None:
                raise ValueError("tensor is not in a symmetric window: allocate it with ctx.symmetric()")
            return SimpleNamespace(offset=self.offset)

    out = wl.make_output(wl.parse_shape("S37-KV2", 2), 2, 1, CPU)
    with pytest.raises(ValueError, match="straight into the destination's cache through its symmetric window"):
        seed.out_window(Windows(None), out)
    with pytest.raises(ValueError, match="contiguous bf16"):
        seed.out_window(Windows(0), out.float())
    with pytest.raises(ValueError, match="contiguous bf16"):
        seed.out_window(Windows(0), out.transpose(0, 1))
    with pytest.raises(ValueError, match="16-byte aligned"):
        seed.out_window(Windows(8), out)
    assert seed.out_window(Windows(4096), out).offset == 4096


def test_seed_cuda_compiles(wl: KvTransfer) -> None:
    """The seed's CUDA as it compiles it (compile-time knobs defined), without a stack frame at its
    defaults; the template's largest threads and unroll still build."""
    toolchain_or_skip()
    artifact = compile_cubin(seed_source(wl))
    assert artifact.path.exists()
    for kernel in ("kv_push", "kv_land", "kv_pull"):
        assert f"'{kernel}'" in artifact.log
    assert set(re.findall(r"(\d+) bytes stack frame", artifact.log)) == {"0"}
    assert "#define KV_UNROLL 8\n#define KV_MAX_THREADS 1024\n" in seed_source(wl, threads=1024, unroll=8)
    assert compile_cubin(seed_source(wl, threads=1024, unroll=8)).path.exists()


def test_seed_launches_match_kernel_signatures(wl: KvTransfer, tmp_path) -> None:
    """Every `.launch(..., [args])` in the seed passes as many arguments as its kernel declares
    (read from nvcc's PTX), so a GPU session does not find out by a LaunchError."""
    import ast

    text = wl.program_text("seed")
    build = nvcc_host_build(parse_program(text).cuda_sources["CUDA_SRC"], tmp_path, "seed.ptx", "-ptx")
    assert build.returncode == 0, build.stderr
    ptx = tmp_path / "seed.ptx"
    params = {m.group(1): len(re.findall(r"\.param\b", m.group(2)))
              for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx.read_text(), re.S)}
    assert set(params) == {"kv_push", "kv_land", "kv_pull"}
    names = dict(re.findall(r'"(\w+)": module\.kernel\("(\w+)"\)', text))  # state key -> kernel
    launches = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch":
            key = node.func.value.slice.value  # state["push"].launch(...)
            launches[names[key]] = len(node.args[2].elts)
    assert launches == params


# The push kernel's schedule and page copy compiled for the host (kv_plan, kv_cta_loop and
# kv_push_page, exactly as the kernel calls them): for tokens that fill or do not fill the last
# block, several head counts, free blocks, thread counts, CTA counts and layers per launch, every
# page of every layer lands once in both caches at its table's block, zero-padded past S, nothing
# else is touched, every CTA signals every layer exactly once, and only after its last page of it.
PAGE_CHECK_MAIN = r"""
#include <cstdio>
#include <vector>
#include <algorithm>

static unsigned long long lcg(unsigned long long& s) { s = s * 6364136223846793005ull + 1442695040888963407ull; return s >> 33; }

int main() {
  int cases = 0, bad = 0;
  // pages per step: a 1024-thread CTA copies two 2048-vector pages at once, a 512-thread one one page;
  // 256-vector pages (one KV head) go 8 at a time; never fewer than a warp per page
  if (kv_plan(128, 0, 32, 2048, 1024, 4).pps != 2 || kv_plan(128, 0, 32, 2048, 512, 4).pps != 1 ||
      kv_plan(128, 0, 32, 256, 512, 4).pps != 8 || kv_plan(128, 0, 32, 256, 64, 16).pps != 2 ||
      kv_plan(3, 2, 5, 2048, 7, 4).pps != 1 || kv_plan(3, 2, 5, 2048, 512, 4).pages != 18) {
    printf("kv_plan is off\n");
    bad++;
  }
  const long long tokens_list[] = {1, 15, 16, 17, 37, 64};
  const int heads_list[] = {1, 2, 8};
  const long long free_list[] = {0, 3};
  const int thread_counts[] = {1, 7, 64, 96, 512, 1024};
  const long long cta_counts[] = {1, 3, 8};
  const int per_launch_list[] = {1, 2, 3};
  const int layers = 3;
  unsigned long long seed = 12345;
  for (long long tokens : tokens_list)
  for (int heads : heads_list)
  for (long long free_blocks : free_list)
  for (int nthreads : thread_counts)
  for (long long ctas : cta_counts)
  for (int per_launch : per_launch_list) {
    const int token_units = heads * 128 * 2 / 16, page_units = 16 * token_units;
    const long long nb = (tokens + 15) / 16, total = nb + free_blocks;
    std::vector<long long> src(total), dst(total);
    for (long long i = 0; i < total; i++) src[i] = dst[i] = i;
    for (long long i = total - 1; i > 0; i--) { std::swap(src[i], src[lcg(seed) % (i + 1)]); std::swap(dst[i], dst[lcg(seed) % (i + 1)]); }
    std::vector<uint4> kv((size_t)layers * 2 * tokens * token_units);
    for (size_t u = 0; u < kv.size(); u++) kv[u] = make_uint4((unsigned)u + 1, (unsigned)(u * 7), 3u, (unsigned)cases);
    const uint4 poison = make_uint4(0xEEEEEEEEu, 0xEEEEEEEEu, 0xEEEEEEEEu, 0xEEEEEEEEu);
    std::vector<uint4> cache((size_t)layers * 2 * total * page_units, poison), theirs(cache);
    std::vector<int> copies((size_t)layers * 2 * nb, 0), signals(layers, 0);
    bool order = true;
    for (int l0 = 0; l0 < layers; l0 += per_launch) {
      const int l1 = std::min(layers, l0 + per_launch);
      const KvPlan plan = kv_plan(nb, l0, l1, page_units, nthreads, KV_UNROLL);
      if (plan.pps * plan.group != nthreads) order = false;
      const size_t base = (size_t)l0 * plan.per_layer;  // flat page index of the launch's first page
      for (long long cta = 0; cta < ctas; cta++) {
        std::vector<bool> done(layers, false);  // layers this CTA has signalled
        kv_cta_loop(plan, cta, ctas, l0, l1,
          [&](long long q0) {
            for (int tid = 0; tid < nthreads; tid++) {
              const long long q = q0 + tid / plan.group;
              if (q < plan.pages)
                kv_push_page(kv.data(), cache.data(), theirs.data(), src.data(), dst.data(), nb, total, tokens,
                             token_units, l0 + (int)(q / plan.per_layer), q % plan.per_layer, tid % plan.group,
                             plan.group);
            }
            for (long long q = q0; q < q0 + plan.pps && q < plan.pages; q++) {
              copies[base + q]++;
              if (done[l0 + q / plan.per_layer]) order = false;  // a page after its layer's signal
            }
          },
          [&](int from, int to) {
            for (int layer = from; layer < to; layer++) {
              if (layer < l0 || layer >= l1 || done[layer]) order = false;
              done[layer] = true;
              signals[layer]++;
              for (long long q = (layer - l0) * plan.per_layer; q < (layer - l0 + 1) * plan.per_layer; q++)
                if ((q / plan.pps) % ctas == cta && copies[base + q] != 1) order = false;  // its pages first
            }
          });
      }
    }
    for (int c : copies) if (c != 1) order = false;
    for (int s : signals) if (s != ctas) order = false;
    if (!order) { bad++; cases++; continue; }
    auto same = [](uint4 a, uint4 b) { return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w; };
    for (int layer = 0; layer < layers; layer++)
      for (int half = 0; half < 2; half++)
        for (long long b = 0; b < total; b++) {
          long long i_src = -1, i_dst = -1;
          for (long long i = 0; i < nb; i++) { if (src[i] == b) i_src = i; if (dst[i] == b) i_dst = i; }
          for (long long u = 0; u < page_units; u++) {
            size_t at = kv_page(layer, half, b, total, page_units);
            auto want = [&](long long i) {
              if (i < 0) return poison;
              long long t = 16 * i + u / token_units;
              return t < tokens ? kv[((size_t)(layer * 2 + half) * tokens + t) * token_units + u % token_units] : make_uint4(0u, 0u, 0u, 0u);
            };
            if (!same(cache[at + u], want(i_src)) || !same(theirs[at + u], want(i_dst))) { bad++; goto next; }
          }
        }
    next:
    cases++;
  }
  printf("cases %d wrong %d\n", cases, bad);
  return bad != 0;
}
"""


@pytest.mark.parametrize("unroll", [1, 4, 8])
def test_seed_page_copy_on_host(wl: KvTransfer, tmp_path, unroll: int) -> None:
    run_host_check(seed_source(wl, unroll=unroll), PAGE_CHECK_MAIN, tmp_path, "page_check")


# The pull kernel's page loop compiled for the host (kv_plan per layer and kv_pull_page, as kv_pull
# calls them): every page of the source's cache lands at its destination block once, bit for bit,
# and the destination's free blocks keep their poison.
PULL_CHECK_MAIN = r"""
#include <cstdio>
#include <vector>
#include <algorithm>

static unsigned long long lcg(unsigned long long& s) { s = s * 6364136223846793005ull + 1442695040888963407ull; return s >> 33; }

int main() {
  int cases = 0, bad = 0;
  const long long nb_list[] = {1, 3, 17};
  const int heads_list[] = {1, 8};
  const int thread_counts[] = {1, 64, 512, 1024};
  const long long cta_counts[] = {1, 5, 132};
  const int layers = 2;
  const long long free_blocks = 2;
  unsigned long long seed = 99;
  for (long long nb : nb_list)
  for (int heads : heads_list)
  for (int nthreads : thread_counts)
  for (long long ctas : cta_counts) {
    const int token_units = heads * 128 * 2 / 16, page_units = 16 * token_units;
    const long long total = nb + free_blocks;
    std::vector<long long> src(total), dst(total);
    for (long long i = 0; i < total; i++) src[i] = dst[i] = i;
    for (long long i = total - 1; i > 0; i--) { std::swap(src[i], src[lcg(seed) % (i + 1)]); std::swap(dst[i], dst[lcg(seed) % (i + 1)]); }
    std::vector<uint4> theirs((size_t)layers * 2 * total * page_units);
    for (size_t u = 0; u < theirs.size(); u++) theirs[u] = make_uint4((unsigned)u + 1, (unsigned)(u * 5), 9u, (unsigned)cases);
    const uint4 poison = make_uint4(0xEEEEEEEEu, 0xEEEEEEEEu, 0xEEEEEEEEu, 0xEEEEEEEEu);
    std::vector<uint4> cache(theirs.size(), poison);
    for (int layer = 0; layer < layers; layer++)
      for (long long cta = 0; cta < ctas; cta++) {
        const KvPlan plan = kv_plan(nb, layer, layer + 1, page_units, nthreads, KV_UNROLL);
        for (long long q0 = cta * plan.pps; q0 < plan.pages; q0 += ctas * plan.pps)
          for (int tid = 0; tid < nthreads; tid++) {
            const int j = tid / plan.group, lane = tid % plan.group;
            if (q0 + j < plan.pages)
              kv_pull_page(theirs.data(), cache.data(), src.data(), dst.data(), nb, total, page_units, layer, q0 + j,
                           lane, plan.group);
          }
      }
    auto same = [](uint4 a, uint4 b) { return a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w; };
    for (int layer = 0; layer < layers; layer++)
      for (int half = 0; half < 2; half++)
        for (long long b = 0; b < total; b++) {
          long long i_dst = -1;
          for (long long i = 0; i < nb; i++) if (dst[i] == b) i_dst = i;
          const size_t at = kv_page(layer, half, b, total, page_units);
          for (long long u = 0; u < page_units; u++) {
            const uint4 want = i_dst < 0 ? poison : theirs[kv_page(layer, half, src[i_dst], total, page_units) + u];
            if (!same(cache[at + u], want)) { bad++; goto next; }
          }
        }
    next:
    cases++;
  }
  printf("cases %d wrong %d\n", cases, bad);
  return bad != 0;
}
"""


@pytest.mark.parametrize("unroll", [1, 4])
def test_seed_pull_page_copy_on_host(wl: KvTransfer, tmp_path, unroll: int) -> None:
    run_host_check(seed_source(wl, unroll=unroll), PULL_CHECK_MAIN, tmp_path, "pull_check")


# -- running the host baselines over gloo ---------------------------------------------------------
# Spawned workers inherit sys.path (pytest has given it tests/), so they import kv_jobs by name.
@pytest.fixture(scope="module")
def cpu_pool():
    with WorkerPool(2, device="cpu", job_timeout_s=120) as pool:
        yield pool


@pytest.mark.parametrize("program", HOST_PROGRAMS)
def test_host_programs_on_cpu(program: str, cpu_pool: WorkerPool) -> None:
    # The stand-in prefill's bf16 GEMMs take seconds each on a CPU: P > 0 shapes run on GPUs only.
    for shape in ("S37-KV2", "S40-KV1-L2-F3"):  # S300-L2 (all 8 heads) runs in test_kv_transfer_cascade.py
        result = cpu_pool.run("kv_jobs:run_program_check", program=program, shape_text=shape, seed=11)
        assert result.ok, f"{program} {shape}: {result.first_failure()}"
        for value in result.values:
            assert value["inputs_intact"], f"{program} {shape} modified its inputs"
            assert not value["strict"], f"{program} {shape}: {value['strict']}"
            assert not value["harness"], f"{program} {shape}: {value['harness']}"


def test_seed_unavailable_on_cpu(cpu_pool: WorkerPool) -> None:
    result = cpu_pool.run("program_jobs:program_availability", workload="kv-transfer")
    assert result.ok, result.first_failure()
    reasons = result.values[0]
    assert all(reasons[name] is None for name in HOST_PROGRAMS)
    assert "CUDA" in reasons["seed"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("program", PROGRAMS)
def test_program_on_gpus(wl: KvTransfer, program: str, world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    shapes = [s.label for s in wl.check_shapes(world)] + ["S40-KV1-L2-F3", "S4096-F100", "S8192-P1"]
    with WorkerPool(world, device="cuda", job_timeout_s=300) as pool:
        for shape in shapes:
            result = pool.run("kv_jobs:run_program_check", program=program, shape_text=shape, seed=5, calls=3)
            assert result.ok, f"{program} {shape}: {result.first_failure()}"
            for value in result.values:
                assert value["inputs_intact"], f"{program} {shape} modified its inputs"
                assert not value["strict"] and not value["harness"], f"{program} {shape}: {value}"


# The seed's other paths: eager calls, many CTAs with the widest CTA, CTAs that do not divide the
# pages with one vector in flight, and a prefill shape whose layers do not divide into launches.
SEED_VARIANTS = {
    "eager": dict(graph=False),
    "wide": dict(ctas=132, threads=1024, unroll=8),
    "narrow": dict(ctas=7, threads=128, unroll=1),
    "grouped": dict(prefill_ctas=5, layers_per_launch=3, unroll=2),
    "grouped_push": dict(prefill_mode="push", prefill_ctas=5, layers_per_launch=3, unroll=2),
    "pull_few": dict(pull_ctas=3, prefill_ctas=7, threads=128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(SEED_VARIANTS))
def test_seed_variants_on_gpus(variant: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    with WorkerPool(2, device="cuda", job_timeout_s=300) as pool:
        for shape in ("S37-KV2-F5", "S2000-L4-F7", "S300-L5-P1-F3"):
            result = pool.run("kv_jobs:run_program_check", program="seed", shape_text=shape, seed=7, calls=3,
                              config=SEED_VARIANTS[variant])
            assert result.ok, f"{variant} {shape}: {result.first_failure()}"
            for value in result.values:
                assert value["inputs_intact"], f"{variant} {shape} modified its inputs"
                assert not value["strict"] and not value["harness"], f"{variant} {shape}: {value}"


def test_two_pairs_on_four_cpu_workers() -> None:
    """World 4: ranks (0 -> 1) and (2 -> 3) transfer different sequences at once, each bit-exact."""
    with WorkerPool(4, device="cpu", job_timeout_s=120) as pool:
        for program in HOST_PROGRAMS:
            result = pool.run("kv_jobs:run_program_check", program=program, shape_text="S37-KV2-L2-F2", seed=8)
            assert result.ok, f"{program}: {result.first_failure()}"
            for value in result.values:
                assert value["inputs_intact"] and not value["strict"], f"{program}: {value}"
