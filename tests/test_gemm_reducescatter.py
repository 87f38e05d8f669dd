"""CPU checks of the gemm-reducescatter workload: shapes, data, reference, tolerance, programs through
the evaluator on gloo pools (W = 1, 2, 4), the seed's CUDA (compiled for sm_90, its reduction run on
the host against torch bit for bit), its schedule, and its template.

The workload is constructed directly (its entry point is registered at merge); workers rebuild it
from its module path. `tests/test_gemm_reducescatter_gpu.py` runs the seed on GPUs.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from cuda_host import nvcc_host_build, toolchain_or_skip
from rank_threads import run_rank_threads
from template_samples import renderable_samples
from commweave.contracts.program import load_program, parse_program, with_config
from commweave.contracts.verdict import FailureClass
from commweave.evaluate import Evaluator
from commweave.runtime import WorkerPool
from commweave.runtime.compile import compile_cubin
from commweave.workloads.gemm_reducescatter.template import MAX_CHUNKS, GemmReduceScatterTemplate
from commweave.workloads.gemm_reducescatter.workload import GemmReduceScatter

CPU = torch.device("cpu")
PROGRAMS = ("host", "seed", "torch_async_tp")
WL = GemmReduceScatter()


# -- shapes ---------------------------------------------------------------------------------------
def test_identity() -> None:
    assert WL.name == "gemm-reducescatter" and WL.dtype == torch.bfloat16
    assert WL.world_sizes == (1, 2, 4, 8) and WL.baselines == ("host", "torch_async_tp") and WL.seed == "seed"
    assert WL.program_names() == sorted(PROGRAMS)
    assert isinstance(WL.template(), GemmReduceScatterTemplate)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_bench_shapes(world: int) -> None:
    shapes = WL.bench_shapes(world)
    assert [s.label for s in shapes] == [
        "2048x2048x2048", "4096x4096x4096", "8192x8192x8192", "16384x16384x16384",
        "llama70b-M4096", "llama70b-M8192", "llama70b-M16384",
    ]
    assert [(s["M"], s["N"], s["K"]) for s in shapes[4:]] == [(m, 8192, 28672) for m in (4096, 8192, 16384)]
    for s in shapes:
        assert WL.parse_shape(s.label, world) == s


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_check_shapes(world: int) -> None:
    shapes = WL.check_shapes(world)
    assert len(shapes) >= 2
    for s in shapes:
        assert s["M"] % world == 0 and s["K"] % world == 0
    odd = [s for s in shapes if all(d % 16 for d in (s["M"] // world, s["N"], s["K"] // world))]
    assert odd, "one check shape must fit no tile size in any dimension"
    assert any(s["N"] * 2 % 16 for s in shapes), "rows whose bytes are no multiple of 16 (the reduction's fallbacks)"


def test_parse_shape() -> None:
    s = WL.parse_shape(" 4096x8192X1024 ", 4)
    assert (s.label, s["M"], s["N"], s["K"]) == ("4096x8192x1024", 4096, 8192, 1024)
    assert WL.parse_shape("llama70b-M4096", 8)["K"] == 28672
    assert WL.parse_shape("7x5x3", 1)["M"] == 7  # one rank: any shape
    bad = {
        "4096x4096": "not 'MxNxK'",
        "ax4x4": "not 'MxNxK'",
        "0x4096x4096": "M must be positive",
        "4096x-2x4096": "N must be positive",
        "4098x4096x4096": "M=4098 is not divisible by the world size 4",
        "4096x4094x4094": "K=4094 is not divisible by the world size 4",
        "llama70b-M4099": "M=4099 is not divisible",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            WL.parse_shape(text, 4)
    assert WL.parse_shape("4096x4094x4096", 4)["N"] == 4094  # N is never split
    with pytest.raises(ValueError, match="runs on 1, 2, 4, 8 GPUs, not 3"):
        WL.parse_shape("96x96x96", 3)


def test_cost() -> None:
    s = WL.parse_shape("8192x8192x8192", 4)
    c = WL.cost(s, 4)
    assert c.flops == 2 * 8192 * 8192 * 2048
    assert c.comm_bytes == 3 * 2048 * 8192 * 2  # three peers' partials of this rank's 2048 rows
    assert c.memory_bytes == (8192 * 2048 + 2048 * 8192 + 2048 * 8192) * 2
    assert c.wire_ratio == 1.0
    alone = WL.cost(WL.parse_shape("8192x8192x8192", 1), 1)
    assert alone.comm_bytes == 0 and alone.flops == 2 * 8192**3


def test_shape_from_inputs() -> None:
    a, b = torch.zeros(64, 12, dtype=torch.bfloat16), torch.zeros(12, 40, dtype=torch.bfloat16)
    s = WL.shape_from_inputs({"a": a, "b": b}, 4, 1)
    assert (s["M"], s["N"], s["K"]) == (64, 40, 48) and s == WL.make_shape(64, 40, 48, 4)
    with pytest.raises(ValueError, match="K/W=12 columns, but b"):
        WL.shape_from_inputs({"a": a, "b": b[:5]}, 4, 1)
    with pytest.raises(ValueError, match="a must be torch.bfloat16"):
        WL.shape_from_inputs({"a": a.float(), "b": b}, 4, 1)
    with pytest.raises(ValueError, match="missing input b"):
        WL.shape_from_inputs({"a": a}, 4, 1)
    with pytest.raises(ValueError, match="M=66 is not divisible by the world size 4"):
        WL.shape_from_inputs({"a": torch.zeros(66, 12, dtype=torch.bfloat16), "b": b}, 4, 1)


# -- data, reference, tolerance -------------------------------------------------------------------
def test_inputs_deterministic() -> None:
    s = WL.parse_shape("64x32x48", 2)
    x = WL.make_inputs(s, 2, 1, seed=3, device=CPU)
    assert x["a"].shape == (64, 24) and x["b"].shape == (24, 32)
    assert x["a"].dtype == x["b"].dtype == torch.bfloat16
    again = WL.make_inputs(s, 2, 1, seed=3, device=CPU)
    assert all(torch.equal(x[k], again[k]) for k in x)
    for other in (WL.make_inputs(s, 2, 0, seed=3, device=CPU), WL.make_inputs(s, 2, 1, seed=4, device=CPU)):
        assert not torch.equal(x["a"], other["a"]) and not torch.equal(x["b"], other["b"])
    # b ~ randn/sqrt(K), K global: the sum over ranks has entries of O(1)
    assert 0.5 < WL.reference(s, 2, 1, 3, CPU).std().item() < 2.0
    out = WL.make_output(s, 2, 1, CPU)
    assert out.shape == (32, 32) and out.dtype == torch.bfloat16


def _plain(shape, world: int, seed: int) -> torch.Tensor:
    """The whole product in one process: A and B put back together from every rank's pieces."""
    pieces = [WL.make_inputs(shape, world, r, seed, CPU) for r in range(world)]
    a = torch.cat([p["a"] for p in pieces], dim=1).double()
    b = torch.cat([p["b"] for p in pieces], dim=0).double()
    return a @ b


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_reference_is_the_scattered_product(world: int) -> None:
    s = WL.check_shapes(world)[0]
    full = _plain(s, world, seed=7)
    rows = s["M"] // world
    for rank in range(world):
        got = WL.reference(s, world, rank, 7, CPU)
        assert got.dtype == torch.float32 and got.shape == (rows, s["N"])
        assert torch.allclose(got.double(), full[rank * rows:(rank + 1) * rows], rtol=1e-5, atol=1e-5)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def test_tolerance_admits_bf16_sums_and_catches_a_lost_partial() -> None:
    """At W = 8: bf16 partials summed with a bf16 rounding after every addition (a ring
    reduce-scatter's, measured 0.004) or in fp32 and rounded once stay inside the tolerance; losing
    one partial, or summing another block, is far outside it."""
    world, seed = 8, 5
    s = WL.make_shape(256, 512, 1024, world)
    rows, rank = s["M"] // world, 3
    ref = WL.reference(s, world, rank, seed, CPU)
    partials = [(x["a"].float() @ x["b"].float()).to(torch.bfloat16)
                for x in (WL.make_inputs(s, world, r, seed, CPU) for r in range(world))]
    mine = [p[rank * rows:(rank + 1) * rows] for p in partials]
    ring = mine[0]
    for p in mine[1:]:
        ring = (ring.float() + p.float()).to(torch.bfloat16)
    assert _relative_error(ring, ref) < WL.tolerance() / 2
    once = sum(p.float() for p in mine).to(torch.bfloat16)  # the seed's: fp32 sum, rounded once
    assert _relative_error(once, ref) < WL.tolerance() / 3
    lost = sum(p.float() for p in mine[1:])
    assert _relative_error(lost, ref) > 10 * WL.tolerance()
    other = sum(p[(rank + 1) * rows:(rank + 2) * rows].float() for p in partials)
    assert _relative_error(other, ref) > 10 * WL.tolerance()


