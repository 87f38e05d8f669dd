"""CPU checks of the gemm-allgather workload: shapes, data, reference, programs, CUDA sources.

The GPU-only parts (the seed's kernels, torch's async TP) are compiled here and their copy logic
is run on the host; `pytest -m gpu` runs every program on the GPUs themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cuda_host import run_host_check, toolchain_or_skip
from program_jobs import check_on_gpus
from commweave.contracts.program import parse_program
from commweave.contracts.workload import bf16_product
from commweave.runtime import WorkerPool
from commweave.runtime.compile import compile_cubin
from commweave.workloads import get_workload
from commweave.workloads.gemm_allgather.workload import GemmAllGather

CPU = torch.device("cpu")
PROGRAMS = ("host", "torch_async_tp", "seed")


@pytest.fixture(scope="module")
def wl() -> GemmAllGather:
    return GemmAllGather()


# -- shapes ---------------------------------------------------------------------------------------
def test_registered(wl: GemmAllGather) -> None:
    assert isinstance(get_workload("gemm-allgather"), GemmAllGather)
    assert wl.baselines == ("host", "torch_async_tp") and wl.seed == "seed" and wl.world_sizes == (1, 2, 4)
    assert wl.program_names() == sorted(PROGRAMS)


@pytest.mark.parametrize("world", [2, 4])
def test_bench_shapes(wl: GemmAllGather, world: int) -> None:
    shapes = wl.bench_shapes(world)
    assert [s.label for s in shapes] == [
        "2048x2048x2048", "4096x4096x4096", "8192x8192x8192", "16384x16384x16384",
        "llama70b-M4096", "llama70b-M8192", "llama70b-M16384",
    ]
    llama = shapes[5]
    assert (llama["M"], llama["N"] // world, llama["K"]) == (8192, 3584, 8192)
    for s in shapes:
        assert wl.parse_shape(s.label, world) == s


@pytest.mark.parametrize("world", [2, 4])
def test_check_shapes(wl: GemmAllGather, world: int) -> None:
    shapes = wl.check_shapes(world)
    assert len(shapes) >= 2
    for s in shapes:
        assert s["M"] % world == 0 and s["N"] % world == 0
    odd = [s for s in shapes if all((d % 16) for d in (s["M"] // world, s["N"] // world, s["K"]))]
    assert odd, "one check shape must fit no tile size in any dimension"
    # The seed copies rows with 16-byte vectors: a row of K bf16 must be shorter than a multiple of 16.
    assert any(s["K"] * 2 % 16 for s in shapes)


def test_parse_shape(wl: GemmAllGather) -> None:
    s = wl.parse_shape(" 4096x8192X1024 ", 4)
    assert (s.label, s["M"], s["N"], s["K"]) == ("4096x8192x1024", 4096, 8192, 1024)
    assert wl.parse_shape("llama70b-M4096", 2)["N"] == 3584 * 2
    bad = {
        "4096x4096": "not 'MxNxK'",
        "ax4x4": "not 'MxNxK'",
        "0x4096x4096": "M must be positive",
        "4096x4096x-8": "K must be positive",
        "4098x4096x4096": "M=4098 is not divisible by the world size 4",
        "4096x4094x4096": "N=4094 is not divisible by the world size 4",
        "llama70b-M4099": "M=4099 is not divisible",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            wl.parse_shape(text, 4)
    with pytest.raises(ValueError, match="runs on 1, 2, 4 GPUs, not 3"):
        wl.parse_shape("96x96x96", 3)


def test_cost(wl: GemmAllGather) -> None:
    s = wl.parse_shape("8192x8192x8192", 4)
    c = wl.cost(s, 4)
    assert c.flops == 2 * 8192 * 2048 * 8192
    assert c.comm_bytes == 3 / 4 * 8192 * 8192 * 2
    assert c.memory_bytes == (8192 * 8192 + 8192 * 2048 + 8192 * 2048) * 2
    assert c.wire_ratio == 1.0
    # gemm-allgather-lossy: the same work, but its floor's link term counts A's rows as FP8 with a
    # scale per 512 values (the most compressed gather its tolerance admits)
    lossy = get_workload("gemm-allgather-lossy").cost(s, 4)
    assert (lossy.flops, lossy.comm_bytes, lossy.memory_bytes) == (c.flops, c.comm_bytes, c.memory_bytes)
    assert lossy.comm_bytes * lossy.wire_ratio == pytest.approx(3 / 4 * 8192 * (8192 + 4 * 16))


# -- data and reference ---------------------------------------------------------------------------
def test_inputs_deterministic(wl: GemmAllGather) -> None:
    s = wl.parse_shape("64x32x48", 2)
    x = wl.make_inputs(s, 2, 1, seed=3, device=CPU)
    assert x["a"].shape == (32, 48) and x["b"].shape == (48, 16)
    assert x["a"].dtype == x["b"].dtype == torch.bfloat16
    again = wl.make_inputs(s, 2, 1, seed=3, device=CPU)
    assert all(torch.equal(x[k], again[k]) for k in x)
    for other in (wl.make_inputs(s, 2, 0, seed=3, device=CPU), wl.make_inputs(s, 2, 1, seed=4, device=CPU)):
        assert not torch.equal(x["a"], other["a"]) and not torch.equal(x["b"], other["b"])
    # b ~ randn/sqrt(K) keeps the product's entries O(1)
    assert 0.5 < wl.reference(s, 2, 1, 3, CPU).std().item() < 2.0
    out = wl.make_output(s, 2, 1, CPU)
    assert out.shape == (64, 16) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("world", [2, 4])
def test_reference(wl: GemmAllGather, world: int) -> None:
    s = wl.check_shapes(world)[0]
    for rank in range(world):
        shards = [wl.make_inputs(s, world, r, 7, CPU) for r in range(world)]
        a_full = torch.cat([x["a"] for x in shards]).double()
        want = a_full @ shards[rank]["b"].double()
        got = wl.reference(s, world, rank, 7, CPU)
        assert got.dtype == torch.float32 and got.shape == (s["M"], s["N"] // world)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bf16_product_takes_bf16_operands_only() -> None:
    a, b = torch.randn(8, 16).bfloat16(), torch.randn(16, 4).bfloat16()
    assert torch.equal(bf16_product(a, b), a.float() @ b.float())
    with pytest.raises(ValueError, match="bf16 operands"):
        bf16_product(a.float(), b.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 GPU")
def test_bf16_product_on_tensor_cores_is_as_accurate_as_fp32() -> None:
    """1 GPU. The reference's TF32 products of bf16 values are exact: against fp64, its error is
    FP32 accumulation's (~1e-6 relative), far below TF32 rounding of general FP32 operands (~1e-3),
    and the caller's matmul precision is left as it was."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    a, b = (torch.randn(2048, 2048, generator=gen, device="cuda").bfloat16() for _ in range(2))
    want = a.double() @ b.double()
    got = bf16_product(a, b)
    assert torch.get_float32_matmul_precision() == "highest"
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


