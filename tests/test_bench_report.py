"""The one bench path on a 2-rank CPU pool (gloo) with the toy workload: `bench_workload`'s rows,
speedups, yardsticks, floor and provenance, batches without checks, and `commweave bench` printing
and writing that report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from commweave.cli import app
from commweave.contracts.verdict import FailureClass
from commweave.evaluate.bench import BenchStep, bench_workload
from commweave.evaluate.floor import floor_s
from commweave.report.bench import comparison_table, notes, ranking_table
from commweave.runtime import WorkerPool
from toy_workload import ToyGatherMatmul
from worker_env import worker_env

TESTS = Path(__file__).parent
PROGRAMS = TESTS / "programs_cpu"

KNOBS = '''"""Toy program with knobs: without communication it multiplies its own rows only (a wrong
result: a yardstick), without computation it only gathers."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
CONFIG = dict(communicate=True, compute=True)


def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    if CONFIG["communicate"]:
        parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
        dist.all_gather(parts, inputs["a"], group=ctx.group)
    else:
        parts = [inputs["a"]] * ctx.world_size
    if CONFIG["compute"]:
        torch.mm(torch.cat(parts), inputs["b"], out=out)
# EVOLVE-BLOCK-END
'''


class ToyWithYardsticks(ToyGatherMatmul):
    """The toy with two yardsticks: the product alone, and the all-gather alone (a communication
    yardstick, whose bandwidth the report gives)."""

    yardsticks = {"compute_alone": ("knobs", {"communicate": False}), "gather_alone": ("knobs", {"compute": False})}
    comm_yardsticks = ("gather_alone",)

    def program_text(self, name: str) -> str:
        return KNOBS if name == "knobs" else super().program_text(name)


TOY = ToyWithYardsticks()
SHAPES = [TOY.make_shape(64, 64, 64), TOY.make_shape(32, 16, 8)]


def program(name: str) -> str:
    return (PROGRAMS / f"{name}.py").read_text()


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, device="cpu", job_timeout_s=60, env=worker_env()) as pool:
        yield pool


@pytest.fixture(scope="module")
def report_and_steps(pool):
    steps: list[BenchStep] = []
    programs = {"host": program("host"), "ours": KNOBS, "broken": program("wrong_values")}
    report = bench_workload(pool, TOY, SHAPES, programs, yardsticks=list(TOY.yardsticks), iters=6, warmup=1,
                            command=["pytest", "bench"], meta={"note": "toy"}, progress=steps.append)
    return report, steps


def test_rows_speedups_floor_and_failures(report_and_steps):
    report, steps = report_and_steps
    assert report.complete and report.baselines == ["host"] and report.programs == ["host", "ours", "broken"]
    assert [row.shape for row in report.rows] == [s.label for s in SHAPES]
    assert report.checks["broken"].failure == FailureClass.WRONG_RESULT and report.checks["ours"].ok
    for row, shape in zip(report.rows, SHAPES):
        assert row.baseline == "host" == row.best_baseline
        host, ours = row.timings["host"].median_us, row.timings["ours"].median_us
        assert host > 0 and ours > 0
        assert row.speedup("ours") == pytest.approx(host / ours) and row.speedup("ours", "host") == row.speedup("ours")
        assert row.floor_us == pytest.approx(floor_s(TOY.cost(shape, 2), report.rates) * 1e6)
        assert row.floor_fraction("ours") == pytest.approx(row.floor_us / ours)
        assert "broken" not in row.timings and row.median_us("broken") is None and row.speedup("broken") is None
        assert row.verdict("broken").failure == FailureClass.WRONG_RESULT
        # yardsticks are timed although their output is wrong, and compared with every program
        gather = row.timings["gather_alone"].median_us
        assert not row.timings["compute_alone"].verdict.ok and row.median_us("compute_alone") > 0
        assert row.ratio("gather_alone", "ours") == pytest.approx(gather / ours)
        assert row.gbps("gather_alone") == pytest.approx(TOY.cost(shape, 2).comm_bytes / gather / 1e3)
    assert [(s, n) for s, n, _ in report.failures()] == [(s.label, "broken") for s in SHAPES]
    assert [s.done for s in steps] == list(range(len(steps))) and steps[-1].total == len(steps) == 2 + 2 * 2
    assert steps[0].report is None and steps[-1].report is report


def test_json_carries_provenance_and_every_figure(report_and_steps):
    report, _ = report_and_steps
    data = json.loads(json.dumps(report.to_json()))
    import torch

    assert data["command"] == "pytest bench" and data["commit"] and data["date"].startswith("20")
    assert data["environment"]["torch"] == torch.__version__ and data["note"] == "toy" and data["complete"]
    assert data["workload"] == TOY.name and data["gpus"] == 2 and data["rates"]["link_bytes_per_s"] > 0
    for row, shape in zip(data["rows"], SHAPES):
        ours, host = row["programs"]["ours"], row["programs"]["host"]
        assert row["shape"] == shape.label and row["baseline"] == "host"
        assert ours["speedup"]["host"] == pytest.approx(host["timing"]["median_us"] / ours["timing"]["median_us"])
        assert row["programs"]["broken"]["verdict"]["failure"] == "wrong_result"
        assert row["programs"]["broken"]["timing"] is None and row["programs"]["broken"]["speedup"] == {}
        gather = row["yardsticks"]["gather_alone"]
        assert gather["GBps"] == pytest.approx(row["comm_bytes"] / gather["median_us"] / 1e3)
        assert gather["of_link"] == pytest.approx(gather["GBps"] * 1e9 / data["rates"]["link_bytes_per_s"])
        assert "GBps" not in row["yardsticks"]["compute_alone"]
        assert ours["yardstick_fraction"]["gather_alone"] == pytest.approx(gather["median_us"] / ours["timing"]["median_us"])


def test_rendering_reads_the_report(report_and_steps):
    report, _ = report_and_steps
    table = comparison_table(report)
    headers = [c.header for c in table.columns]
    assert headers[:4] == ["shape", "host", "ours", "broken"] and "ours vs host" in headers and "floor/ours" in headers
    speedups = list(table.columns[headers.index("ours vs host")].cells)
    assert speedups == [f"{row.speedup('ours'):.2f}x" for row in report.rows]
    assert list(table.columns[headers.index("broken")].cells) == ["[red]wrong_result[/]"] * 2
    lines = notes(report)
    assert any("gather_alone moves the slowest rank's" in line for line in lines)
    assert sum(line.startswith(f"{s.label}: the judge's resolution: calls a batch host ") for s in SHAPES
               for line in lines) == 2
    assert sum(line.startswith(f"{s.label} broken: wrong_result") for s in SHAPES for line in lines) == 2


def test_batches_hold_the_survivors_and_the_first_holds_the_failures(pool, report_and_steps):
    rates = report_and_steps[0].rates
    steps: list[BenchStep] = []
    programs = {"host": program("host"), "a": KNOBS, "broken": program("wrong_values"), "b": program("host")}
    report = bench_workload(pool, TOY, SHAPES[:1], programs, iters=3, warmup=1, rates=rates,
                            check_shapes=[TOY.make_shape(3, 5, 7)], check_each_shape=False, batch=1,
                            progress=steps.append)
    assert report.rates == rates and not report.checks["broken"].ok and report.checks["a"].ok
    assert [row.programs for row in report.rows] == [["host", "a", "broken"], ["host", "b"]]
    assert [sorted(row.timings) for row in report.rows] == [["a", "host"], ["b", "host"]]
    assert all(row.verdict("host").ok and row.speedup(name) for row, name in zip(report.rows, "ab"))
    assert [s.description.split(":")[0] for s in steps] == ["checking 4 programs on 1 check shapes", "64x64x64", "64x64x64"]
    assert [(s.done, s.total) for s in steps] == [(0, 4), (1, 3), (2, 3)]  # three batches planned, two needed
    table, hidden = ranking_table(report, "sweep", top=1)
    assert hidden == 2 and [c.header for c in table.columns][0] == "program" and len(table.rows) == 2
    unchecked = bench_workload(pool, TOY, SHAPES[1:], {"host": program("host")}, iters=3, warmup=1, rates=rates,
                               check_shapes=[], check_each_shape=False)
    assert unchecked.checks == {} and unchecked.rows[0].verdict("host").ok and unchecked.rows[0].median_us("host")
    with pytest.raises(ValueError, match="no yardstick nope"):
        bench_workload(pool, TOY, SHAPES, programs, yardsticks=["nope"], rates=rates)


def test_bench_command_prints_and_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    args = ["bench", "test_bench_report:ToyWithYardsticks", "--gpus", "2", "--device", "cpu", "--shapes", "16x8x12",
            "--candidate", str(PROGRAMS / "host.py"), "--out-dir", str(tmp_path), "--warmup", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    [path] = tmp_path.glob("bench-toy-gather-matmul-2gpu-*.json")
    data = json.loads(path.read_text())
    row = data["rows"][0]
    assert data["candidate"] == str(PROGRAMS / "host.py") and data["command"].startswith("commweave")
    ours, host = row["programs"]["ours"], row["programs"]["host"]
    said = " ".join(result.output.split())
    assert f"{ours['timing']['median_us']:,.1f}" in said and f"{host['timing']['median_us']:,.1f}" in said
    assert f"{ours['speedup']['host']:.2f}x" in said and f"results: {path}" in said
    assert f"{row['yardsticks']['gather_alone']['GBps']:,.0f} GB/s" in said
    for args, words in [(["test_bench_report:ToyWithYardsticks", "--gpus", "3", "--device", "cpu"], "runs on 1, 2, 4 GPUs, not 3"),
                        (["gemm-allgather", "--candidate", str(tmp_path / "none.py")], "none.py: no such file"),
                        (["gemm-allgather", "--gpus", "4"], "needs 4 CUDA GPUs; this machine has 0"),
                        (["gemm-allgather", "--shapes", "big"], "'big'")]:
        bad = CliRunner().invoke(app, ["bench", *args])
        assert bad.exit_code != 0 and words in " ".join(bad.output.split()), bad.output


def test_one_gpu_bench_times_the_compute_side_and_says_so(tmp_path):
    """`bench --gpus 1` runs a workload whose W = 1 is defined: its table says no communication was
    timed (a CPU dry run: the host program times, the seed needs GPUs)."""
    from commweave.report.bench import ONE_GPU_NOTE

    args = ["bench", "gemm-allgather", "--gpus", "1", "--device", "cpu", "--shapes", "64x64x64", "--out-dir",
            str(tmp_path), "--warmup", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ONE_GPU_NOTE in result.output
    [path] = tmp_path.glob("bench-gemm-allgather-1gpu-*.json")
    row = json.loads(path.read_text())["rows"][0]
    assert row["comm_bytes"] == 0 and row["programs"]["host"]["timing"]["median_us"] > 0
    assert row["programs"]["ours"]["verdict"]["failure"] == "unavailable"