# -- programs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PROGRAMS)
def test_program_parses(name: str) -> None:
    parsed = parse_program(WL.program_text(name))
    assert {"setup", "run"} <= parsed.functions
    assert bool(parsed.cuda_sources) == (name == "seed")


def _seed() -> object:
    return load_program(WL.program_text("seed"), "seed")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("order", ["staggered", "aligned"])
def test_seed_schedule(world: int, chunks: int, order: str) -> None:
    """Every rank multiplies every (block, piece) once, round by round; staggered starts each rank
    on a different block and ends on its own, so an owner's piece lands last from itself."""
    seed = _seed()
    plans = [seed.schedule(r, world, chunks, order) for r in range(world)]
    for rank, plan in enumerate(plans):
        assert sorted(plan) == [(b, c) for b in range(world) for c in range(chunks)]
        assert [c for _, c in plan] == sorted(c for _, c in plan)  # round by round
        if order == "staggered":
            assert [b for b, c in plan if c == 0][0] == (rank + 1) % world
            assert all(plan[(c + 1) * world - 1] == (rank, c) for c in range(chunks))
    if order == "staggered":
        for step in range(world * chunks):
            assert len({plan[step][0] for plan in plans}) == world  # no two ranks on one block at once
    with pytest.raises(ValueError, match="'staggered' or 'aligned', not 'ring'"):
        seed.schedule(0, world, chunks, "ring")


