"""CPU checks of the moe workload: routing, slot layout, reference, shapes, programs, CUDA sources.

The seed's kernels need GPUs; here they are compiled, their expert-major position math is run on
the host, and the seed's data flow (slot layout, expert-major dispatch, one pair of grouped GEMMs,
weighted combine) is replayed in one process with the same library functions the seed calls.
`pytest -m gpu` runs every program on the GPUs themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cuda_host import nvcc_host_build, run_host_check, toolchain_or_skip
from program_jobs import check_on_gpus
from commweave.evaluate.floor import MachineRates, floor_s
from commweave.contracts.program import parse_program, with_config
from commweave.runtime import WorkerPool
from commweave.runtime.compile import compile_cubin
from commweave.workloads.moe import routing
from commweave.taco.quant import QuantConfig, roundtrip
from commweave.workloads.moe.workload import MoELayer, MoELayerLossy

CPU = torch.device("cpu")
PROGRAMS = ("host", "host_padded", "seed")


@pytest.fixture(scope="module")
def wl() -> MoELayer:
    return MoELayer()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are small: torch's thread pool only adds contention on a loaded CI machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# -- routing --------------------------------------------------------------------------------------
def _gate_route_slow(x, gate_w, bias, top_k, n_groups, topk_groups, scaling=2.5):
    """DeepSeek-V3's routing written token by token, for comparison."""
    scores = torch.sigmoid(x.double() @ gate_w.double().t())
    choice = scores + bias.double()
    n_experts = gate_w.shape[0]
    per_group = n_experts // n_groups
    ids, weights = [], []
    for t in range(x.shape[0]):
        group_score = [sorted(choice[t, g * per_group:(g + 1) * per_group].tolist())[-2:] for g in range(n_groups)]
        groups = sorted(range(n_groups), key=lambda g: -sum(group_score[g]))[:topk_groups]
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -choice[t, e].item())[:top_k]
        w = torch.tensor([scores[t, e].item() for e in chosen], dtype=torch.float64)
        ids.append(sorted(chosen))
        weights.append(dict(zip(chosen, (w / w.sum() * scaling).tolist())))
    return ids, weights


@pytest.mark.parametrize("n_experts,top_k,groups,topk_groups", [(32, 8, 8, 4), (64, 8, 8, 4), (256, 8, 8, 4), (24, 3, 4, 2)])
def test_gate_route_matches_deepseek(n_experts: int, top_k: int, groups: int, topk_groups: int) -> None:
    g = _gen(n_experts)
    x = torch.randn(40, 48, generator=g)
    gate_w = torch.randn(n_experts, 48, generator=g) / 7
    bias = 0.05 * torch.randn(n_experts, generator=g)
    idx, w = routing.gate_route(x, gate_w, bias, top_k, groups, topk_groups)
    assert idx.shape == w.shape == (40, top_k) and idx.dtype == torch.int64 and w.dtype == torch.float32
    want_ids, want_w = _gate_route_slow(x, gate_w, bias, top_k, groups, topk_groups)
    per_group = n_experts // groups
    for t in range(40):
        assert sorted(idx[t].tolist()) == want_ids[t]
        for k in range(top_k):
            assert w[t, k].item() == pytest.approx(want_w[t][idx[t, k].item()], rel=1e-5)
        assert len({e // per_group for e in idx[t].tolist()}) <= topk_groups  # group limit
    assert torch.allclose(w.sum(1), torch.full((40,), 2.5))


def test_gate_route_bias_only_steers_choice() -> None:
    g = _gen(5)
    x, gate_w = torch.randn(16, 32, generator=g), torch.randn(32, 32, generator=g) / 6
    bias = torch.zeros(32)
    bias[3] = 10.0  # expert 3 is always chosen, but weighted by its sigmoid score, not the bias
    idx, w = routing.gate_route(x, gate_w, bias, 8, 8, 4)
    assert (idx == 3).any(1).all()
    scores = torch.sigmoid(x @ gate_w.t())
    picked = scores.gather(1, idx)
    assert torch.allclose(w, picked / picked.sum(1, keepdim=True) * 2.5, rtol=1e-5)


def test_routing_params_errors() -> None:
    cases = {
        (30, 8, 8, 4): "cannot be split into 8 equal groups",
        (32, 8, 8, 9): "top groups \\(9\\) exceed",
        (8, 2, 8, 4): "two best experts",
        (32, 20, 8, 4): "top-20 cannot be chosen from 4 groups of 4",
        (32, 0, 8, 4): "must be positive",
    }
    for args, message in cases.items():
        with pytest.raises(ValueError, match=message):
            routing.check_routing_params(*args)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 5])
def test_skewed_route_ratio(world: int, ratio: int) -> None:
    tokens, n_experts, top_k = 300, 64, 8
    idx, w = routing.skewed_route(tokens, n_experts, top_k, world, ratio, _gen(ratio), CPU)
    assert idx.shape == (tokens, top_k) and w.shape == (tokens, top_k)
    assert all(len(set(row)) == top_k for row in idx.tolist())  # distinct experts per token
    assert int(idx.min()) >= 0 and int(idx.max()) < n_experts
    loads = routing.rank_loads(idx, n_experts, world).tolist()
    assert sum(loads) == tokens * top_k
    shares = routing.rank_shares(world, ratio)
    for load, share in zip(loads, shares):
        assert abs(load - tokens * top_k * share) <= 1
    assert loads[0] / (sum(loads[1:]) / (world - 1)) == pytest.approx(ratio, rel=0.01)
    assert torch.allclose(w.sum(1), torch.full((tokens,), 2.5))
    # experts within a rank are used roughly evenly (uniform draws)
    per_expert = torch.bincount(idx.reshape(-1), minlength=n_experts).view(world, -1).float()
    assert (per_expert.std(1) / per_expert.mean(1)).max() < 0.5


