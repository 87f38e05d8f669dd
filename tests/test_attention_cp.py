"""CPU checks of the attention-cp workload: sharding and load balance, the LSE merge, the
reference, shapes, programs (parsing, CUDA compiles, the seed's copy path and piece plan on the
host) and the host baselines over gloo on CPU workers. `pytest -m gpu` runs every program on GPUs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cuda_host import run_host_check, toolchain_or_skip
from program_jobs import check_on_gpus
from commweave.contracts.program import load_program, parse_program
from commweave.runtime import WorkerPool
from commweave.runtime.compile import compile_cubin
from commweave.workloads.attention_cp.attention import (
    attention_with_lse, block_kind, chunked_attention, merge_into, merge_partials, merge_two, piece_plan, shard_positions,
    shard_ranges, visible_pairs,
)
from commweave.workloads.attention_cp.workload import AttentionCP

CPU = torch.device("cpu")
PROGRAMS = ("allgather", "host", "seed", "seed_pull", "torch_cp")
HOST_PROGRAMS = ("host", "allgather")


@pytest.fixture(scope="module")
def wl() -> AttentionCP:
    return AttentionCP()


def _sdpa(q, k, v, causal=False):
    """torch's own attention on [S, H, D] tensors, float32, as an independent check."""
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                       v.float().transpose(0, 1)[None], is_causal=causal,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def _qkv(sq, sk, hq, hkv, d, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(sq, hq, d, generator=gen) * scale, torch.randn(sk, hkv, d, generator=gen),
            torch.randn(sk, hkv, d, generator=gen))


# -- sharding and load balance --------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_shards_cover_sequence_once(world: int, causal: bool) -> None:
    seq = 8 * 12
    positions = torch.cat([shard_positions(seq, world, r, causal) for r in range(world)])
    assert torch.equal(positions.sort().values, torch.arange(seq))
    for r in range(world):
        assert len(shard_positions(seq, world, r, causal)) == seq // world
    if causal:  # zigzag: rank r holds chunks r and 2W-1-r, in that order
        c = seq // (2 * world)
        assert shard_ranges(seq, world, 1, True) == [(c, 2 * c), ((2 * world - 2) * c, (2 * world - 1) * c)]
    else:
        assert shard_ranges(seq, world, 1, False) == [(seq // world, 2 * seq // world)]


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_balances_causal_work(world: int) -> None:
    seq = 2 * world * 37
    pairs = [visible_pairs(seq, world, r, True) for r in range(world)]
    assert len(set(pairs)) == 1, pairs
    assert sum(pairs) == seq * (seq + 1) // 2
    # brute force: pairs (q, k) with k <= q among this rank's queries
    pos = shard_positions(seq, world, world - 1, True)
    assert pairs[0] == int((pos + 1).sum())
    # contiguous shards would not balance: the last rank would do 2W-1 times the first's work
    assert [visible_pairs(seq, world, r, False) for r in range(world)] == [seq * seq // world] * world


def test_shard_errors() -> None:
    with pytest.raises(ValueError, match="not a positive multiple of 2 x world size"):
        shard_ranges(100, 4, 0, True)
    with pytest.raises(ValueError, match="not a positive multiple of the world size = 3"):
        shard_ranges(100, 3, 0, False)
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4"):
        shard_ranges(64, 4, 4, False)


def test_block_kind() -> None:
    assert block_kind((10, 20), (30, 40), False) == "full"
    assert block_kind((10, 20), (0, 10), True) == "full"
    assert block_kind((10, 20), (20, 30), True) == "skip"
    assert block_kind((10, 20), (10, 20), True) == "causal"
    assert block_kind((10, 20), (5, 15), True) == "partial"
    # every pair of zigzag chunks is full, diagonal or skipped: no program needs a partial mask
    world, seq = 4, 64
    chunks = [rng for r in range(world) for rng in shard_ranges(seq, world, r, True)]
    assert {block_kind(a, b, True) for a in chunks for b in chunks} == {"full", "causal", "skip"}


# -- block attention and the merge ---------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse(hq: int, hkv: int, causal: bool) -> None:
    q, k, v = _qkv(37, 37, hq, hkv, 24)
    out, lse = attention_with_lse(q, k, v, causal=causal)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == (37, hq)
    assert torch.allclose(out, _sdpa(q, k, v, causal), atol=1e-5)
    group = hq // hkv
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1)) / 24 ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, -1).T, atol=1e-5)