def test_seed_pieces_cover_every_row() -> None:
    seed = _seed()
    for rows in (1, 3, 67, 2048):
        for chunks in (1, 2, 4, 5, 64):
            bounds = [seed.chunk_begin(rows, chunks, c) for c in range(chunks + 1)]
            assert bounds[0] == 0 and bounds[-1] == rows and bounds == sorted(bounds)


def _seed_cuda() -> str:
    return parse_program(WL.program_text("seed")).cuda_sources["CUDA_SRC"]


def test_seed_cuda_compiles() -> None:
    toolchain_or_skip()
    artifact = compile_cubin(_seed_cuda())
    assert artifact.path.exists()
    for kernel in ("cw_rs_reduce", "cw_rs_barrier"):
        assert f"'{kernel}'" in artifact.log
    # the source table must stay in registers: a stack frame means local-memory traffic per load
    assert set(re.findall(r"(\d+) bytes stack frame", artifact.log)) == {"0"}


# The reduction's summing path compiled for the host: cases read from a file (sources of one piece,
# their alignment, the output's, the thread split), sums written back for torch to check bit for bit.
REDUCE_CHECK_MAIN = r"""
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  FILE* in = fopen(argv[1], "rb");
  FILE* result = fopen(argv[2], "wb");
  long long h[6];
  int cases = 0, guard = 0;
  while (fread(h, sizeof(long long), 6, in) == 6) {
    long long world = h[0], count = h[1], src_shift = h[2], out_shift = h[3], nthreads = h[4], skew = h[5];
    std::vector<unsigned short> values(world * count);
    if (fread(values.data(), 2, values.size(), in) != values.size()) return 2;
    size_t units = (size_t)(count + 32) / 8 + 1;  // 16-byte aligned storage with room for any shift
    std::vector<std::vector<CwUnit<8>>> bufs(world, std::vector<CwUnit<8>>(units));
    std::vector<CwUnit<8>> out_buf(units);
    CwSources s;
    s.count = (int)world;
    for (int p = 0; p < world; p++) {
      unsigned short* src = reinterpret_cast<unsigned short*>(bufs[p].data()) + src_shift + (skew ? p % 2 : 0);
      for (long long i = 0; i < count; i++) src[i] = values[p * count + i];
      s.src[p] = src;
    }
    unsigned short* all = reinterpret_cast<unsigned short*>(out_buf.data());
    for (size_t i = 0; i < units * 8; i++) all[i] = 0xEEEE;
    unsigned short* out = all + out_shift;
    for (long long tid = 0; tid < nthreads; tid++) cw_sum_piece(s, out, (size_t)count, (size_t)tid, (size_t)nthreads);
    for (size_t i = 0; i < units * 8; i++) {
      bool inside = i >= (size_t)out_shift && i < (size_t)(out_shift + count);
      if (!inside && all[i] != 0xEEEE) { guard++; break; }
    }
    fwrite(out, 2, count, result);
    cases++;
  }
  fclose(result);
  printf("cases %d guard %d\n", cases, guard);
  return guard != 0;
}
"""


