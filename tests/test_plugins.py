"""Workloads are plugins: one that lives outside commweave (tests/plugin_site, registered by its
entry point in conftest.py, as `pip install` of a package declaring one would) is listed by the
CLI, judged by the evaluator and run by `commweave.ops.op(name)`, with no edit of commweave."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from commweave.evaluate import Evaluator
from commweave.runtime import WorkerPool
from commweave.workloads import get_workload, registry

PLUGIN = "allreduce-rmsnorm"


def test_registry_finds_builtin_and_installed_workloads() -> None:
    names = set(registry())
    assert {"gemm-allgather", "attention-cp", "moe", "kv-transfer", PLUGIN} <= names
    wl = get_workload(PLUGIN)
    assert type(wl).__module__ == "commweave_example_plugin.workload"
    with pytest.raises(KeyError, match="unknown workload 'nope'; known: .*allreduce-rmsnorm"):
        get_workload("nope")


def test_cli_lists_the_plugin() -> None:
    out = subprocess.run([sys.executable, "-m", "commweave", "list"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert PLUGIN in out.stdout and "example" in out.stdout


@pytest.mark.parametrize("world", [1, 2])
def test_evaluator_judges_the_plugin(world: int) -> None:
    wl = get_workload(PLUGIN)
    with WorkerPool(world, device="cpu", job_timeout_s=120) as pool:
        evaluator = Evaluator(pool, wl, warmup=1, iters=5, seeds=2)
        assert evaluator.check(wl.program_text("host")).ok
        result = evaluator.evaluate(wl.program_text("host"), wl.bench_shapes(world)[0])
    assert result.verdict.ok and result.baseline == "host" and result.fitness > 0


def test_op_runs_the_plugin_at_one_rank() -> None:
    wl = get_workload(PLUGIN)
    shape = wl.check_shapes(1)[0]
    pool = WorkerPool(1, device="cpu", job_timeout_s=120)
    with pool:
        result = pool.run("ops_jobs:op_check", workload=PLUGIN, shape_text=shape.label, seed=4)
    assert result.ok, result.first_failure()
    assert result.values[0]["error"] <= wl.tolerance() and result.values[0]["inputs_intact"]


def test_a_broken_plugin_is_named_and_does_not_hide_the_others(tmp_path, monkeypatch) -> None:
    info = tmp_path / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[commweave.workloads]\nbroken = no_such_module.workload:Broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_workload("gemm-allgather").name == "gemm-allgather"  # only the asked-for plugin is imported
    with pytest.raises(ImportError, match="workload plugin 'broken' .*no_such_module.*cannot be imported"):
        registry()