# -- programs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PROGRAMS)
def test_program_parses(wl: GemmAllGather, name: str) -> None:
    parsed = parse_program(wl.program_text(name))
    assert {"setup", "run"} <= parsed.functions
    assert bool(parsed.cuda_sources) == (name == "seed")


def _seed_cuda() -> str:
    return parse_program(GemmAllGather().program_text("seed")).cuda_sources["CUDA_SRC"]


def test_seed_cuda_compiles() -> None:
    toolchain_or_skip()
    artifact = compile_cubin(_seed_cuda())
    assert artifact.path.exists()
    for kernel in ("cw_ag_push", "cw_ag_wait"):
        assert f"'{kernel}'" in artifact.log
    # the peer pointers must stay in registers: a stack frame means local-memory traffic per store
    assert set(re.findall(r"(\d+) bytes stack frame", artifact.log)) == {"0"}


# The push kernel's copy path compiled for the host: every chunk of every rank's shard must land
# intact in every peer's rows, for row sizes and start offsets of every alignment, any thread split.
COPY_CHECK_MAIN = r"""
#include <cstdio>
#include <vector>

int main() {
  int cases = 0, bad = 0;
  const int world_sizes[] = {2, 4, 8};
  const long long row_bytes_list[] = {406, 392, 400, 528, 2, 6, 16};
  const long long rows_list[] = {1, 3, 67};
  const int chunks_list[] = {1, 2, 3, 5};
  const size_t thread_counts[] = {1, 7, 64};
  for (int world : world_sizes)
  for (long long row_bytes : row_bytes_list)
  for (long long rows : rows_list)
  for (int chunks : chunks_list)
  for (size_t nthreads : thread_counts)
  for (int src_shift = 0; src_shift < 16; src_shift += 2)
  for (int me = 0; me < world; me++) {
    size_t shard = rows * row_bytes, full = shard * world;
    size_t stride = (full + 64 + 63) / 64 * 64;  // peers' windows share their alignment (4 GiB apart)
    std::vector<unsigned char> src(shard + 32), peers((size_t)(world - 1) * stride, 0xEE);
    for (size_t i = 0; i < shard; i++) src[src_shift + i] = (unsigned char)(i * 131 + me * 7 + 1);
    CwPeers to;
    to.count = world - 1;
    for (int p = 0; p < CW_MAX_PEERS; p++) to.dst[p] = p < world - 1 ? (char*)&peers[p * stride + 16] + me * shard : nullptr;
    const char* a_local = (const char*)&src[src_shift];
    for (int c = 0; c < chunks; c++) {  // the loop of cw_ag_push, one thread at a time
      long long r0 = cw_chunk_begin(rows, chunks, c), r1 = cw_chunk_begin(rows, chunks, c + 1);
      CwPeers chunk = to;
      for (int p = 0; p < to.count; p++) chunk.dst[p] += r0 * row_bytes;
      for (size_t tid = 0; tid < nthreads; tid++)
        cw_push_bytes(a_local + r0 * row_bytes, chunk, (size_t)((r1 - r0) * row_bytes), tid, nthreads);
    }
    for (int p = 0; p < world - 1; p++) {
      for (size_t i = 0; i < stride; i++) {
        size_t rel = i - 16 - me * shard;
        bool inside = i >= 16 + me * shard && rel < shard;
        if (peers[p * stride + i] != (inside ? src[src_shift + rel] : 0xEE)) { bad++; break; }
      }
    }
    cases++;
  }
  printf("cases %d wrong %d\n", cases, bad);
  return bad != 0;
}
"""