def _reduce_cases() -> list[tuple[list[int], torch.Tensor]]:
    """(header, bf16 values [world, count]) for every world, length, alignment and thread split,
    with values that round, overflow to inf, carry inf and NaN, and cancel."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for world in (1, 2, 3, 4, 8):
        for count in (1, 5, 8, 203, 1000):
            for src_shift in (0, 1, 2, 3, 4, 7):
                for out_shift in (0, 1, 4):
                    for nthreads in (1, 3, 64):
                        for skew in (0, 1):
                            values = torch.randn(world, count, generator=gen) * torch.logspace(-3, 3, count)
                            if count >= 8:
                                values[:, 1] = 3.3e38  # sums past bf16's largest finite value
                                values[0, 2], values[-1, 3] = float("inf"), float("nan")
                                values[:, 4] = torch.tensor([(-1.0) ** p for p in range(world)]) * 1e4
                            cases.append(([world, count, src_shift, out_shift, nthreads, skew], values.to(torch.bfloat16)))
    return cases


def test_seed_reduction_on_host_matches_torch(tmp_path: Path) -> None:
    build = nvcc_host_build(_seed_cuda() + REDUCE_CHECK_MAIN, tmp_path, "reduce_check", "-O2")
    assert build.returncode == 0, build.stdout + build.stderr
    cases = _reduce_cases()
    with open(tmp_path / "cases.bin", "wb") as f:
        for header, values in cases:
            f.write(np.asarray(header, dtype=np.int64).tobytes())
            f.write(values.view(torch.int16).numpy().tobytes())
    run = subprocess.run([str(tmp_path / "reduce_check"), str(tmp_path / "cases.bin"), str(tmp_path / "sums.bin")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and f"cases {len(cases)} guard 0" in run.stdout, run.stdout + run.stderr
    sums = torch.from_numpy(np.fromfile(tmp_path / "sums.bin", dtype=np.int16))
    at = 0
    for header, values in cases:
        want = values[0].float()
        for row in values[1:]:
            want = want + row.float()  # fp32, rank order
        got = sums[at:at + values.shape[1]]
        at += values.shape[1]
        want = want.to(torch.bfloat16)
        nan = want.isnan()  # torch's own NaN bits differ between its CPU and CUDA conversions
        assert torch.equal(got.view(torch.bfloat16).isnan(), nan), header
        assert torch.equal(got[~nan], want.view(torch.int16)[~nan]), header
    assert at == sums.numel()


# -- through the evaluator on CPU pools (gloo) ----------------------------------------------------
HOST_WITHOUT_SCATTER = """
import torch
# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}

def run(ctx, state, inputs, out):
    rows = out.shape[0]
    torch.matmul(inputs["a"][ctx.rank * rows:(ctx.rank + 1) * rows], inputs["b"], out=out)  # its own partial only
