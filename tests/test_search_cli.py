"""evolve / report / export on a CPU: the GPU check, the driver with a progress bar (simulated
evaluator), the real Evaluator on a CPU pool with the toy workload, and the CLI's report/export."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress
from typer.testing import CliRunner

from commweave.cli import app
from commweave.evaluate import Evaluator
from commweave.contracts.program import load_program
from commweave.ops import EXPORT_PREFIX, export_info
from commweave.runtime import WorkerPool
from commweave.search import Budget, ProgramDB, SearchConfig
from commweave.search.driver import evolve, plan_run, run_meta, template_for
from commweave.search.simulate import SimulatedEvaluator
from commweave.space import DirectiveSet, Space, Template, directives_of
from commweave.workloads import get_workload
from toy_workload import ToyGatherMatmul
from worker_env import worker_env

runner = CliRunner()


def said(result) -> str:
    return " ".join(result.output.split())  # rich wraps long lines


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    t = get_workload("gemm-allgather").template()
    path = tmp_path_factory.mktemp("cli") / "run.sqlite"
    ev = SimulatedEvaluator(t, 4, t.seed_directives().with_(comm_ctas=16))
    out = io.StringIO()
    with Progress(console=Console(file=out, force_terminal=False, width=120)) as progress:
        best, count, _ = evolve(path, t, ev, t.default_shape(4), 4, Budget(evaluations=12), SearchConfig(islands=2),
                             progress=progress)
    return path, best, count, out.getvalue()


def test_evolve_needs_gpus_and_says_so_in_one_line():
    result = runner.invoke(app, ["evolve", "gemm-allgather", "--gpus", "4", "--budget", "5"])
    assert result.exit_code != 0
    assert "needs 4 CUDA GPUs; this machine has 0" in said(result)
    bad = runner.invoke(app, ["evolve", "gemm-allgather", "--budget", "soon"])
    assert bad.exit_code != 0 and "budget 'soon'" in said(bad)


def test_evolve_resume_checks_the_run(sim_run, tmp_path):
    path = sim_run[0]
    wrong = runner.invoke(app, ["evolve", "other-workload", "--resume", str(path)])
    assert wrong.exit_code != 0 and "is a run of 'gemm-allgather', not 'other-workload'" in said(wrong)
    missing = runner.invoke(app, ["evolve", "gemm-allgather", "--resume", str(tmp_path / "none.sqlite")])
    assert missing.exit_code != 0 and "no run database" in said(missing)


def test_a_resumed_run_keeps_its_own_settings(sim_run, tmp_path):
    path = sim_run[0]
    plan = plan_run("gemm-allgather", gpus=2, budget="5", islands=7, seed=3, shape="4096x4096x4096", resume=path)
    template = get_workload("gemm-allgather").template()
    assert plan.resumed and plan.path == path and plan.gpus == 4 and plan.shape == template.default_shape(4)
    assert plan.budget == Budget(evaluations=12) and plan.config.islands == 2 and plan.config.seed == 0
    assert plan.models == () and plan.config.llm_islands == 0
    fresh = plan_run("gemm-allgather", gpus=2, budget="20m", islands=3, seed=5, runs_dir=tmp_path, stop_after="90s")
    assert not fresh.resumed and fresh.path.parent == tmp_path and fresh.path.name.startswith("evolve-gemm-allgather-2gpu-")
    assert (fresh.gpus, fresh.budget, fresh.config.islands, fresh.config.seed, fresh.stop_after_s) == \
        (2, Budget(seconds=1200.0), 3, 5, 90.0)
    for kwargs, words in [({"stop_after": "5"}, "must be a time"), ({"llm_budget": 1.0}, "need --llm MODEL"),
                          ({"gpus": 3}, "not 3")]:
        with pytest.raises(ValueError, match=words):
            plan_run("gemm-allgather", **kwargs)
    # the CLI asks for the resumed run's GPUs, not --gpus
    result = runner.invoke(app, ["evolve", "gemm-allgather", "--gpus", "2", "--resume", str(path)])
    assert result.exit_code != 0 and "evolve gemm-allgather --gpus 4 needs 4 CUDA GPUs" in said(result)


def test_driver_progress_shows_best_speedup(sim_run):
    path, best, count, shown = sim_run
    assert count == 12 and best is not None
    assert "evaluated" in shown and "best " in shown and "x (#" in shown
    assert run_meta(path)["workload"] == "gemm-allgather"


def test_report_and_export_commands(sim_run, tmp_path):
    path, best, _, _ = sim_run
    result = runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rep" / "index.html").exists() and (tmp_path / "rep" / "islands.png").exists()
    result = runner.invoke(app, ["export", str(path), "--out", str(tmp_path / "best.py")])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "best.py").read_text()
    assert [line for line in text.splitlines() if not line.startswith(EXPORT_PREFIX)] == best.code.splitlines()
    assert directives_of(text) is not None and export_info(text)["workload"] == "gemm-allgather"
    assert "commweave bench gemm-allgather --gpus 4 --candidate" in said(result)
    assert "ops" in runner.invoke(app, ["export", "--help"]).output
    assert runner.invoke(app, ["export", str(tmp_path / "x.sqlite"), "--out", "y.py"]).exit_code != 0


def test_template_lookup():
    assert template_for(get_workload("gemm-allgather")).workload.name == "gemm-allgather"
    with pytest.raises(LookupError, match="has no template"):
        template_for(ToyGatherMatmul())


# -- the real Evaluator on a CPU pool, with a toy template --------------------------------------
TOY_TEXT = '''"""Toy candidate: gather rows over gloo, then the product in `pieces` row blocks."""

import torch
import torch.distributed as dist

# EVOLVE-BLOCK-START
CONFIG = dict(pieces=1, scale=1.0)


def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    a = torch.cat(parts)
    step = -(-a.shape[0] // CONFIG["pieces"])
    for r0 in range(0, a.shape[0], step):
        torch.mm(a[r0:r0 + step], inputs["b"], out=out[r0:r0 + step])
    out.mul_(CONFIG["scale"])
# EVOLVE-BLOCK-END
'''


class ToyTemplate(Template):
    """Knob `pieces` changes the schedule; knob `scale` != 1 is a wrong program (wrong_result).
    Both vary on one worker too (the toy's gather is a copy there, its schedule still the knob's)."""

    one_gpu_dimensions = ("knob:pieces", "knob:scale")

    def __init__(self):
        super().__init__(ToyGatherMatmul())

    def space(self, world_size, capabilities=None):
        return Space(chunk_bytes_min=1 << 10, chunk_bytes_max=1 << 12, comm_ctas=(1, 2))

    def supported(self):
        return {"backend": ("lsa",), "placement": ("split",), "sync": ("chunk",), "issuer": ("cta",),
                "compression": ("none",), "group_size": (0,), "language": ("cuda",), "comm_ctas": (1,),
                "chunk_bytes": (1 << 10,), "knob:pieces": (1, 2, 4), "knob:scale": (1.0, 1.5)}

    def seed_directives(self):
        return DirectiveSet.make(comm_ctas=1, chunk_bytes=1 << 10, knobs=dict(pieces=1, scale=1.0))

    def default_shape(self, world_size):
        return self.workload.make_shape(16, 8, 12)

    def render_text(self, ds, shape, world_size):
        from commweave.contracts.program import with_config

        return with_config(TOY_TEXT, **ds.knob_dict)


def test_evolution_with_the_real_evaluator_on_a_cpu_pool(tmp_path):
    template = ToyTemplate()
    assert load_program(template.render(template.seed_directives(), template.default_shape(2), 2)).CONFIG["pieces"] == 1
    with WorkerPool(2, device="cpu", job_timeout_s=60, env=worker_env()) as pool:
        evaluator = Evaluator(pool, template.workload, warmup=1, iters=5, seeds=2)
        best, count, _ = evolve(tmp_path / "toy.sqlite", template, evaluator, template.default_shape(2), 2,
                             Budget(evaluations=6), SearchConfig(islands=2, seed=1))
    with ProgramDB(tmp_path / "toy.sqlite") as db:
        programs = db.programs()
    assert count == len(programs) == 6  # the seed and all 5 other knob combinations
    ok = [p for p in programs if p.ok]
    wrong = [p for p in programs if not p.ok]
    assert {p.directives["knobs"]["scale"] for p in ok} == {1.0} and len(ok) == 3
    assert {p.failure for p in wrong} == {"wrong_result"} and len(wrong) == 3
    for p in ok:
        t = p.timings
        assert p.fitness > 0 and t["candidate_us"] > 0 and t["baselines_us"]["host"] > 0 and t["baseline"] == "host"
        assert "compile_s" in t and "evaluate_s" in t
    assert best.fitness == max(p.fitness for p in ok)


def test_search_ends_when_the_space_is_exhausted(tmp_path):
    template = ToyTemplate()
    ev = SimulatedEvaluator(template, 2, template.seed_directives().with_(knobs=dict(pieces=4, scale=1.0)))
    best, count, _ = evolve(tmp_path / "small.sqlite", template, ev, template.default_shape(2), 2,
                         Budget(evaluations=50), SearchConfig(islands=2))
    assert count == 6 == ev.calls and best.directives["knobs"] == {"pieces": 4, "scale": 1.0}