def test_seed_copy_path_on_host(tmp_path: Path) -> None:
    run_host_check(_seed_cuda(), COPY_CHECK_MAIN, tmp_path, "copy_check")


# -- running programs -----------------------------------------------------------------------------
# Spawned workers inherit this process's sys.path (multiprocessing's spawn passes it on), which
# pytest has given tests/, so they can import the jobs in program_jobs.py by name.
@pytest.fixture(scope="module")
def cpu_pool():
    with WorkerPool(2, device="cpu", job_timeout_s=120) as pool:
        yield pool


def test_host_program_on_cpu(wl: GemmAllGather, cpu_pool: WorkerPool) -> None:
    for shape in wl.check_shapes(2):
        result = cpu_pool.run("program_jobs:run_program_check", workload="gemm-allgather", program="host", shape_text=shape.label, seed=11)
        assert result.ok, result.first_failure()
        for value in result.values:
            assert value["inputs_intact"]
            assert value["error"] < wl.tolerance(), f"{shape}: error {value['error']:.3g}"


def test_device_programs_unavailable_on_cpu(cpu_pool: WorkerPool) -> None:
    result = cpu_pool.run("program_jobs:program_availability", workload="gemm-allgather")
    assert result.ok, result.first_failure()
    reasons = result.values[0]
    assert reasons["host"] is None
    assert "CUDA" in reasons["seed"] and "CUDA" in reasons["torch_async_tp"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("program", PROGRAMS)
def test_program_on_gpus(wl: GemmAllGather, program: str, world: int) -> None:
    check_on_gpus("gemm-allgather", program, world, [*(s.label for s in wl.check_shapes(world)), "8192x8192x8192"], seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [dict(backend="ce", comm_ctas=0), dict(backend="ce", comm_ctas=0, chunks=3, order="broadcast"),
                                    dict(backend="ce", comm_ctas=0, graph=False, wait="stream")])
def test_seed_copy_engine_backend_on_gpus(wl: GemmAllGather, world: int, config: dict) -> None:
    """backend ce: copy-engine copies into peers' windows, flags written by the stream."""
    check_on_gpus("gemm-allgather", "seed", world, [*(s.label for s in wl.check_shapes(world)), "8192x8192x8192"], seed=7,
                  config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [dict(overlap=False), dict(overlap=False, backend="ce", comm_ctas=0)])
def test_seed_deferred_on_gpus(wl: GemmAllGather, world: int, config: dict) -> None:
    """overlap=False (placement deferred, sync global): the whole push, a barrier, then the GEMMs."""
    check_on_gpus("gemm-allgather", "seed", world, [*(s.label for s in wl.check_shapes(world)), "8192x8192x8192"], seed=9,
                  config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", [dict(compression="fp8_e4m3", group_size=128, chunks=2),
                                    dict(compression="fp8_e4m3", group_size=32, chunks=3, order="broadcast", graph=False,
                                         wait="stream", comm_ctas=32)])
def test_seed_compressed_on_gpus(world: int, config: dict) -> None:
    """compression (gemm-allgather-lossy's tolerance): chunks TACO-compressed by the owner, pulled and
    decompressed by each receiver as its flag lands, then multiplied; the error stays under 4 %."""
    lossy = get_workload("gemm-allgather-lossy")
    check_on_gpus("gemm-allgather-lossy", "seed", world, [*(s.label for s in lossy.check_shapes(world)), "8192x8192x8192"],
                  seed=11, config=config)