# EVOLVE-BLOCK-END
"""


@pytest.mark.parametrize("world", [1, 2, 4])
def test_programs_through_the_evaluator_on_cpu(world: int) -> None:
    """The host program passes the cascade's checks (poisoned outputs, fresh inputs, three seeds, both
    check shapes); the seed passes at W = 1 (the plain GEMM) and says why it cannot run on CPU
    beyond; a program that skips the reduction is caught wherever there is one."""
    with WorkerPool(world, device="cpu", job_timeout_s=180) as pool:
        evaluator = Evaluator(pool, WL, job_timeout_s=180)
        host = evaluator.check(WL.program_text("host"))
        assert host.ok and "3 seeds on 2 shapes" in host.message, host.message
        seed = evaluator.check(WL.program_text("seed"))
        async_tp = evaluator.check(WL.program_text("torch_async_tp"))
        assert async_tp.failure == FailureClass.UNAVAILABLE and "CUDA" in async_tp.message
        if world == 1:
            assert seed.ok, seed.message
            result = evaluator.evaluate(WL.program_text("seed"), WL.make_shape(64, 48, 32, 1))
            assert result.verdict.ok and result.fitness > 0 and result.baseline == "host", result.verdict.message
            assert result.baselines["torch_async_tp"].verdict.failure == FailureClass.UNAVAILABLE
        else:
            assert seed.failure == FailureClass.UNAVAILABLE and "needs CUDA GPUs" in seed.message
            lazy = evaluator.check(HOST_WITHOUT_SCATTER)
            assert lazy.failure == FailureClass.WRONG_RESULT and "relative error" in lazy.message, lazy.message


# -- template -------------------------------------------------------------------------------------
TEMPLATE = WL.template()
SHAPE = TEMPLATE.default_shape(4)


def test_seed_rendering_is_the_seed() -> None:
    seed = TEMPLATE.seed_directives()
    assert TEMPLATE.check(seed, 4) == []
    rendered = TEMPLATE.render(seed, SHAPE, 4)
    assert load_program(rendered).CONFIG == load_program(WL.program_text("seed")).CONFIG


def test_template_rejects_what_it_does_not_implement() -> None:
    seed = TEMPLATE.seed_directives()
    cases = {
        "ce": (dict(backend="ce", comm_ctas=0, issuer="thread"), "implements backend lsa only"),
        "fused": (dict(placement="fused"), "implements placement in split, deferred only"),
        "deferred with chunk": (dict(placement="deferred", sync="peer"), "pairs placement deferred with sync global"),
        "split with global": (dict(sync="global"), "pairs placement deferred with sync global"),
        "triton": (dict(language="triton"), "implements language cuda only"),
        "warp": (dict(issuer="warp"), "implements issuer cta only"),
        "knob": (dict(knobs={"order": "ring"}), "knob order='ring' is not one of"),
        "threads": (dict(knobs={"threads": 1024}), "knob threads=1024 is not one of"),
    }
    for name, (changes, reason) in cases.items():
        assert any(reason in w for w in TEMPLATE.check(seed.with_(**changes), 4)), (name, TEMPLATE.check(seed.with_(**changes), 4))
    e4m3 = seed.with_(compression="fp8_e4m3", group_size=128)
    assert any("is not admitted" in w for w in TEMPLATE.check(e4m3, 4))
    assert "implements compression none only" in " ".join(TEMPLATE.unsupported(e4m3))
    with pytest.raises(ValueError, match="backend lsa only"):
        TEMPLATE.render(seed.with_(backend="gin"), SHAPE, 4)
    assert "no knob 'extra'" in " ".join(TEMPLATE.unsupported(seed.with_(knobs={"extra": 1})))


def test_template_renders_the_conservative_set() -> None:
    """placement deferred + sync global: every GEMM, one LSA barrier, one reduction (overlap=False),
    one piece per block whatever the chunk bytes."""
    ds = TEMPLATE.seed_directives().with_(placement="deferred", sync="global", chunk_bytes=1 << 20)
    assert TEMPLATE.check(ds, 4) == []
    config = load_program(TEMPLATE.render(ds, SHAPE, 4)).CONFIG
    assert (config["overlap"], config["chunks"]) == (False, 1)
    assert load_program(TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)).CONFIG["overlap"] is True


def test_fast_path_renders_the_conservative_set_unrelaxed() -> None:
    from commweave.agents.fast_path import renderable_conservative

    ds, relaxed = renderable_conservative(TEMPLATE, 4)
    assert relaxed == "" and (ds.placement, ds.sync) == ("deferred", "global")
    assert load_program(TEMPLATE.render(ds, SHAPE, 4)).CONFIG["overlap"] is False


def test_chunk_bytes_become_pieces_per_block() -> None:
    ds = TEMPLATE.seed_directives()
    block = SHAPE["M"] // 4 * SHAPE["N"] * 2  # 32 MiB
    assert TEMPLATE.chunks_for(ds.with_(chunk_bytes=1 << 20), SHAPE, 4) == block >> 20
    assert TEMPLATE.chunks_for(ds.with_(chunk_bytes=64 << 20), SHAPE, 4) == 1
    assert TEMPLATE.chunks_for(ds.with_(chunk_bytes=256 << 10), SHAPE, 4) == MAX_CHUNKS
    assert TEMPLATE.chunks_for(ds.with_(sync="peer", chunk_bytes=1 << 20), SHAPE, 4) == 1
    assert TEMPLATE.chunks_for(ds, TEMPLATE.default_shape(2), 2) == 8  # 64 MiB blocks on 2 GPUs


def test_rendered_samples_parse_carry_their_directives_and_compile() -> None:
    toolchain_or_skip()
    sources = set()
    for ds, text, config in renderable_samples(TEMPLATE, SHAPE, 4, seed=3, tries=40, fixed=("compression", "group_size")):
        assert config["comm_ctas"] == ds.comm_ctas and config["chunks"] == TEMPLATE.chunks_for(ds, SHAPE, 4)
        assert config["overlap"] == (ds.placement == "split")
        assert all(config[k] == v for k, v in ds.knobs)
        sources.update(parse_program(text).cuda_sources.values())
    assert sources
    for source in sources:
        assert compile_cubin(source).path.exists()


def test_seed_rejects_bad_config() -> None:
    """setup's own checks, before anything collective (a fake context of two CUDA ranks)."""

    class TwoRanks:
        world_size, rank, is_cuda = 2, 0, True

    shape = WL.make_shape(64, 64, 64, 2)
    for knobs, reason in ((dict(order="ring"), "'staggered' or 'aligned'"), (dict(wait="spin"), "'kernel' or 'stream'"),
                          (dict(chunks=0), "must both be at least 1"), (dict(threads=1), "at least 2")):
        module = load_program(with_config(WL.program_text("seed"), **knobs))
        with pytest.raises(ValueError, match=reason):
            module.setup(TwoRanks(), shape)