def test_skewed_route_errors() -> None:
    with pytest.raises(ValueError, match="at least top-k \\(8\\) experts per rank, not 4"):
        routing.skewed_route(10, 16, 8, 4, 2, _gen(0), CPU)
    with pytest.raises(ValueError, match="ratio must be >= 1"):
        routing.rank_shares(4, 0)
    with pytest.raises(ValueError, match="split evenly over 4 ranks"):
        routing.skewed_route(10, 30, 2, 4, 2, _gen(0), CPU)


# -- slot layout (the seed's dispatch) -------------------------------------------------------------
def _routings(world: int):
    wl = MoELayer()
    for shape in wl.check_shapes(world):
        for rank in range(world):
            _, idx, _ = wl.tokens_and_routing(shape, world, rank, 3, CPU)
            yield shape, idx


@pytest.mark.parametrize("world", [2, 4])
def test_slot_layout(world: int) -> None:
    for shape, idx in _routings(world):
        n_experts, top_k, per_rank = shape["E"], shape["K"], shape["E"] // world
        lay = routing.slot_layout(idx, n_experts, world)
        flat = idx.reshape(-1)
        assert torch.equal(lay["counts"], torch.bincount(flat, minlength=n_experts))
        assert torch.equal(lay["dest"], flat // per_rank)
        assert int(lay["dest_start"][-1]) == flat.numel()
        rows = routing.pool_rows_per_source(shape["T"], top_k)
        for d in range(world):
            mine = (lay["dest"] == d).nonzero().flatten()
            slots = lay["slot"][mine]
            # the pairs for d fill slots 0..n-1 exactly once: nothing dropped, nothing overwritten
            assert sorted(slots.tolist()) == list(range(mine.numel()))
            assert mine.numel() == int(lay["dest_start"][d + 1] - lay["dest_start"][d]) <= rows
            # slots are grouped by local expert, ascending, in the sizes the destination is told
            by_slot = flat[mine][slots.argsort()] - d * per_rank
            assert torch.equal(by_slot, torch.repeat_interleave(torch.arange(per_rank), lay["counts"][d * per_rank:(d + 1) * per_rank]))
            # the kernel's view: sorted position i of destination d lands in slot i - dest_start[d]
            for i in range(int(lay["dest_start"][d]), int(lay["dest_start"][d + 1])):
                pair = int(lay["order"][i])
                assert int(lay["slot"][pair]) == i - int(lay["dest_start"][d])


def test_pool_never_overflows() -> None:
    # even a routing that sends every pair of every token to one rank fits its region
    idx = torch.arange(8).repeat(50, 1)  # 50 tokens, all to experts 0..7 on rank 0
    lay = routing.slot_layout(idx, 32, 4)
    assert int(lay["slot"].max()) == 399 < routing.pool_rows_per_source(50, 8)


def _random_counts(g: torch.Generator, world: int, per_rank: int, rows: int) -> torch.Tensor:
    """counts [W, E/W]: each source sends at most `rows` rows, spread at random over the experts."""
    counts = torch.zeros(world, per_rank, dtype=torch.int64)
    for s in range(world):
        n = int(torch.randint(0, rows + 1, (1,), generator=g))
        counts[s] = torch.bincount(torch.randint(0, per_rank, (n,), generator=g), minlength=per_rank)
    return counts


def test_expert_major_positions() -> None:
    """Every (source, expert, i) row gets its own position; expert e's rows are contiguous, by
    source, experts in order, ending at the total; the group ends are where each expert ends."""
    g = _gen(9)
    for world, per_rank, rows in ((1, 3, 5), (2, 3, 7), (4, 8, 40), (4, 1, 5), (2, 128, 300)):
        counts = _random_counts(g, world, per_rank, rows)
        expected = []
        for e in range(per_rank):
            for s in range(world):
                expected += [(s, e, i) for i in range(int(counts[s, e]))]
        got = {}
        for s in range(world):
            local = torch.repeat_interleave(torch.arange(per_rank), counts[s])  # s's pairs in slot order
            slot = torch.arange(local.numel())
            pos = routing.expert_major_positions(slot, local, counts, s)
            first = counts[s].cumsum(0) - counts[s]
            for p, e, sl in zip(pos.tolist(), local.tolist(), slot.tolist()):
                got[p] = (s, e, sl - int(first[e]))
        assert sorted(got) == list(range(len(expected)))  # distinct, and exactly 0..total-1
        assert [got[p] for p in range(len(expected))] == expected
        ends = routing.expert_group_ends(counts)
        assert ends.dtype == torch.int32 and ends.tolist() == counts.sum(0).cumsum(0).tolist()


# The dispatch kernel's moe_expert_base compiled for the host, driven as the kernel drives it: the
# counts of W sources for one destination, strided as in shared memory (source s at s * stride).
POSITION_CHECK_MAIN = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>

int main() {
  int cases = 0, bad = 0;
  srand(7);
  const int worlds[] = {1, 2, 3, 4, 8};
  const int experts[] = {1, 2, 5, 32, 128};
  for (int world : worlds)
  for (int per_rank : experts)
  for (int rep = 0; rep < 4; rep++) {
    const long long stride = (long long)per_rank * (1 + rep % 3);  // the kernel's n_experts stride
    const long long rows = 1 + rand() % 200;
    std::vector<long long> counts((size_t)world * stride, -1000000);  // entries past per_rank unread
    for (int s = 0; s < world; s++) {
      for (int e = 0; e < per_rank; e++) counts[s * stride + e] = 0;
      long long n = rand() % (rows + 1);
      for (long long i = 0; i < n; i++) counts[s * stride + rand() % per_rank]++;
    }
    long long total = 0;
    for (int s = 0; s < world; s++) for (int e = 0; e < per_rank; e++) total += counts[s * stride + e];
    // where each (source, expert, i) must land: experts in order, sources in order, i in order
    std::vector<long long> want((size_t)world * per_rank);
    long long next = 0;
    for (int e = 0; e < per_rank; e++)
      for (int s = 0; s < world; s++) { want[s * per_rank + e] = next; next += counts[s * stride + e]; }
    std::vector<int> hits((size_t)total, 0);
    for (int s = 0; s < world; s++) {
      long long slot = 0;  // s's pairs for this destination in sorted order: grouped by expert
      for (int e = 0; e < per_rank; e++) {
        const long long base = moe_expert_base(counts.data(), stride, world, s, e);
        for (long long i = 0; i < counts[s * stride + e]; i++, slot++) {
          const long long pos = slot + base;
          if (pos != want[s * per_rank + e] + i || pos < 0 || pos >= total) { bad++; continue; }
          hits[pos]++;
        }
      }
    }
    for (long long p = 0; p < total; p++) bad += hits[p] != 1;
    cases++;
  }
  printf("cases %d wrong %d\n", cases, bad);
  return bad != 0;
}
"""


def test_seed_position_math_on_host(wl: MoELayer, tmp_path: Path) -> None:
    run_host_check(parse_program(wl.program_text("seed")).cuda_sources["CUDA_SRC"], POSITION_CHECK_MAIN, tmp_path, "position_check")


def test_expert_major_bases_match_kernel_formula() -> None:
    """routing.expert_major_bases is moe_expert_base's formula (the CPU replay relies on it)."""
    g = _gen(3)
    for world, per_rank in ((2, 4), (4, 16)):
        counts = _random_counts(g, world, per_rank, 50)
        for src in range(world):
            bases = routing.expert_major_bases(counts, src).tolist()
            for e in range(per_rank):
                want = sum(int(counts[s, e]) for s in range(src))
                want += sum(int(counts[s, f]) for f in range(e) for s in range(world)) - sum(int(counts[src, f]) for f in range(e))
                assert bases[e] == want


# -- the seed's data flow, replayed on CPU ---------------------------------------------------------
def _simulate_seed(wl: MoELayer, shape, world: int, seed: int, fp8: QuantConfig | None = None) -> list[torch.Tensor]:
    """Dispatch, experts and combine as the seed's kernels do them, with plain tensors per rank;
    with `fp8` (CONFIG compression), every token row arrives as taco.quant's round trip of the row
    alone (its own message, as the seed's compress kernel packs it and moe_dequant unpacks it)."""
    inputs = [wl.make_inputs(shape, world, r, seed, CPU) for r in range(world)]
    if fp8 is not None:
        for rank_inputs in inputs:
            rank_inputs["x"] = torch.stack([roundtrip(row, fp8) for row in rank_inputs["x"]])
    tokens, hidden, top_k, n_experts = shape["T"], shape["H"], shape["K"], shape["E"]
    per_rank = n_experts // world
    pool_rows = world * routing.pool_rows_per_source(tokens, top_k)
    pool = [torch.full((pool_rows, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(world)]
    pair = [torch.full((pool_rows,), -1, dtype=torch.int32) for _ in range(world)]
    src = [torch.full((pool_rows,), -1, dtype=torch.int32) for _ in range(world)]
    wt = [torch.zeros(pool_rows) for _ in range(world)]
    back = [torch.full((tokens * top_k, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(world)]
    layouts = [routing.slot_layout(inputs[r]["topk_idx"], n_experts, world) for r in range(world)]
    sent = torch.stack([lay["counts"] for lay in layouts])  # [W, E]: every rank's `sent`, as the kernel pulls it
    cnt = [sent[:, d * per_rank:(d + 1) * per_rank] for d in range(world)]  # what d's CTA 0 stores
    for me in range(world):  # moe_dispatch
        x, idx, w, lay = inputs[me]["x"], inputs[me]["topk_idx"], inputs[me]["topk_weights"], layouts[me]
        for d in range(world):
            begin, end = int(lay["dest_start"][d]), int(lay["dest_start"][d + 1])
            pairs = lay["order"][begin:end]  # sorted position i has slot i - begin
            local = idx.reshape(-1)[pairs] - d * per_rank
            rows = routing.expert_major_positions(torch.arange(end - begin), local, cnt[d], me)
            assert bool((rows < pool_rows).all()) and bool((pair[d][rows] == -1).all())  # nothing overwritten
            pool[d][rows] = x[pairs // top_k]
            pair[d][rows] = pairs.to(torch.int32)
            src[d][rows] = me
            wt[d][rows] = w.reshape(-1)[pairs]
    for d in range(world):  # one pair of grouped GEMMs over the pool as it lies, then moe_combine
        w13, w2 = inputs[d]["w13"], inputs[d]["w2"]
        ends = routing.expert_group_ends(cnt[d])
        gate_up = torch._grouped_mm(pool[d], w13.transpose(-2, -1), offs=ends)
        h = F.silu(gate_up[:, :shape["I"]]) * gate_up[:, shape["I"]:]
        y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends)
        total = int(cnt[d].sum())
        assert bool((src[d][:total] >= 0).all()) and bool((src[d][total:] == -1).all())  # valid rows are exactly [0, total)
        for i in range(total):
            s, p = int(src[d][i]), int(pair[d][i])
            back[s][p] = (y[i].float() * wt[d][i]).to(torch.bfloat16)
    return [torch.sum(back[r].view(tokens, top_k, hidden), dim=1, dtype=torch.float32).to(torch.bfloat16) for r in range(world)]


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_seed_dataflow_on_cpu(wl: MoELayer, world: int, which: int) -> None:
    shape = wl.check_shapes(world)[which]
    outs = _simulate_seed(wl, shape, world, seed=4)
    for rank, out in enumerate(outs):
        ref = wl.reference(shape, world, rank, 4, CPU)
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < wl.tolerance(), f"{shape} W={world} rank {rank}: {err:.3g}"


@pytest.mark.parametrize("world", [2, 4])
def test_seed_fp8_dispatch_dataflow_on_cpu(world: int) -> None:
    """FP8 E4M3 dispatch (one scale per 32 or 128 values; H = 136 pads the last group of a row) stays
    within moe-lossy's declared tolerance and above moe's, on every check shape; E5M2 does not."""
    lossy = MoELayerLossy()
    for which, group in ((0, 128), (1, 128), (2, 32)):
        shape = lossy.check_shapes(world)[which]
        cfg = QuantConfig(group, "e4m3", hadamard=False, dual_scale=False)
        for rank, out in enumerate(_simulate_seed(lossy, shape, world, seed=5, fp8=cfg)):
            ref = lossy.reference(shape, world, rank, 5, CPU)
            err = float((out.float() - ref).norm() / ref.norm())
            assert MoELayer().tolerance() < err < lossy.tolerance(), f"{shape} W={world} rank {rank}: {err:.3g}"
    shape = lossy.check_shapes(world)[1]
    out = _simulate_seed(lossy, shape, world, seed=5, fp8=QuantConfig(128, "e5m2", hadamard=False, dual_scale=False))[0]
    ref = lossy.reference(shape, world, 0, 5, CPU)
    assert float((out.float() - ref).norm() / ref.norm()) > lossy.tolerance()


# The seed's moe_dequant_unit compiled for the host: every byte of both formats, several scales
# (1, a fraction, FP32's smallest normal, a large one), printed as bf16 bits for the test to compare
# with taco.quant.decompress's arithmetic (`payload.float() * scale`, then bf16).
DEQUANT_MAIN = r"""
#include <cstdio>
#include <cstring>

int main() {
  const float scales[] = {1.0f, 0.0037f, 1.17549435e-38f, 2.5e5f};
  for (int fmt = 0; fmt < 2; fmt++)
  for (int s = 0; s < 4; s++)
  for (int first = 0; first < 256; first += 8) {
    unsigned char bytes[8];
    for (int k = 0; k < 8; k++) bytes[k] = (unsigned char)(first + k);
    uint2 q;
    memcpy(&q, bytes, 8);
    uint4 out = moe_dequant_unit(q, scales[s], fmt);
    unsigned short bits[8];
    memcpy(bits, &out, 16);
    for (int k = 0; k < 8; k++) printf("%d %d %d %04x\n", fmt, s, first + k, bits[k]);
  }
  return 0;
}
"""


def test_seed_dequant_matches_taco_decompress_on_host(wl: MoELayer, tmp_path: Path) -> None:
    """moe_dequant's arithmetic gives taco.quant.decompress's bits for every finite FP8 value."""
    import subprocess

    source = parse_program(wl.program_text("seed")).cuda_sources["CUDA_SRC"]
    build = nvcc_host_build(source + DEQUANT_MAIN, tmp_path, "dequant_check", "-O2")
    assert build.returncode == 0, build.stdout + build.stderr
    lines = subprocess.run([str(tmp_path / "dequant_check")], capture_output=True, text=True, check=True).stdout.split()
    scales = torch.tensor([1.0, 0.0037, 1.17549435e-38, 2.5e5], dtype=torch.float32)
    compared = 0
    for fmt, dtype in enumerate((torch.float8_e4m3fn, torch.float8_e5m2)):
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        for s, scale in enumerate(scales):
            want = (values * scale).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
            for byte in range(256):
                f, si, b, bits = lines[4 * (fmt * 4 * 256 + s * 256 + byte):][:4]
                assert (int(f), int(si), int(b)) == (fmt, s, byte)
                if not torch.isfinite(values[byte] * scale):
                    continue  # NaN / Inf bytes: the compressor never writes them (it saturates)
                assert int(bits, 16) == int(want[byte]), (fmt, float(scale), byte, bits, hex(int(want[byte])))
                compared += 1
    assert compared > 1900


# -- shapes ---------------------------------------------------------------------------------------
def test_workload_basics(wl: MoELayer) -> None:
    assert wl.name == "moe" and wl.baselines == ("host", "host_padded") and wl.seed == "seed"
    assert wl.world_sizes == (1, 2, 4) and wl.dtype == torch.bfloat16
    assert wl.program_names() == sorted(PROGRAMS)


@pytest.mark.parametrize("world", [2, 4])
def test_bench_shapes(wl: MoELayer, world: int) -> None:
    shapes = wl.bench_shapes(world)
    assert [s.label for s in shapes] == ["dsv3-T128", "dsv3-T4096"] + [f"dsv3-T4096-skew{r}" for r in (2, 3, 4, 5)]
    s = shapes[1]
    assert (s["T"], s["H"], s["I"], s["E"], s["K"], s["G"], s["TG"], s["skew"]) == (4096, 7168, 2048, 256, 8, 8, 4, 0)
    for shape in shapes:
        assert wl.parse_shape(shape.label, world) == shape


@pytest.mark.parametrize("world", [2, 4])
def test_check_shapes(wl: MoELayer, world: int) -> None:
    shapes = wl.check_shapes(world)
    assert len(shapes) >= 2
    assert any(all(d % 16 for d in (s["T"], s["H"], s["I"])) for s in shapes), "one shape must fit no 16-tile"
    assert any(s["skew"] for s in shapes) and any(not s["skew"] for s in shapes)
    for s in shapes:
        assert (s["K"], s["G"], s["TG"]) == (8, 8, 4)  # DeepSeek-V3's routing structure, scaled H, I, E
        assert wl.parse_shape(s.label, world) == s


def test_parse_shape_errors(wl: MoELayer) -> None:
    s = wl.parse_shape(" T64-H128-I48-E32-k8-g8-tg4-skew2 ", 4)
    assert (s["T"], s["H"], s["I"], s["E"], s["skew"]) == (64, 128, 48, 32, 2)
    bad = {
        "dsv3": "is not 'dsv3-T<tokens>",
        "T64-H128-I48": "is not 'dsv3-T<tokens>",
        "dsv3-T0": "T must be positive",
        "T64-H130-I48-E32-k8-g8-tg4": "H=130 and I=48 must be multiples of 8",
        "T64-H128-I48-E30-k8-g8-tg4": "E=30 experts cannot be split evenly over 4 ranks",
        "T64-H128-I48-E32-k8-g8-tg9": "exceed the number of groups",
        "T64-H128-I48-E32-k8-g8-tg4-skew1": "skew must be 0",
        "T64-H128-I48-E16-k8-g8-tg4-skew2": "at least top-k \\(8\\) experts per rank",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            wl.parse_shape(text, 4)
    with pytest.raises(ValueError, match="runs on 1, 2, 4 GPUs, not 8"):
        wl.parse_shape("dsv3-T128", 8)


def test_cost(wl: MoELayer) -> None:
    s = wl.parse_shape("dsv3-T4096", 4)
    c = wl.cost(s, 4)
    pairs = 4096 * 8  # balanced: each rank's experts process T*K rows
    assert c.flops == pytest.approx(2 * pairs * 3 * 7168 * 2048)
    assert c.comm_bytes == pytest.approx(2 * pairs * 3 / 4 * 7168 * 2)
    skewed = wl.cost(wl.parse_shape("dsv3-T4096-skew5", 4), 4)
    assert skewed.flops == pytest.approx(c.flops * 4 * 5 / 8)  # the hot rank gets 5/8 of all pairs
    decode = wl.cost(wl.parse_shape("dsv3-T128", 4), 4)
    assert decode.memory_bytes >= 64 * 3 * 7168 * 2048 * 2  # decode reads every local expert's weights
    assert c.wire_ratio == 1.0
    # moe-lossy: the same bf16 bytes (the cost model compresses them itself), but its floor's link
    # term counts rows in FP8 with a scale per 512 values both ways (a lower bound for FP8 dispatch)
    lossy = MoELayerLossy().cost(s, 4)
    assert (lossy.flops, lossy.comm_bytes, lossy.memory_bytes) == (c.flops, c.comm_bytes, c.memory_bytes)
    assert lossy.comm_bytes * lossy.wire_ratio == pytest.approx(2 * pairs * 3 / 4 * (7168 + 4 * 14))
    rates = MachineRates(matmul_flops_per_s=1e30, hbm_bytes_per_s=1e30)  # the link term alone
    assert floor_s(lossy, rates) == pytest.approx(floor_s(c, rates) * (7168 + 56) / (2 * 7168))


# -- data and reference ---------------------------------------------------------------------------
def test_inputs(wl: MoELayer) -> None:
    s = wl.check_shapes(4)[0]
    x = wl.make_inputs(s, 4, 2, seed=3, device=CPU)
    assert x["x"].shape == (67, 136) and x["x"].dtype == torch.bfloat16
    assert x["topk_idx"].shape == (67, 8) and x["topk_idx"].dtype == torch.int64
    assert x["topk_weights"].dtype == torch.float32
    assert x["w13"].shape == (8, 80, 136) and x["w2"].shape == (8, 136, 40)
    again = wl.make_inputs(s, 4, 2, seed=3, device=CPU)
    assert all(torch.equal(x[k], again[k]) for k in x)
    other = wl.make_inputs(s, 4, 2, seed=4, device=CPU)
    assert not any(torch.equal(x[k], other[k]) for k in ("x", "w13", "w2"))
    # any rank can regenerate any expert: rank 2 holds experts 16..23
    w13, w2 = wl.expert_weights(s, 3, 18, CPU)
    assert torch.equal(x["w13"][2], w13) and torch.equal(x["w2"][2], w2)
    assert not torch.equal(x["x"], wl.make_inputs(s, 4, 1, seed=3, device=CPU)["x"])
    assert wl.make_output(s, 4, 2, CPU).shape == (67, 136)


@pytest.mark.parametrize("world", [2, 4])
def test_reference(wl: MoELayer, world: int) -> None:
    for s in wl.check_shapes(world)[::2]:
        rank = world - 1
        x, idx, w = wl.tokens_and_routing(s, world, rank, 7, CPU)
        experts = [[t.double() for t in wl.expert_weights(s, 7, e, CPU)] for e in range(s["E"])]
        want = torch.zeros(s["T"], s["H"], dtype=torch.float64)
        for t in range(s["T"]):
            for k in range(s["K"]):
                w13, w2 = experts[int(idx[t, k])]
                gu = w13 @ x[t].double()
                want[t] += w[t, k].double() * (w2 @ (F.silu(gu[:s["I"]]) * gu[s["I"]:]))
        got = wl.reference(s, world, rank, 7, CPU)
        assert got.dtype == torch.float32 and got.shape == (s["T"], s["H"])
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)
        assert 0.2 < got.std().item() < 2.0


# -- programs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PROGRAMS)
def test_program_parses(wl: MoELayer, name: str) -> None:
    parsed = parse_program(wl.program_text(name))
    assert {"setup", "run"} <= parsed.functions
    assert bool(parsed.cuda_sources) == (name == "seed")


def test_exchange_yardstick(wl: MoELayer) -> None:
    """The `exchange` yardstick is the seed without expert computation; bench reports its bandwidth
    (cost's comm_bytes over its time); the search's template never proposes it."""
    assert wl.comm_yardsticks == ("exchange",) and set(wl.comm_yardsticks) <= set(wl.yardsticks)
    assert "experts='none'" in wl.yardstick_text("exchange") and "experts='none'" not in wl.program_text("seed")
    parse_program(wl.yardstick_text("exchange"))
    from commweave.workloads.moe.template import KNOBS

    assert "none" not in KNOBS["experts"]


def test_seed_config_knobs(wl: MoELayer) -> None:
    text = with_config(wl.program_text("seed"), comm_ctas=32, swiglu="torch", wait="stream")
    assert "comm_ctas=32" in text and "swiglu='torch'" in text and "wait='stream'" in text
    parse_program(text)


def test_seed_cuda_compiles(wl: MoELayer) -> None:
    toolchain_or_skip()
    artifact = compile_cubin(parse_program(wl.program_text("seed")).cuda_sources["CUDA_SRC"])
    assert artifact.path.exists()
    for kernel in ("moe_dispatch", "moe_swiglu", "moe_combine", "moe_wait", "moe_dequant"):
        assert f"'{kernel}'" in artifact.log
    assert set(re.findall(r"(\d+) bytes stack frame", artifact.log)) == {"0"}


# -- running programs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_pool():
    with WorkerPool(2, device="cpu", job_timeout_s=120) as pool:
        yield pool


@pytest.mark.parametrize("program,config", [("host", None), ("host", {"experts": "loop"}), ("host_padded", None)])
def test_host_programs_on_cpu(wl: MoELayer, cpu_pool: WorkerPool, program: str, config: dict | None) -> None:
    for shape in wl.check_shapes(2):
        result = cpu_pool.run("program_jobs:run_program_check", workload="moe", program=program, shape_text=shape.label, seed=11, config=config)
        assert result.ok, result.first_failure()
        for value in result.values:
            assert value["inputs_intact"]
            assert value["error"] < wl.tolerance(), f"{program} {config} {shape}: error {value['error']:.3g}"


def test_seed_unavailable_on_cpu(cpu_pool: WorkerPool) -> None:
    result = cpu_pool.run("program_jobs:program_availability", workload="moe")
    assert result.ok, result.first_failure()
    reasons = result.values[0]
    assert reasons["host"] is None and reasons["host_padded"] is None
    assert "CUDA" in reasons["seed"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("program", PROGRAMS)
def test_program_on_gpus(wl: MoELayer, program: str, world: int) -> None:
    check_on_gpus("moe", program, world, [*(s.label for s in wl.check_shapes(world)), "dsv3-T128"], seed=5)


def test_cascade_on_cpu(wl: MoELayer, cpu_pool: WorkerPool) -> None:
    """The evaluator's own checks (poisoned outputs, fresh inputs, untouched inputs) pass both host
    baselines, times them side by side, and fails a program that drops a token's expert."""
    from commweave.evaluate import Evaluator

    ev = Evaluator(cpu_pool, wl, seeds=2, warmup=1, iters=3)
    for name in ("host", "host_padded"):
        verdict = ev.check(wl.program_text(name))
        assert verdict.ok, f"{name}: {verdict.message} {verdict.detail}"
    bench = ev.benchmark({name: wl.program_text(name) for name in ("host", "host_padded")}, wl.check_shapes(2)[0])
    for name in ("host", "host_padded"):
        timing = bench.programs[name]
        assert timing.verdict.ok, timing.verdict.message
    # a program that forgets every token's last expert is caught as a wrong result
    dropping = wl.program_text("host").replace("def run(ctx, state, inputs, out):",
                                               "def run(ctx, state, inputs, out):\n    inputs = dict(inputs, topk_weights=inputs['topk_weights'] * torch.tensor([1.0] * (inputs['topk_weights'].shape[1] - 1) + [0.0]))")
    verdict = ev.check(dropping)
    assert not verdict.ok and verdict.failure.value == "wrong_result", verdict


# -- template -------------------------------------------------------------------------------------
def test_template(wl: MoELayer) -> None:
    from commweave.contracts.program import load_program
    from commweave.space.template import directives_of

    template = wl.template()
    seed = template.seed_directives()
    assert template.check(seed, 4) == []
    rendered = template.render(seed, template.default_shape(4), 4)
    assert directives_of(rendered) == seed
    assert load_program(rendered).CONFIG == load_program(wl.program_text("seed")).CONFIG
    for changes, reason in ((dict(sync="chunk"), "implements sync peer only"),
                            (dict(placement="fused"), "implements placement split only"),
                            (dict(knobs={**seed.knob_dict, "swiglu": "sometimes"}), "knob swiglu='sometimes'")):
        assert any(reason in w for w in template.check(seed.with_(**changes), 4)), changes
    assert seed.knob_dict["combine_ctas"] == 64 and "overlap" not in seed.knob_dict
    variant = seed.with_(comm_ctas=32, knobs={**seed.knob_dict, "swiglu": "torch", "wait": "stream", "combine_ctas": 128})
    config = load_program(template.render(variant, template.default_shape(2), 2)).CONFIG
    assert (config["comm_ctas"], config["swiglu"], config["wait"], config["combine_ctas"]) == (32, "torch", "stream", 128)
    assert "overlap" not in config
    values = template.dimension_values(4)
    assert values["knob:experts"] == ("auto", "grouped", "streamed")
    assert values["knob:swiglu"] == ("fused", "torch") and values["comm_ctas"] == (4, 8, 16, 32, 64)
    assert values["knob:combine_ctas"] == (16, 32, 64, 128)


def test_template_admits_fp8_dispatch_under_moe_lossy_only(wl: MoELayer) -> None:
    """moe (bf16 tolerance) admits no compression; moe-lossy declares 4 % and admits E4M3, which its
    template renders into the seed's CONFIG with the group size; E5M2 and groups outside 32..512 not."""
    from commweave.contracts.program import load_program

    seed = wl.template().seed_directives()
    e4m3 = seed.with_(compression="fp8_e4m3", group_size=128)
    assert any("declares no tolerance" in w or "is not admitted" in w for w in wl.template().check(e4m3, 4))
    lossy = MoELayerLossy().template()
    assert lossy.workload.name == "moe-lossy" and lossy.space(4).admitted_compressions() == ("none", "fp8_e4m3")
    assert lossy.check(e4m3, 4) == []
    config = load_program(lossy.render(e4m3.with_(group_size=64), lossy.default_shape(4), 4)).CONFIG
    assert (config["compression"], config["group_size"]) == ("fp8_e4m3", 64)
    assert load_program(lossy.render(seed, lossy.default_shape(4), 4)).CONFIG["compression"] == "none"
    assert any("0.072" in w for w in lossy.check(e4m3.with_(compression="fp8_e5m2"), 4))
    assert any("group_size must be one of 32, 64, 128, 256, 512" in w for w in lossy.check(e4m3.with_(group_size=1024), 4))


def test_seed_refuses_a_bad_compression_config(wl: MoELayer) -> None:
    """CONFIG `compression` and `group_size` are checked in setup, before anything is allocated."""
    from commweave.contracts.program import load_program

    class Ctx:  # setup reads only the world size and rank before its checks
        world_size, rank = 2, 0

    shape = wl.check_shapes(2)[1]
    for config, message in ((dict(compression="int8"), "must be 'none', 'fp8_e4m3' or 'fp8_e5m2'"),
                            (dict(compression="fp8_e4m3", group_size=100), "group_size must be a power of two")):
        module = load_program(with_config(wl.program_text("seed"), **config))
        with pytest.raises(ValueError, match=message):
            module.setup(Ctx(), shape)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [dict(experts="grouped"), dict(experts="grouped", swiglu="torch"), dict(experts="streamed"),
                                    dict(combine_ctas=16, comm_ctas=4), dict(wait="stream", graph=False)])
def test_seed_variants_on_gpus(wl: MoELayer, world: int, config: dict) -> None:
    """Both expert paths (grouped GEMMs with the fused or the torch SwiGLU; the streamed Triton
    pair also where experts get more rows than one tile), few CTAs (many rows per warp) and the
    stream-wait path, on the check shapes and decode at full size."""
    check_on_gpus("moe", "seed", world, [*(s.label for s in wl.check_shapes(world)), "dsv3-T128"], seed=9, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [dict(compression="fp8_e4m3"), dict(compression="fp8_e4m3", group_size=32, experts="streamed")])
def test_seed_fp8_dispatch_on_gpus(world: int, config: dict) -> None:
    """FP8 dispatch under moe-lossy's tolerance: the check shapes (H = 136 pads a row's last group)
    and decode at full size, grouped and streamed experts."""
    lossy = MoELayerLossy()
    check_on_gpus("moe-lossy", "seed", world, [*(s.label for s in lossy.check_shapes(world)), "dsv3-T128"], seed=9,
                  config=config)


INTERPRETED_EXPERTS = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run in numpy on CPU
import torch
import torch.nn.functional as F
from commweave.workloads.moe import experts

g = torch.Generator().manual_seed(0)
# (H, I, rows per expert, tiles): an expert with no rows, one spanning several row tiles, an
# inner size that is no multiple of BLOCK_K, output columns that leave a partial tile
cases = [(136, 40, [3, 0, 40, 5], experts.Tiles(block_m=16, block_n=32, block_k=64, stages=2)),
         (256, 64, [16, 17, 1], experts.Tiles(block_m=32, block_n=16, block_k=128, stages=3))]
for hidden, inter, counts, tiles in cases:
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = int(ends[-1]) + 5  # rows past the last end must stay untouched
    x = torch.randn(rows, hidden, generator=g)
    w13 = torch.randn(len(counts), 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(len(counts), hidden, inter, generator=g) / inter**0.5
    h = experts.gate_up_swiglu(x, w13, ends, tiles, out=torch.full((rows, inter), float("nan")))
    y = experts.down(h, w2, ends, tiles, out=torch.full((rows, hidden), float("nan")))
    start = 0
    for e, end in enumerate(ends.tolist()):
        gate_up = x[start:end] @ w13[e].T
        want_h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        assert torch.allclose(h[start:end], want_h, atol=1e-4, rtol=1e-4), (e, (h[start:end] - want_h).abs().max())
        assert torch.allclose(y[start:end], h[start:end] @ w2[e].T, atol=1e-4, rtol=1e-4), e
        start = end
    assert h[start:].isnan().all() and y[start:].isnan().all()
print("experts ok")
"""


def test_streamed_experts_in_the_triton_interpreter(tmp_path: Path) -> None:
    """The weight-streaming expert kernels (GPU code) run on CPU under TRITON_INTERPRET=1 and equal
    per-expert matmuls: empty experts, several row tiles, ragged inner and output sizes, rows past
    the last end untouched."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = tmp_path / "experts.py"
    script.write_text(INTERPRETED_EXPERTS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "experts ok" in done.stdout, done.stderr[-3000:]


def test_streamed_experts_tiles_and_errors() -> None:
    pytest.importorskip("triton")
    from commweave.workloads.moe import experts

    assert experts.tiles_for(8) == experts.tiles_for(32) == experts.STREAMED_TILES[32]
    assert experts.tiles_for(33) == experts.STREAMED_TILES[64]
    with pytest.raises(ValueError, match="up to 64 rows per expert"):
        experts.tiles_for(65)
    for bad, message in ((dict(block_m=24), "block_m must be a power of two"), (dict(block_k=8), "block_k must be"),
                         (dict(stages=0), "stages must be at least 1"), (dict(warps=3), "warps must be one of")):
        with pytest.raises(ValueError, match=message):
            experts.Tiles(**bad)
    x, w13, ends = torch.zeros(4, 16), torch.zeros(2, 8, 16), torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree on the inner size"):
        experts.gate_up_swiglu(x, torch.zeros(2, 8, 32), ends)
    with pytest.raises(ValueError, match="one entry per expert"):
        experts.gate_up_swiglu(x, w13, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="an even count"):
        experts.gate_up_swiglu(x, torch.zeros(2, 7, 16), ends)
    with pytest.raises(ValueError, match="out must be"):
        experts.down(torch.zeros(4, 16), torch.zeros(2, 8, 16), ends, out=torch.zeros(4, 9))
    with pytest.raises(ValueError, match="contiguous along the inner"):
        experts.down(torch.zeros(16, 4).T, torch.zeros(2, 8, 16), ends)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,experts_n,rows_per_expert", [(136, 40, 16, 33), (7168, 2048, 64, 16), (7168, 2048, 8, 70)])
def test_streamed_experts_on_gpu(hidden: int, inter: int, experts_n: int, rows_per_expert: int) -> None:
    """The streamed pair in bf16 on one GPU against per-expert fp32 matmuls of the same bf16
    operands: random rows per expert (some empty, some over a row tile), NaN-poisoned outputs past
    the last end left untouched, relative error within the bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from commweave.workloads.moe import experts

    g = torch.Generator(device="cuda").manual_seed(hidden + experts_n)
    counts = torch.randint(0, 2 * rows_per_expert + 1, (experts_n,), generator=g, device="cuda")
    counts[0] = 0
    ends = counts.cumsum(0).to(torch.int32)
    rows = int(ends[-1]) + 7
    x = torch.randn(rows, hidden, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(experts_n, 2 * inter, hidden, generator=g, device="cuda") / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts_n, hidden, inter, generator=g, device="cuda") / inter**0.5).bfloat16()
    tiles = experts.tiles_for(min(rows_per_expert, experts.STREAMED_MAX_ROWS))
    h = experts.gate_up_swiglu(x, w13, ends, tiles[0], out=torch.full((rows, inter), float("nan"), device="cuda").bfloat16())
    y = experts.down(h, w2, ends, tiles[1], out=torch.full((rows, hidden), float("nan"), device="cuda").bfloat16())
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            gate_up = x[start:end].float() @ w13[e].float().T
            want_h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            want_y = h[start:end].float() @ w2[e].float().T
            for got, want in ((h[start:end].float(), want_h), (y[start:end].float(), want_y)):
                error = ((got - want).norm() / want.norm()).item()
                assert error < 1e-2, f"expert {e}: relative error {error:.3g}"
        start = end
    assert h[start:].isnan().all() and y[start:].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens,hidden,group,fmt", [(1, 136, 128, "e4m3"), (67, 256, 32, "e5m2"), (128, 7168, 128, "e4m3")])
def test_seed_fp8_rows_round_trip_on_gpu(wl: MoELayer, tokens: int, hidden: int, group: int, fmt: str) -> None:
    """The FP8 dispatch's two ends on one GPU (the NVLink copy between them moves bytes as they are):
    TACO's compress kernel packs each token row as the seed calls it (one row alone: no padding to
    16 bytes), and moe_dequant unpacks exactly the rows counted in cnt into taco.quant's round trip
    of each row, bit for bit, leaving the rows past them untouched."""
    from commweave.runtime.launch import Module
    from commweave.taco import cuda as taco_cuda

    module = Module(compile_cubin(parse_program(wl.program_text("seed")).cuda_sources["CUDA_SRC"]).path, "moe_seed")
    cfg = QuantConfig(group, fmt, hadamard=False, dual_scale=False)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    x[0, :group] = 0  # a zero group: scale 1
    wire = cfg.packed_stride(hidden)
    xq = torch.full((tokens * wire,), 0xEE, dtype=torch.uint8, device="cuda")
    taco_cuda.compress_into(x, cfg, xq if tokens > 1 else xq[:cfg.wire_bytes(hidden)], segments=tokens)
    cnt = torch.tensor([[tokens // 2, 0], [0, tokens - tokens // 2]], dtype=torch.int64, device="cuda")  # rows: their sum
    pool = torch.full((tokens + 5, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    module.kernel("moe_dequant").launch(132, 256, [xq, pool, cnt, cnt.numel(), hidden, group,
                                                   cfg.num_groups(hidden) * group, wire, int(fmt == "e5m2")])
    torch.cuda.synchronize()
    want = torch.stack([roundtrip(row, cfg) for row in x])
    assert torch.equal(pool[:tokens].view(torch.int16), want.view(torch.int16))
    assert pool[tokens:].isnan().all()
