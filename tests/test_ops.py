"""commweave.ops on CPU: every workload's op on its check shapes against the reference (the seeds
cannot run on CPU, so the ops fall back to the host baselines over gloo, with one warning), a
program file written by `commweave export` loaded with `ops.load`, and clear errors for bad calls
and bad tensors; on GPUs (`-m gpu`), the gemm seed through the op. The jobs live in ops_jobs.py
(workers import them by name)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

import commweave.ops as ops
from commweave.cli import app
from commweave.ops import runner
from commweave.contracts.program import ProgramError
from commweave.runtime import WorkerPool
from commweave.runtime.context import RankContext
from commweave.search import ProgramDB
from commweave.space import directives_of
from commweave.space.template import DIRECTIVES_PREFIX, directives_header
from commweave.workloads import get_workload, registry
from toy_workload import ToyGatherMatmul

WORLD = 2
CPU = torch.device("cpu")
CASES = [(name, shape.label) for name, wl in registry().items() for shape in wl.check_shapes(WORLD)]


@pytest.fixture(scope="module")
def cpu_pool():
    with WorkerPool(WORLD, device="cpu", job_timeout_s=120) as pool:
        yield pool


# -- the ops in a distributed program (gloo workers) -------------------------------------------
@pytest.mark.parametrize("workload,shape", CASES)
def test_op_matches_reference(cpu_pool: WorkerPool, workload: str, shape: str) -> None:
    wl = get_workload(workload)
    result = cpu_pool.run("ops_jobs:op_check", workload=workload, shape_text=shape, seed=3)
    assert result.ok, result.first_failure()
    for value in result.values:
        assert value["device"] == "cpu" and value["inputs_intact"]
        assert value["error"] <= wl.tolerance(), f"{workload} {shape}: error {value['error']:.3g}"


@pytest.fixture(scope="module")
def cpu_pool4():
    with WorkerPool(4, device="cpu", job_timeout_s=120) as pool:
        yield pool


@pytest.mark.parametrize("workload", sorted(registry()))
def test_ops_over_two_pairs_of_ranks(cpu_pool4: WorkerPool, workload: str) -> None:
    """Four ranks, two groups {0, 1} and {2, 3}, each pair its own W = 2 call (and context)."""
    wl = get_workload(workload)
    shape = wl.check_shapes(WORLD)[0].label
    result = cpu_pool4.run("ops_jobs:op_check", workload=workload, shape_text=shape, seed=3, pairs=True)
    assert result.ok, result.first_failure()
    for value in result.values:
        assert value["inputs_intact"] and value["error"] <= wl.tolerance(), f"{workload} {shape}: {value}"


def test_one_context_per_group(cpu_pool4: WorkerPool) -> None:
    result = cpu_pool4.run("ops_jobs:contexts_per_group")
    assert result.ok, result.first_failure()
    for rank, value in enumerate(result.values):
        assert value == {"made": {"pair": (rank % 2, 2, True), "world": (rank, 4, False)}, "after_close": 0,
                         "after_call": 1}, value


def test_seed_falls_back_to_baseline_with_one_warning(cpu_pool: WorkerPool) -> None:
    result = cpu_pool.run("ops_jobs:fallback_warns_once")
    assert result.ok, result.first_failure()
    for said in result.values:
        assert len(said) == 1, said
        assert "gemm-allgather's seed cannot run here" in said[0] and "'host'" in said[0]


def test_bad_calls_raise_clear_errors(cpu_pool: WorkerPool) -> None:
    result = cpu_pool.run("ops_jobs:bad_calls")
    assert result.ok, result.first_failure()
    for rank, got in enumerate(result.values):
        assert got["dtype"].startswith("ValueError: a must be torch.bfloat16, got torch.float32"), got
        assert "K=16 columns, but b [K, N/W] has 15 rows" in got["inner_dim"], got
        assert got["seed_on_cpu"].startswith("RuntimeError: program 'seed' of gemm-allgather cannot run here"), got
        assert "neither a program of gemm-allgather (host, seed, torch_async_tp) nor a file" in got["unknown_program"], got
        assert "causal must be True or False" in got["causal_not_bool"], got
        if rank % 2:
            assert "decode destination of its pair: it receives pages and takes no kv" in got["kv_on_destination"], got
        assert got["ranks_disagree"].startswith("ValueError: ranks called gemm-allgather with different programs or shapes"), got
        assert "rank 0: gemm-allgather program 'host' on 16x8x16; rank 1: gemm-allgather program 'host' on 20x8x16" in \
            got["ranks_disagree"], got
        assert float(got["after"]) <= get_workload("gemm-allgather").tolerance(), got


def test_close_frees_and_the_next_call_starts_over(cpu_pool: WorkerPool) -> None:
    result = cpu_pool.run("ops_jobs:close_and_start_over")
    assert result.ok, result.first_failure()
    for value in result.values:
        assert value["new_context"] and value["states"] == 1, value
        assert value["error"] <= get_workload("gemm-allgather").tolerance()


def test_export_writes_a_program_ops_load_runs(cpu_pool: WorkerPool, tmp_path: Path) -> None:
    wl = get_workload("gemm-allgather")
    run = tmp_path / "run.sqlite"
    # A run whose best program is the host baseline (with a directive line), so it runs on CPU.
    code = directives_header(get_workload("gemm-allgather").template().seed_directives()) + wl.program_text("host")
    with ProgramDB(run) as db:
        db.set_meta(workload="gemm-allgather", shape="1024x1024x512", gpus=WORLD)
        best_id = db.add_program(code=code, directives=None, island=0, generation=0, status="ok", fitness=1.25,
                                 timings={"baseline": "host"})
    out = tmp_path / "best.py"
    result = CliRunner().invoke(app, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "commweave.ops.load" in " ".join(result.output.split())
    text = out.read_text()
    assert text.splitlines()[0].startswith(DIRECTIVES_PREFIX) and directives_of(text) == directives_of(code)
    info = ops.export_info(text)
    assert info["workload"] == "gemm-allgather" and info["program_id"] == best_id and info["shape"] == "1024x1024x512"
    op = ops.load(out)
    assert op.workload.name == "gemm-allgather" and op.program == "best"
    for shape in wl.check_shapes(WORLD):
        result = cpu_pool.run("ops_jobs:op_check", workload="gemm-allgather", shape_text=shape.label, seed=7,
                              path=str(out))
        assert result.ok, result.first_failure()
        for value in result.values:
            assert value["error"] <= wl.tolerance() and value["inputs_intact"]
            assert value["warnings"] == [], "an explicit program never falls back"


needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")


@pytest.fixture(scope="module")
def gpu_pool():
    with WorkerPool(WORLD, device="cuda", job_timeout_s=300) as pool:
        yield pool


@pytest.mark.gpu
@needs_gpus
def test_gemm_allgather_op_runs_the_seed_on_gpus_and_matches_torch(gpu_pool: WorkerPool) -> None:
    wl = get_workload("gemm-allgather")
    for shape in [s.label for s in wl.check_shapes(WORLD)] + ["4096x4096x4096"]:
        result = gpu_pool.run("ops_jobs:gemm_vs_torch", shape_text=shape, seed=1)
        assert result.ok, f"{shape}: {result.first_failure()}"
        for value in result.values:
            assert value["program"] == "seed" and value["warnings"] == [], value
            assert value["error"] <= wl.tolerance(), f"{shape}: error {value['error']:.3g}"


@pytest.mark.gpu
@needs_gpus
@pytest.mark.parametrize("workload,shape", CASES)
def test_op_runs_the_seed_on_gpus(gpu_pool: WorkerPool, workload: str, shape: str) -> None:
    wl = get_workload(workload)
    result = gpu_pool.run("ops_jobs:op_check", workload=workload, shape_text=shape, seed=3, calls=3)
    assert result.ok, f"{workload} {shape}: {result.first_failure()}"
    for value in result.values:
        assert value["warnings"] == [], "the seed runs on GPUs: no fallback"
        assert value["inputs_intact"] and value["error"] <= wl.tolerance(), f"{workload} {shape}: {value}"


# -- in this process: the file format, loading, shapes from tensors ---------------------------
def test_export_text_keeps_the_directive_line_first() -> None:
    body = "# EVOLVE-BLOCK-START\ndef setup(ctx, shape): ...\ndef run(ctx, state, inputs, out): ...\n# EVOLVE-BLOCK-END\n"
    header = directives_header(get_workload("gemm-allgather").template().seed_directives())
    text = ops.export_text(header + body, "gemm-allgather", program_id=3)
    assert text.startswith(header) and text.endswith(body)
    again = ops.export_text(text, "moe")  # re-exporting replaces the line, never stacks them
    assert again.count(ops.EXPORT_PREFIX) == 1 and ops.export_info(again) == {"workload": "moe"}
    assert ops.export_text(body, "moe").startswith(ops.EXPORT_PREFIX)
    assert ops.export_info(body) is None
    with pytest.raises(ValueError, match="JSON object with a \"workload\""):
        ops.export_info(ops.EXPORT_PREFIX + "[1, 2]\n" + body)
    with pytest.raises(ValueError, match="must name its workload"):
        ops.export_text(body, "")


def test_load_errors(tmp_path: Path) -> None:
    host = get_workload("gemm-allgather").program_text("host")
    plain = tmp_path / "plain.py"
    plain.write_text(host)
    with pytest.raises(FileNotFoundError):
        ops.load(tmp_path / "missing.py")
    with pytest.raises(ValueError, match="no '# commweave-export:' line"):
        ops.load(plain)
    assert ops.load(plain, workload="gemm-allgather").program == "plain"
    for_moe = tmp_path / "for_moe.py"
    for_moe.write_text(ops.export_text(host, "moe"))
    with pytest.raises(ValueError, match="exported for workload 'moe', not 'gemm-allgather'"):
        ops.load(for_moe, workload="gemm-allgather")
    with pytest.raises(ValueError, match="exported for workload 'moe', not 'gemm-allgather'"):
        ops.gemm_allgather(torch.zeros(1), torch.zeros(1), program=for_moe)
    broken = tmp_path / "broken.py"
    broken.write_text(ops.export_text("def run(:\n", "gemm-allgather"))
    with pytest.raises(ProgramError, match="syntax error"):
        ops.load(broken)
    with pytest.raises(KeyError, match="unknown workload"):
        ops.Op("no-such-workload")
    assert ops.op("moe") is ops.op("moe"), "one Op (and one program) per (workload, program) in a process"


def test_symmetric_output_must_lie_in_a_window() -> None:
    class NoWindows:  # a context in which no tensor is symmetric
        def window(self, tensor: torch.Tensor) -> None:
            raise ValueError("tensor is not in a symmetric window")

    kv = get_workload("kv-transfer")
    with pytest.raises(ValueError, match="pass the output, allocate it with commweave.ops.symmetric_zeros"):
        runner._check_symmetric(NoWindows(), kv, None)
    with pytest.raises(ValueError, match="must lie in a symmetric window"):
        runner._check_symmetric(NoWindows(), kv, torch.zeros(1))


def test_from_process_group_needs_torch_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("this test process has a process group")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        RankContext.from_process_group()


def test_a_workload_without_shape_from_inputs_says_so() -> None:
    with pytest.raises(NotImplementedError, match="toy-gather-matmul.*cannot derive a shape from tensors"):
        ToyGatherMatmul().shape_from_inputs({}, 2, 0)


def _bf16(*dims: int) -> torch.Tensor:
    return torch.zeros(*dims, dtype=torch.bfloat16)


def _kv_call(kv=None, src=None, dst=None, cache=None, rank=0) -> tuple:
    src = torch.tensor([0, 2], dtype=torch.int64) if src is None else src
    dst = torch.tensor([1, 3], dtype=torch.int64) if dst is None else dst
    inputs = {"src_blocks": src, "dst_blocks": dst}
    if kv is not None:
        inputs["kv"] = kv
    return inputs, rank, _bf16(2, 2, 4, 16, 1, 128) if cache is None else cache


GOOD = {
    "gemm-allgather": ({"a": _bf16(4, 8), "b": _bf16(8, 3)}, {}),
    "attention-cp": ({"q": _bf16(8, 4, 16), "k": _bf16(8, 2, 16), "v": _bf16(8, 2, 16)}, {"causal": True}),
    "moe": ({"x": _bf16(5, 16), "topk_idx": torch.zeros(5, 2, dtype=torch.int64), "topk_weights": torch.zeros(5, 2),
             "w13": _bf16(3, 16, 16), "w2": _bf16(3, 16, 8)}, {}),
}


def test_shapes_from_good_tensors() -> None:
    assert get_workload("gemm-allgather").shape_from_inputs(GOOD["gemm-allgather"][0], 2, 0).params == {"M": 8, "N": 6, "K": 8}
    attn = get_workload("attention-cp").shape_from_inputs(GOOD["attention-cp"][0], 2, 1, causal=True)
    assert attn.label == "s16-q4kv2-d16-causal"
    moe = get_workload("moe").shape_from_inputs(GOOD["moe"][0], 2, 0)
    assert (moe["T"], moe["H"], moe["I"], moe["E"], moe["K"], moe["skew"]) == (5, 16, 8, 6, 2, 0)
    kv = get_workload("kv-transfer")
    for rank, kv_tensor in ((0, _bf16(2, 2, 20, 1, 128)), (1, None)):
        inputs, rank, cache = _kv_call(kv_tensor, rank=rank)
        shape = kv.shape_from_inputs(inputs, 2, rank, out=cache)
        assert (shape["S"], shape["blocks"], shape["NB"], shape["F"], shape["L"], shape["KV"], shape["P"]) == (32, 2, 4, 2, 2, 1, 0)


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


BAD = [
    ("gemm-allgather", _without(GOOD["gemm-allgather"][0], "b"), {}, "missing input b"),
    ("gemm-allgather", {**GOOD["gemm-allgather"][0], "c": _bf16(1)}, {}, "unexpected input c"),
    ("gemm-allgather", {"a": _bf16(4, 8), "b": [[1.0]]}, {}, "b must be a torch.Tensor, not list"),
    ("gemm-allgather", {"a": _bf16(4, 8, 1), "b": _bf16(8, 3)}, {}, r"a must have 2 dimensions, got shape \(4, 8, 1\)"),
    ("gemm-allgather", {"a": _bf16(4, 8), "b": _bf16(8, 3).to("meta")}, {}, "b is on meta, but the other tensors are on cpu"),
    ("gemm-allgather", {"a": _bf16(0, 8), "b": _bf16(8, 3)}, {}, "M must be positive"),
    ("attention-cp", {**GOOD["attention-cp"][0], "v": _bf16(8, 2, 8)}, {}, "k .* and v .* must have the same shape"),
    ("attention-cp", {**GOOD["attention-cp"][0], "q": _bf16(6, 4, 16)}, {}, "q holds 6 tokens but k and v 8"),
    ("attention-cp", {**GOOD["attention-cp"][0], "q": _bf16(8, 3, 16)}, {}, "3 query heads are not a multiple of 2 KV heads"),
    ("attention-cp", {"q": _bf16(8, 4, 12), "k": _bf16(8, 2, 12), "v": _bf16(8, 2, 12)}, {}, "head dim 12 must be a multiple of 8"),
    ("moe", {**GOOD["moe"][0], "topk_idx": torch.zeros(5, 2, dtype=torch.int32)}, {}, "topk_idx must be torch.int64"),
    ("moe", {**GOOD["moe"][0], "topk_weights": torch.zeros(5, 3)}, {}, r"must both be \[T, k\] with T = 5"),
    ("moe", {**GOOD["moe"][0], "w13": _bf16(3, 15, 16)}, {}, r"w13 must be \[E/W, 2I, H\]"),
    ("moe", {**GOOD["moe"][0], "w2": _bf16(3, 16, 4)}, {}, r"w2 must be \[E/W, H, I\] = \(3, 16, 8\)"),
]


@pytest.mark.parametrize("workload,inputs,options,message", BAD)
def test_shape_from_bad_tensors(workload: str, inputs: dict, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_workload(workload).shape_from_inputs(inputs, 2, 0, **options)


KV_BAD = [
    (dict(), "prefill source of its pair: it needs kv"),
    (dict(kv=_bf16(2, 2, 20, 1, 128), rank=1), "decode destination of its pair: it receives pages and takes no kv"),
    (dict(kv=_bf16(2, 2, 40, 1, 128)), "kv holds 40 tokens, which fill 3 pages of 16, but the block tables name 2"),
    (dict(kv=_bf16(2, 2, 20, 2, 128)), r"kv must be \[L, 2, S, KV, D\] = \[2, 2, S, 1, 128\]"),
    (dict(kv=_bf16(2, 2, 20, 1, 128), cache=_bf16(2, 2, 4, 16, 1, 64)), "head dim 128"),
    (dict(kv=_bf16(2, 2, 20, 1, 128), src=torch.tensor([0, 2], dtype=torch.int32)), "src_blocks must be torch.int64"),
    (dict(kv=_bf16(2, 2, 20, 1, 128), dst=torch.tensor([1], dtype=torch.int64)), "one destination page per source page"),
    (dict(kv=_bf16(2, 2, 70, 1, 128), src=torch.arange(5), dst=torch.arange(5)), "the cache has only 4 blocks"),
]


@pytest.mark.parametrize("call,message", KV_BAD)
def test_kv_shape_from_bad_tensors(call: dict, message: str) -> None:
    inputs, rank, cache = _kv_call(**call)
    with pytest.raises(ValueError, match=message):
        get_workload("kv-transfer").shape_from_inputs(inputs, 2, rank, out=cache)
    with pytest.raises(ValueError, match="pass it"):
        get_workload("kv-transfer").shape_from_inputs(inputs, 2, rank)