# -- the seed's protocol with W ranks as threads (no GPU) -----------------------------------------
class _Node:
    """What W simulated ranks share: every rank's symmetric allocations (in allocation order, the
    same on every rank) and a barrier. Addresses are the host addresses of their bytes."""

    def __init__(self, world: int):
        self.world = world
        self.allocs: list[list[torch.Tensor]] = [[] for _ in range(world)]
        self.barrier = __import__("threading").Barrier(world, timeout=60)

    def word(self, address: int) -> torch.Tensor:
        """The 64-bit word at `address` in any rank's symmetric memory."""
        for storage in (s for allocs in self.allocs for s in allocs):
            if storage.data_ptr() <= address < storage.data_ptr() + storage.numel():
                offset = address - storage.data_ptr()
                return storage[offset:offset + 8].view(torch.int64)
        raise ValueError(f"address {address:#x} is in no symmetric allocation")


class _Window:
    def __init__(self, index: int, offset: int):
        self.handle, self.offset = index, offset


class _Stream:
    """Streams are program order here: each rank's work runs as it is issued."""

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass


class _Event:
    def record(self, stream: object = None) -> None:
        pass


def _spin(ready, what: str) -> None:
    import time

    deadline = time.monotonic() + 60
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited 60 s for {what}")
        time.sleep(0)