def test_attention_with_lse_errors() -> None:
    q, k, v = _qkv(8, 6, 6, 4, 16)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 KV heads"):
        attention_with_lse(q, k, v)
    q, k, v = _qkv(8, 6, 4, 2, 16)
    with pytest.raises(ValueError, match="causal block must be square"):
        attention_with_lse(q, k, v, causal=True)
    with pytest.raises(ValueError, match="must be \\[seq, heads, dim\\]"):
        attention_with_lse(q[0], k, v)
    with pytest.raises(ValueError, match="backend must be"):
        attention_with_lse(q, k, v, backend="bogus")


@pytest.mark.parametrize("seed", range(3))
def test_merging_blocks_equals_full_attention(seed: int) -> None:
    """Attention over any split of the keys, merged in any order, is attention over all keys."""
    q, k, v = _qkv(29, 101, 8, 2, 16, seed=seed, scale=4.0)
    full, full_lse = attention_with_lse(q, k, v)
    cuts = sorted(torch.randperm(100, generator=torch.Generator().manual_seed(seed))[:4].add(1).tolist())
    bounds = list(zip([0, *cuts], [*cuts, 101]))
    for order in (bounds, bounds[::-1], bounds[1::2] + bounds[::2]):
        acc = torch.zeros(29, 8, 16)
        acc_lse = torch.full((29, 8), float("-inf"))
        for a, b in order:
            o, lse = attention_with_lse(q, k[a:b], v[a:b])
            merge_into(acc, acc_lse, o.bfloat16(), lse)  # partials may come in bf16, as from flash
        assert torch.allclose(acc_lse, full_lse, atol=1e-5)
        assert (acc - full).norm() / full.norm() < 4e-3
    # merging is symmetric, and a block of keys left out changes the result by far more than bf16
    o1, l1 = attention_with_lse(q, k[:50], v[:50])
    o2, l2 = attention_with_lse(q, k[50:], v[50:])
    m12, m21 = merge_partials(o1, l1, o2, l2), merge_partials(o2, l2, o1, l1)
    assert torch.allclose(m12[0], m21[0], atol=1e-6) and torch.allclose(m12[1], m21[1])
    assert torch.allclose(m12[0], full, atol=1e-5)
    assert (o1 - full).norm() / full.norm() > 0.1