class _RankCtx:
    """One simulated rank's ctx: symmetric memory in the node, kernels as their Python equivalents."""

    is_cuda, device = True, CPU

    def __init__(self, node: _Node, rank: int):
        self.node, self.rank, self.world_size = node, rank, node.world

    def symmetric(self, shape, dtype, zero=True):
        storage = torch.zeros(max(1, int(np.prod(shape))) * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
        self.node.allocs[self.rank].append(storage)
        if zero:
            self.node.barrier.wait()
        return storage.view(dtype).view(shape)

    def _find(self, t: torch.Tensor) -> tuple[int, int]:
        for index, storage in enumerate(self.node.allocs[self.rank]):
            if storage.data_ptr() <= t.data_ptr() < storage.data_ptr() + storage.numel():
                return index, t.data_ptr() - storage.data_ptr()
        raise ValueError("not a symmetric tensor")

    def window(self, t):
        return _Window(*self._find(t))

    def peer_ptrs(self, t):
        index, offset = self._find(t)
        return [self.node.allocs[r][index].data_ptr() + offset for r in range(self.world_size)]

    def dev_comm(self, lsa_barriers=1):
        from types import SimpleNamespace

        return SimpleNamespace(lsa_size=self.world_size, lsa_rank=self.rank)

    def stream(self, name, priority=0):
        return _Stream()

    def compile(self, source, label=""):
        from types import SimpleNamespace

        kernels = {"cw_rs_barrier": self._barrier, "cw_rs_reduce": self._reduce}
        return SimpleNamespace(kernel=lambda name: SimpleNamespace(launch=kernels[name]))

    def _barrier(self, grid, block, args, stream=None):
        self.node.barrier.wait()

    def _reduce(self, grid, block, args, stream=None):
        win, offset, out, count, flags, index, stride, wait, me, world = args
        assert me == self.rank and world == self.world_size and out.numel() == count
        if wait:
            for p in range(world):
                if p != me:
                    _spin(lambda: int(flags[index + p * stride]) != 0, f"rank {p}'s flag {index + p * stride}")
        sources = [self.node.allocs[p][win.handle][offset:offset + 2 * count].view(torch.bfloat16) for p in range(world)]
        total = sources[0].float()
        for s in sources[1:]:
            total = total + s.float()
        out.view(-1).copy_(total.to(torch.bfloat16))


def _simulated_seed(world: int, config: dict, shape, seeds: tuple[int, ...]) -> list[list[float]]:
    """The seed's Python (setup, then a run per seed on one state) on W threads over a _Node: each
    rank's relative error per call; streams, events and the carveout are no-ops, stream writes and
    waits act on the node's memory."""
    from types import SimpleNamespace

    node = _Node(world)
    fake_cuda = SimpleNamespace(Event=_Event, current_stream=lambda device=None: _Stream(),
                                stream=lambda s: __import__("contextlib").nullcontext())

    class FakeTorch:
        cuda = fake_cuda
        _C = SimpleNamespace(_get_sm_carveout_experimental=lambda: None, _set_sm_carveout_experimental=lambda n: None)
        backends = SimpleNamespace(cuda=SimpleNamespace(preferred_blas_library=lambda *a: None))

        def __getattr__(self, name):
            return getattr(torch, name)

    errors: list[list[float]] = [[] for _ in range(world)]

    def rank_main(rank: int) -> None:
        module = load_program(with_config(WL.program_text("seed"), graph=False, **config), f"seed{rank}")
        module.torch = FakeTorch()
        module.stream_write = lambda address, value, stream=None: node.word(address).fill_(value)
        module.stream_wait_geq = lambda address, value, stream=None: _spin(
            lambda: int(node.word(address)) >= value, "a stream wait")
        ctx = _RankCtx(node, rank)
        state = module.setup(ctx, shape)
        for seed in seeds:
            inputs = WL.make_inputs(shape, world, rank, seed, CPU)
            out = torch.full((shape["M"] // world, shape["N"]), float("nan"), dtype=torch.bfloat16)
            module.run(ctx, state, inputs, out)
            errors[rank].append(_relative_error(out, WL.reference(shape, world, rank, seed, CPU)))
        assert not state["flags"].any(), "flags left set after a call"

    run_rank_threads(world, rank_main, node.barrier.abort)
    return errors


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [{}, dict(chunks=1), dict(chunks=100, order="aligned", wait="stream"),
                                    dict(overlap=False)], ids=["seed", "peer", "empty-pieces", "deferred"])
def test_seed_protocol_simulated(world: int, config: dict) -> None:
    """Offsets, flag indices, peer addresses and block arithmetic of the seed's calls: every rank's
    output is the reduced product on consecutive calls with fresh inputs, flags reset after each."""
    shape = WL.check_shapes(world)[0]
    for rank, errs in enumerate(_simulated_seed(world, config, shape, seeds=(3, 4))):
        assert all(e < WL.tolerance() / 3 for e in errs), (rank, errs)