def test_merge_fully_masked_rows() -> None:
    """Rows that saw no key (lse -inf, as from a skipped or fully masked block) merge without NaN."""
    out = torch.randn(5, 3, 8)
    lse = torch.randn(5, 3)
    empty_out, empty_lse = torch.zeros(5, 3, 8), torch.full((5, 3), float("-inf"))
    merged, merged_lse = merge_partials(empty_out, empty_lse, out, lse)
    assert torch.allclose(merged, out) and torch.allclose(merged_lse, lse)
    both, both_lse = merge_partials(empty_out, empty_lse, empty_out, empty_lse)
    assert not both.isnan().any() and torch.equal(both, empty_out) and (both_lse == float("-inf")).all()
    # huge LSEs (peaked scores) do not overflow
    big, big_lse = merge_partials(out, lse + 1e4, out * 2, lse + 1e4)
    assert torch.isfinite(big).all() and torch.allclose(big, out * 1.5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot merge"):
        merge_partials(out, lse, out[:4], lse[:4])


def test_chunked_attention_equals_exact() -> None:
    q, k, v = _qkv(48, 48, 4, 2, 16, scale=3.0)
    pos = torch.arange(48)
    for causal in (False, True):
        exact = _sdpa(q, k, v, causal)
        for qb, kb in ((48, 48), (7, 9), (5, 48), (48, 1)):
            assert torch.allclose(chunked_attention(q, k, v, pos, pos, causal, q_block=qb, k_block=kb), exact, atol=1e-5)
    # positions in any order: a shuffled key set gives the same answer under the causal mask
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    got = chunked_attention(q, k[perm], v[perm], pos, pos[perm], True, q_block=13, k_block=11)
    assert torch.allclose(got, _sdpa(q, k, v, True), atol=1e-5)


# -- shapes ---------------------------------------------------------------------------------------
def test_workload_attributes(wl: AttentionCP) -> None:
    assert wl.name == "attention-cp" and wl.world_sizes == (1, 2, 4) and wl.seed == "seed"
    assert wl.baselines == ("host", "allgather", "torch_cp")
    assert wl.program_names() == sorted(PROGRAMS)
    assert wl.dtype == torch.bfloat16 and wl.tolerance() == 1e-2


@pytest.mark.parametrize("world", [2, 4])
def test_bench_shapes(wl: AttentionCP, world: int) -> None:
    shapes = wl.bench_shapes(world)
    labels = [s.label for s in shapes]
    assert len(labels) == len(set(labels)) == 2 * 2 * 2 * 4 + 2 * 2 * 2
    assert "s32768-q32kv8-d128-full" in labels and "s131072-q32kv32-d64-causal" in labels
    assert "cuco-s4096-d32-full" in labels and "cuco-s8192-d64-causal" in labels
    for s in shapes:
        assert wl.parse_shape(s.label, world) == s
        assert s["S"] % (2 * world) == 0 and s["HQ"] % s["HKV"] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_check_shapes(wl: AttentionCP, world: int) -> None:
    shapes = wl.check_shapes(world)
    assert len(shapes) >= 2
    assert {s["CAUSAL"] for s in shapes} == {0, 1}
    assert any(s["HQ"] > s["HKV"] for s in shapes) and any(s["HQ"] == s["HKV"] for s in shapes)
    # zigzag chunks of a size that fits no tile
    assert any((s["S"] // (2 * world)) % 16 for s in shapes if s["CAUSAL"])


def test_parse_shape(wl: AttentionCP) -> None:
    s = wl.parse_shape(" s32768-q32kv8-d128-causal ", 4)
    assert (s["S"], s["HQ"], s["HKV"], s["D"], s["CAUSAL"]) == (32768, 32, 8, 128, 1)
    c = wl.parse_shape("cuco-s4096-d32-full", 2)
    assert (c.label, c["S"], c["D"], c["CAUSAL"]) == ("cuco-s4096-d32-full", 4096, 32, 0)
    bad = {
        "32768x32": "is not 's<S>-q<Hq>kv<Hkv>-d<D>-causal\\|full'",
        "s32768-q32kv8-d128": "is not",
        "s0-q32kv8-d128-full": "sequence length must be positive",
        "s32768-q32kv0-d128-full": "KV heads must be positive",
        "s32768-q32kv12-d128-full": "32 query heads are not a multiple of 12 KV heads",
        "s32768-q32kv8-d100-full": "head dim 100 must be a multiple of 8",
        "s32772-q32kv8-d128-causal": "not a positive multiple of 2 x world size \\(zigzag causal sharding\\) = 8",
        "s32770-q32kv8-d128-full": "not a positive multiple of the world size = 4",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            wl.parse_shape(text, 4)
    with pytest.raises(ValueError, match="runs on 1, 2, 4 GPUs, not 8"):
        wl.parse_shape("s32768-q32kv8-d128-full", 8)


def test_cost(wl: AttentionCP) -> None:
    s = wl.parse_shape("s32768-q32kv8-d128-full", 4)
    c = wl.cost(s, 4)
    assert c.flops == 4 * 8192 * 32768 * 32 * 128 == wl.ideal_flops(s, 4, 0)
    assert c.comm_bytes == 3 * 8192 * 2 * 8 * 128 * 2
    assert c.memory_bytes == (2 * 8192 * 32 * 128 + 2 * 32768 * 8 * 128) * 2
    causal = wl.cost(wl.parse_shape("s32768-q32kv8-d128-causal", 4), 4)
    assert causal.flops == 4 * (32768 * 32769 // 2 // 4) * 32 * 128  # balanced: a quarter of the triangle
    assert causal.comm_bytes == c.comm_bytes


# -- data and reference ---------------------------------------------------------------------------
def test_inputs_deterministic(wl: AttentionCP) -> None:
    s = wl.check_shapes(2)[0]
    x = wl.make_inputs(s, 2, 1, seed=3, device=CPU)
    assert x["q"].shape == (74, 8, 40) and x["k"].shape == x["v"].shape == (74, 2, 40)
    assert all(t.dtype == torch.bfloat16 for t in x.values())
    again = wl.make_inputs(s, 2, 1, seed=3, device=CPU)
    assert all(torch.equal(x[n], again[n]) for n in x)
    for other in (wl.make_inputs(s, 2, 0, seed=3, device=CPU), wl.make_inputs(s, 2, 1, seed=4, device=CPU)):
        assert all(not torch.equal(x[n], other[n]) for n in x)
    out = wl.make_output(s, 2, 1, CPU)
    assert out.shape == (74, 8, 40) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_reference(wl: AttentionCP, world: int, index: int) -> None:
    """The reference is torch's attention over the sequence put back in order, sliced to the rank."""
    s = wl.check_shapes(world)[index]
    causal = bool(s["CAUSAL"])
    shards = [wl.make_inputs(s, world, r, 5, CPU) for r in range(world)]
    pos = torch.cat([shard_positions(s["S"], world, r, causal) for r in range(world)])
    order = torch.empty_like(pos)
    order[pos] = torch.arange(len(pos))  # order[p] = index of global position p in rank-major order
    q, k, v = (torch.cat([x[n] for x in shards])[order] for n in ("q", "k", "v"))
    whole = _sdpa(q, k, v, causal)
    for rank in range(world):
        got = wl.reference(s, world, rank, 5, CPU)
        want = whole[shard_positions(s["S"], world, rank, causal)]
        assert got.dtype == torch.float32 and got.shape == (s["S"] // world, s["HQ"], s["D"])
        assert torch.allclose(got, want, atol=2e-5)
        assert 0.1 < got.std().item() < 2.0


def test_reference_chunked_for_large(wl: AttentionCP, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above EXACT_LIMIT the reference is tiled; the tiles must give the same answer."""
    import commweave.workloads.attention_cp.workload as module

    s = wl.parse_shape("s4096-q2kv1-d8-causal", 2)
    exact = wl.reference(s, 2, 1, 1, CPU)
    monkeypatch.setattr(module, "EXACT_LIMIT", 0)  # 2048 x 8192 tiles: the 2048 queries in one, keys whole
    tiled = wl.reference(s, 2, 1, 1, CPU)
    assert torch.allclose(exact, tiled, atol=1e-5)


# -- programs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PROGRAMS)
def test_program_parses(wl: AttentionCP, name: str) -> None:
    parsed = parse_program(wl.program_text(name))
    assert {"setup", "run"} <= parsed.functions
    assert bool(parsed.cuda_sources) == name.startswith("seed")


def _seed_cuda() -> str:
    return parse_program(AttentionCP().program_text("seed")).cuda_sources["CUDA_SRC"]


def test_seed_cuda_compiles() -> None:
    toolchain_or_skip()
    artifact = compile_cubin(_seed_cuda())
    assert artifact.path.exists()
    for kernel in ("cw_kv_gather_push", "cw_kv_wait"):
        assert f"'{kernel}'" in artifact.log
    assert set(re.findall(r"(\d+) bytes stack frame", artifact.log)) == {"0"}


def test_every_cuda_source_compiles(wl: AttentionCP) -> None:
    toolchain_or_skip()
    for name in PROGRAMS:
        for source in parse_program(wl.program_text(name)).cuda_sources.values():
            assert compile_cubin(source).path.exists()


# The push kernel's scatter compiled for the host: every rank's K and V segments land at the rows
# `dest` names in each receiver's kv_seq ([2][total][units]), the own shard only when include_self,
# and nothing else is written.
COPY_CHECK_MAIN = r"""
#include <cstdio>
#include <vector>

int main() {
  int cases = 0, bad = 0;
  const int world_sizes[] = {2, 4, 8};
  const long long seg_rows_list[] = {1, 37, 64};
  const long long units_list[] = {1, 5, 16};
  const size_t thread_counts[] = {1, 7, 64};
  for (int world : world_sizes)
  for (long long seg_rows : seg_rows_list)
  for (long long units : units_list)
  for (int segments = 1; segments <= 2; segments++)
  for (size_t nthreads : thread_counts)
  for (int me = 0; me < world; me++) {
    const int include_self = segments == 2;
    const long long total = (long long)world * segments * seg_rows;
    const size_t shard = (size_t)(segments * seg_rows * units), seq = (size_t)(total * units);
    std::vector<uint4> k(shard), v(shard), kv((size_t)world * 2 * seq);
    for (size_t i = 0; i < shard; i++) {
      k[i] = make_uint4((unsigned)i, (unsigned)me, 1u, 7u);
      v[i] = make_uint4((unsigned)i, (unsigned)me, 2u, 9u);
    }
    for (auto& x : kv) x = make_uint4(0xEE, 0xEE, 0xEE, 0xEE);
    CwRows dest;  // receiver r gets segment s at rows ((me - r) mod W) * segments * seg_rows + s * seg_rows
    for (int r = 0; r < world; r++)
      for (int s = 0; s < segments; s++) dest.row[r][s] = (((me - r) % world + world) % world) * segments * seg_rows + s * seg_rows;
    std::vector<int> got(world, 0);
    for (int phase = 0; phase < world - 1 + include_self; phase++) {  // the loop of cw_kv_gather_push
      int to = cw_receiver(me, world, phase);
      got[to]++;
      for (size_t tid = 0; tid < nthreads; tid++)
        cw_scatter_shard(k.data(), v.data(), &kv[(size_t)to * 2 * seq], dest.row[to][0], dest.row[to][1], segments, seg_rows, units, total, tid, nthreads);
    }
    for (int r = 0; r < world; r++) {
      if (got[r] != (r != me || include_self)) { bad++; continue; }
      for (size_t i = 0; i < 2 * seq; i++) {
        const uint4& x = kv[(size_t)r * 2 * seq + i];
        size_t half = i / seq, row = (i % seq) / units, u = (i % seq) % units;
        uint4 want = make_uint4(0xEE, 0xEE, 0xEE, 0xEE);
        for (int s = 0; s < segments && got[r]; s++) {
          if ((long long)row >= dest.row[r][s] && (long long)row < dest.row[r][s] + seg_rows) {
            size_t src = (size_t)((s * seg_rows + (long long)row - dest.row[r][s]) * units) + u;
            want = half ? v[src] : k[src];
          }
        }
        if (x.x != want.x || x.y != want.y || x.z != want.z || x.w != want.w) { bad++; break; }
      }
    }
    cases++;
  }
  printf("cases %d wrong %d\n", cases, bad);
  return bad != 0;
}
"""


def test_seed_copy_path_on_host(tmp_path: Path) -> None:
    run_host_check(_seed_cuda(), COPY_CHECK_MAIN, tmp_path, "copy_check", timeout_s=120)


@pytest.mark.parametrize("world,index", [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2)])
def test_seed_plan_on_host(wl: AttentionCP, world: int, index: int) -> None:
    """The seed's host logic without GPUs: kv_seq assembled from every sender's `dest_rows` (own
    shard included when causal), then each query segment's local block and remote rows through
    the seed's `_attention` (float32 torch on CPU) and `merge_two` equal the reference, and the
    remote rows hold exactly the keys the plan says (every visible key once)."""
    seed = load_program(wl.program_text("seed"), "seed")
    s = wl.check_shapes(world)[index]
    causal, seq = bool(s["CAUSAL"]), s["S"]
    shards = [wl.make_inputs(s, world, r, 9, CPU) for r in range(world)]
    state = {"scale": s["D"] ** -0.5}
    for rank in range(world):
        kv_seq = torch.full((2, seq, s["HKV"], s["D"]), float("nan"))
        pos = torch.full((seq,), -1)
        for sender in range(world):
            if sender == rank and not causal:
                continue
            ranges = shard_ranges(seq, world, sender, causal)
            row = 0
            for (a, b), first in zip(ranges, seed.dest_rows(s, world, sender)[rank]):
                kv_seq[0, first:first + b - a] = shards[sender]["k"][row:row + b - a]
                kv_seq[1, first:first + b - a] = shards[sender]["v"][row:row + b - a]
                pos[first:first + b - a] = torch.arange(a, b)
                row += b - a
        q, k, v = shards[rank]["q"], shards[rank]["k"], shards[rank]["v"]
        out = torch.empty(seq // world, s["HQ"], s["D"])
        seen = []
        for blk, (a, b) in zip(seed.blocks(s, world, rank), shard_ranges(seq, world, rank, causal)):
            r0, r1 = blk["row"], blk["row"] + blk["rows"]
            kr = slice(r0, r1) if causal else slice(None)
            o_local, lse_local = seed._attention(state, q[r0:r1], k[kr], v[kr], causal)
            local_keys = torch.arange(a, b) if causal else shard_positions(seq, world, rank, False)
            if blk["remote"] is None:
                out[r0:r1] = o_local
                seen.append(local_keys)
                continue
            k0, k1 = blk["remote"]
            remote = pos[k0:k1]
            assert (remote >= 0).all() and (remote < a if causal else remote >= 0).all()
            seen.append(torch.cat([local_keys, remote]))
            o_remote, lse_remote = seed._attention(state, q[r0:r1], kv_seq[0, k0:k1], kv_seq[1, k0:k1], False)
            merge_two(out[r0:r1], o_local, lse_local, o_remote, lse_remote)
        for keys, (a, b) in zip(seen, shard_ranges(seq, world, rank, causal)):  # every visible key once
            assert torch.equal(keys.sort().values, torch.arange(b if causal else seq))
        ref = wl.reference(s, world, rank, 9, CPU)
        assert (out - ref).norm() / ref.norm() < 1e-4


@pytest.mark.parametrize("world,index,chunks,accumulate,q_block", [(2, 0, 1, "float32", 0), (4, 0, 3, "float32", 0),
                                                                   (4, 2, 2, "out", 0), (2, 1, 200, "float32", 0),
                                                                   (2, 0, 2, "out", 0), (4, 1, 2, "out", 7), (2, 0, 3, "out", 5)])
def test_seed_pull_plan_on_host(wl: AttentionCP, world: int, index: int, chunks: int, accumulate: str, q_block: int) -> None:
    """The pull seed's plan (`piece_plan`) and its `_attend` on CPU:
    the local blocks plus its pull order's pieces, each copied into a slot as `cw_kv_pull` does,
    cover every key once and merge to the reference, into a float32 accumulator or straight into
    the bf16 output (within bf16 rounding), whole segments or q_block queries a call (causal
    diagonal blocks whole). chunks=200 leaves pieces empty."""
    pull = load_program(wl.program_text("seed_pull"), "seed_pull")
    pull.CONFIG["q_block"] = q_block
    s = wl.check_shapes(world)[index]
    causal = bool(s["CAUSAL"])
    shards = [wl.make_inputs(s, world, r, 4, CPU) for r in range(world)]
    for rank in range(world):
        q_segments, pieces = piece_plan(s["S"], world, rank, causal, chunks)
        order = [((rank - j) % world, p) for j in range(1, world) for p, ((a, b), _) in enumerate(pieces[(rank - j) % world]) if b > a]
        acc = torch.zeros(s["S"] // world, s["HQ"], s["D"], dtype=torch.float32 if accumulate == "float32" else torch.bfloat16)
        state = {"lse": torch.full((s["S"] // world, s["HQ"]), float("-inf")), "causal": causal, "scale": s["D"] ** -0.5}
        q, k, v = shards[rank]["q"], shards[rank]["k"], shards[rank]["v"]
        for (a, b), row in q_segments:
            pull._attend(state, acc, q, k[row:row + b - a], v[row:row + b - a], (a, b), q_segments)
        rows = max(b - a for r in range(world) for (a, b), _ in pieces[r])
        slot = torch.full((2, rows, s["HKV"], s["D"]), float("nan"), dtype=torch.bfloat16)
        covered = [shard_positions(s["S"], world, rank, causal)]
        for src, p in order:
            (a, b), row = pieces[src][p]
            slot[0, :b - a] = shards[src]["k"][row:row + b - a]
            slot[1, :b - a] = shards[src]["v"][row:row + b - a]
            pull._attend(state, acc, q, slot[0, :b - a], slot[1, :b - a], (a, b), q_segments)
            covered.append(torch.arange(a, b))
        assert torch.equal(torch.cat(covered).sort().values, torch.arange(s["S"]))
        ref = wl.reference(s, world, rank, 4, CPU)
        assert (acc.float() - ref).norm() / ref.norm() < (1e-4 if accumulate == "float32" else 5e-3)


PULL_CHECK_MAIN = r"""
#include <cstdio>
#include <vector>

int main() {
  int bad = 0, cases = 0;
  for (size_t n : {0, 1, 5, 63, 64, 1000})
  for (size_t nthreads : {1, 3, 64, 512}) {
    std::vector<uint4> src(n + 1), dst(n + 1, make_uint4(7, 7, 7, 7));
    for (size_t i = 0; i < n + 1; i++) src[i] = make_uint4((unsigned)i, 1, 2, 3);
    for (size_t tid = 0; tid < nthreads; tid++) cw_pull16(src.data(), dst.data(), n, tid, nthreads);
    for (size_t i = 0; i < n; i++) bad += dst[i].x != i || dst[i].w != 3;
    bad += dst[n].x != 7;  // nothing past the end
    cases++;
  }
  printf("cases %d wrong %d\n", cases, bad);
  return bad != 0;
}
"""


def test_seed_pull_copy_on_host(tmp_path: Path) -> None:
    run_host_check(parse_program(AttentionCP().program_text("seed_pull")).cuda_sources["CUDA_SRC"], PULL_CHECK_MAIN, tmp_path, "pull_check", timeout_s=60)


# -- running programs -----------------------------------------------------------------------------
# Spawned workers inherit sys.path (pytest put tests/ on it), so they import program_jobs by name.
@pytest.mark.parametrize("world", [2, 4])
def test_host_programs_on_cpu(wl: AttentionCP, world: int) -> None:
    with WorkerPool(world, device="cpu", job_timeout_s=120) as pool:
        for program in HOST_PROGRAMS:
            for shape in wl.check_shapes(world):
                result = pool.run("program_jobs:run_program_check", workload="attention-cp", program=program, shape_text=shape.label, seed=11)
                assert result.ok, f"{program} {shape}: {result.first_failure()}"
                for value in result.values:
                    assert value["inputs_intact"], f"{program} {shape} modified its inputs"
                    assert value["error"] < wl.tolerance(), f"{program} {shape}: error {value['error']:.3g}"
        if world == 2:
            result = pool.run("program_jobs:program_availability", workload="attention-cp")
            assert result.ok, result.first_failure()
            reasons = result.values[0]
            assert reasons["host"] is None and reasons["allgather"] is None
            assert all("CUDA" in reasons[name] for name in ("seed", "seed_pull", "torch_cp"))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("program", PROGRAMS)
def test_program_on_gpus(wl: AttentionCP, program: str, world: int) -> None:
    check_on_gpus("attention-cp", program, world, [*(s.label for s in wl.check_shapes(world)), "cuco-s4096-d64-causal",
                                                    "s16384-q32kv8-d128-full"], seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [dict(accumulate="float32"), dict(q_block=1024, chunks=4, slots=1)])
def test_seed_pull_variants_on_gpus(wl: AttentionCP, world: int, config: dict) -> None:
    """The pull seed with a float32 accumulator (the default merges into the bf16 output), and with
    1024 queries an attention call, four pieces per segment and a single slot (every pull waits for
    the previous piece's attention)."""
    check_on_gpus("attention-cp", "seed_pull", world, [*(s.label for s in wl.check_shapes(world)), "s16384-q32kv8-d128-causal"],
                  seed=6, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("native_gqa", [False, True])
@pytest.mark.parametrize("causal,d", [(False, 128), (True, 128), (False, 40), (True, 64)])
def test_gpu_attention_backends(backend: str, native_gqa: bool, causal: bool, d: int) -> None:
    """cuDNN and flash on one GPU against the float32 math: outputs, and LSEs in natural log."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    q, k, v = (t.cuda().bfloat16() for t in _qkv(300, 300, 8, 2, d, seed=3))
    want, want_lse = attention_with_lse(q.float(), k.float(), v.float(), causal=causal, backend="torch")
    try:
        out, lse = attention_with_lse(q, k, v, causal=causal, backend=backend, native_gqa=native_gqa)
    except RuntimeError as exc:  # a kernel refusing a layout is an answer too, as long as it is said
        pytest.skip(f"{backend} (native_gqa={native_gqa}, d={d}) refused: {str(exc).splitlines()[0]}")
    assert out.shape == q.shape and lse.shape == (300, 8)
    assert (out.float() - want).norm() / want.norm() < 1e-2
    assert torch.allclose(lse.float(), want_lse, atol=2e-2)


@pytest.mark.gpu
def test_gpu_merge_two() -> None:
    """The Triton merge equals the torch merge, on strided partials as the attention kernels return
    them, and rows that saw no key stay 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    q, k, v = (t.cuda().bfloat16() for t in _qkv(129, 200, 8, 2, 40, seed=5))
    o_a, lse_a = attention_with_lse(q, k[:77], v[:77])
    o_b, lse_b = attention_with_lse(q, k[77:], v[77:])
    lse_b[5] = float("-inf")
    lse_a[5] = float("-inf")
    want = merge_partials(o_a, lse_a, o_b, lse_b)[0]
    out = torch.full_like(q, float("nan"))
    merge_two(out, o_a, lse_a, o_b, lse_b)
    assert torch.allclose(out.float(), want, atol=1e-2) and (out[5] == 0).all()
    acc, acc_lse = torch.zeros(129, 8, 40, device="cuda"), torch.full((129, 8), float("-inf"), device="cuda")
    merge_into(acc, acc_lse, o_a, lse_a)  # the fused in-place kernel on CUDA
    merge_into(acc, acc_lse, o_b, lse_b)
    assert torch.allclose(acc, want, atol=1e-2) and (acc[5] == 0).all()
    out_acc, out_lse = torch.zeros_like(q), torch.full((129, 8), float("-inf"), device="cuda")  # bf16: the output itself
    merge_into(out_acc, out_lse, o_a, lse_a)
    merge_into(out_acc, out_lse, o_b, lse_b)
    assert torch.allclose(out_acc.float(), want, atol=1e-2) and (out_acc[5] == 0).all() and torch.equal(out_lse, acc_lse)


INTERPRETED_MERGES = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run in numpy on CPU
import torch
from commweave.workloads.attention_cp.attention import attention_with_lse, merge_partials
from commweave.workloads.attention_cp.merge_kernel import merge_into_acc, merge_two_cuda

g = torch.Generator().manual_seed(0)
q = torch.randn(37, 8, 40, generator=g)
k, v = torch.randn(50, 2, 40, generator=g), torch.randn(50, 2, 40, generator=g)
o_a, lse_a = attention_with_lse(q, k[:20], v[:20])
o_b, lse_b = attention_with_lse(q, k[20:], v[20:])
lse_a[3], lse_b[3] = float("-inf"), float("-inf")  # a row that saw no key on either side
want, want_lse = merge_partials(o_a, lse_a, o_b, lse_b)
out = torch.full_like(q, float("nan"))
merge_two_cuda(out, o_a, lse_a, o_b.transpose(0, 1).contiguous().transpose(0, 1), lse_b)  # strided partial
assert (out - want).abs().max() < 1e-5 and (out[3] == 0).all()
acc = torch.zeros(37, 8, 40)[:, :, :]
acc_lse = torch.full((37, 8), float("-inf"))
merge_into_acc(acc, acc_lse, o_a, lse_a)
merge_into_acc(acc, acc_lse, o_b.bfloat16().float(), lse_b)
want_b, want_lse_b = merge_partials(o_a, lse_a, o_b.bfloat16().float(), lse_b)
assert (acc - want_b).abs().max() < 1e-5 and (acc[3] == 0).all()
fin = torch.isfinite(want_lse_b)
assert torch.equal(fin, torch.isfinite(acc_lse)) and (acc_lse[fin] - want_lse_b[fin]).abs().max() < 1e-5
print("merges ok")
"""


def test_merge_kernels_in_the_triton_interpreter(tmp_path: Path) -> None:
    """The Triton merges (GPU code) run on CPU under TRITON_INTERPRET=1 and equal the torch merge,
    strided partials and rows that saw no key included."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    script = tmp_path / "merges.py"
    script.write_text(INTERPRETED_MERGES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "merges ok" in done.stdout, done.stderr[-3000:]
