"""The search on a CPU: database, budget, selection, phases, failure memory, duplicates, migration,
compile-ahead, resume, and kill -9 — with a simulated evaluator whose optimum is known."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from commweave.evaluate.floor import MachineRates
from commweave.search import Budget, CompileAhead, Evolution, ProgramDB, SearchConfig
from commweave.search.cost import predict_s
from commweave.search.proposer import Memory, OfflineProposer
from commweave.search.simulate import SimulatedEvaluator
from commweave.space import DirectiveSet
from commweave.workloads import get_workload

TEMPLATE = get_workload("gemm-allgather").template()
SHAPE = TEMPLATE.default_shape(4)
OPTIMUM = TEMPLATE.seed_directives().with_(sync="chunk", comm_ctas=16, chunk_bytes=4 << 20,
                                           knobs=dict(wait="stream", threads=256))
RULES = [lambda ds: "timeout" if ds.comm_ctas == 32 else None,
         lambda ds: "wrong_result" if ds.get("knob:order") == "broadcast" and ds.get("knob:wait") == "stream" else None,
         lambda ds: "illegal_address" if ds.comm_ctas == 1 and ds.sync == "chunk" else None]


def evolve(path: Path, budget: int = 150, seed: int = 1, islands: int = 4, **proposer_kw) -> tuple[Evolution, SimulatedEvaluator]:
    ev = SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, rules=RULES)
    proposer = OfflineProposer(TEMPLATE, 4, TEMPLATE.workload.cost(SHAPE, 4), **proposer_kw) if proposer_kw else None
    search = Evolution(ProgramDB(path), TEMPLATE, ev, SHAPE, 4, Budget(evaluations=budget),
                       SearchConfig(islands=islands, seed=seed), proposer=proposer)
    search.run()
    return search, ev


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    return evolve(tmp_path_factory.mktemp("run") / "run.sqlite")


# -- database ---------------------------------------------------------------------------------
def test_database_round_trip(tmp_path):
    path = tmp_path / "db.sqlite"
    with ProgramDB(path) as db:
        db.set_meta(workload="w", shape="8x8x8", gpus=4, budget={"evaluations": 3}, seed=7)
        a = db.add_program(code="A", directives={"x": 1}, directive_key="k1", island=0, generation=0, status="ok",
                           fitness=1.0, timings={"candidate_us": 5.0}, proposer="seed")
        b = db.add_program(code="B", directives={"x": 2}, parents=[a], island=1, generation=1, status="failed",
                           failure="timeout", message="no answer", proposer="offline", cost=0.0)
        c = db.add_program(code="C", directives={"x": 3}, parents=[a], island=0, generation=1, status="ok", fitness=2.5)
        db.add_migration(c, 0, 1, 1)
        with pytest.raises(ValueError):
            db.add_program(code="D", directives=None, island=0, generation=0, status="weird")
    with ProgramDB(path) as db:
        assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.meta()["budget"] == {"evaluations": 3} and db.meta()["seed"] == 7
        assert [p.id for p in db.programs()] == [a, b, c] and db.count() == 3
        rec = db.get(b)
        assert (rec.parents, rec.island, rec.failure, rec.message, rec.ok) == ([a], 1, "timeout", "no answer", False)
        assert db.get(a).timings == {"candidate_us": 5.0} and db.get(a).directive_key == "k1"
        assert db.best().id == c and [r.id for r in db.lineage(c)] == [c, a]
        assert db.migrations()[0]["to_island"] == 1 and db.has_code("B") and not db.has_code("Z")


def test_budget_parse():
    assert Budget.parse("200") == Budget(evaluations=200)
    assert Budget.parse("20m") == Budget(seconds=1200)
    assert Budget.parse("1.5h").seconds == 5400 and Budget.parse("90s").seconds == 90
    for bad in ("0", "-3", "20x", "", "m"):
        with pytest.raises(ValueError):
            Budget.parse(bad)
    assert Budget(evaluations=10).fraction(4, 1e9) == 0.4
    assert Budget(seconds=10).fraction(10**6, 5) == 0.5


# -- the search -------------------------------------------------------------------------------
def test_search_finds_the_known_optimum(finished):
    search, ev = finished
    best = search.best
    assert best.fitness == pytest.approx(ev.fitness(OPTIMUM)) and best.directives == OPTIMUM.to_dict()
    assert search.db.count() == 150 == ev.calls
    assert search.db.programs()[0].proposer == "seed"
    assert search.db.programs()[0].directives == TEMPLATE.seed_directives().to_dict()


def test_no_duplicates_and_no_failed_set_again(finished):
    search, _ = finished
    programs = search.db.programs()
    keys = [p.directive_key for p in programs]
    codes = [p.code_hash for p in programs]
    assert len(set(keys)) == len(keys) and len(set(codes)) == len(codes)
    failed = [p for p in programs if not p.ok]
    assert {p.failure for p in failed} >= {"timeout", "wrong_result"}
    assert all(p.fitness == 0 and p.message for p in failed)
    # sync peer and global render one chunk per shard whatever chunk_bytes says: at most one such program per rest
    peer = [tuple(sorted((k, str(v)) for k, v in p.directives.items() if k != "chunk_bytes"))
            for p in programs if p.directives["sync"] in ("peer", "global")]
    assert len(set(peer)) == len(peer)


def test_phases_explore_then_exploit_one_knob(finished):
    search, _ = finished
    programs = search.db.programs()[1:]
    explore = [p.id for p in programs if p.timings["how"].startswith("explore")]
    exploit = [p for p in programs if p.timings["how"].startswith("exploit")]
    assert abs(len(explore) - 0.4 * 150) <= 4  # proposals made before the boundary may finish after it
    assert max(explore) < min(p.id for p in exploit) + 4
    by_id = {p.id: p for p in search.db.programs()}
    for p in explore[:20]:
        child, parent = DirectiveSet.from_dict(by_id[p].directives), DirectiveSet.from_dict(by_id[by_id[p].parents[0]].directives)
        assert len(child.diff(parent)) >= 1
    # one-knob neighbours of the islands' bests until those are all tried, then jumps: this run
    # finds the optimum early (in the explore phase), so its neighbourhood runs out early
    neighbours = [p for p in exploit if p.timings["how"] == "exploit: neighbour"]
    assert len(neighbours) >= 10
    for p in neighbours:
        child, parent = DirectiveSet.from_dict(p.directives), DirectiveSet.from_dict(by_id[p.parents[0]].directives)
        assert len(child.diff(parent)) == 1


def test_migration_moves_island_bests_around_the_ring(finished):
    search, _ = finished
    moves = search.db.migrations()
    assert {(m["from_island"], m["to_island"]) for m in moves if m["generation"] > 0} <= {(0, 1), (1, 2), (2, 3), (3, 0)}
    later = [m for m in moves if m["generation"] > 0]
    assert later, "no migration after the seed's"
    for m in later:
        assert m["program_id"] in search.members[m["to_island"]]
        assert search.db.get(m["program_id"]).island != m["to_island"]
    assert sorted({p.island for p in search.db.programs()}) == [0, 1, 2, 3]


def test_failure_memory_steers_away_from_failing_values(tmp_path):
    steered, _ = evolve(tmp_path / "a.sqlite", budget=80, seed=3)
    blind, _ = evolve(tmp_path / "b.sqlite", budget=80, seed=3, penalty_weight=0.0, measured_weight=2.0)
    def failures(s):
        return sum(1 for p in s.db.programs() if not p.ok)
    assert failures(steered) < failures(blind)


def test_parent_selection_favours_fitness_and_few_children(tmp_path):
    search, _ = evolve(tmp_path / "s.sqlite", budget=1, islands=1)
    db = search.db
    seed = db.programs()[0]
    a = db.add_program(code="a", directives=seed.directives, island=0, generation=1, status="ok", fitness=1.0)
    b = db.add_program(code="b", directives=seed.directives, island=0, generation=1, status="ok", fitness=1.0)
    strong = db.add_program(code="c", directives=seed.directives, island=0, generation=1, status="ok", fitness=4.0)
    for i in range(6):
        db.add_program(code=f"child{i}", directives=seed.directives, parents=[a], island=0, generation=2,
                       status="failed", failure="timeout")
    search._load()
    picks = [search.select_parent(0, "explore").id for _ in range(4000)]
    assert picks.count(b) > 1.3 * picks.count(a)  # same fitness, fewer children
    assert picks.count(strong) > picks.count(b)
    assert search.select_parent(0, "exploit").id == strong


def test_cost_model_orders_obvious_strategies():
    work, rates = TEMPLATE.workload.cost(SHAPE, 4), MachineRates()
    split = DirectiveSet()
    assert predict_s(split.with_(placement="deferred", sync="peer"), work, 4, rates) > predict_s(split, work, 4, rates)
    assert predict_s(split.with_(comm_ctas=1), work, 4, rates) > predict_s(split.with_(comm_ctas=8), work, 4, rates)
    assert predict_s(split, work, 4, rates) >= max(work.flops / rates.matmul_flops_per_s, work.comm_bytes / rates.link_bytes_per_s)


def test_proposer_never_repeats_what_memory_holds():
    proposer = OfflineProposer(TEMPLATE, 4, TEMPLATE.workload.cost(SHAPE, 4))
    import random
    memory, rng, parent = Memory(), random.Random(0), TEMPLATE.seed_directives()
    seen = set()
    for _ in range(60):
        p = proposer.propose(parent, "exploit", memory, rng)
        assert p.directives.key not in seen and not TEMPLATE.check(p.directives, 4)
        seen.add(p.directives.key)
        memory.record(p.directives, parent, 0.0, "runtime_error")


def test_one_move_switches_compression_on_where_the_tolerance_admits_it():
    """compression and group_size move together (none <-> 0), so an exploit step can turn FP8 on:
    on gemm-allgather-lossy's comm-bound shape the cost model ranks it first; on gemm-allgather
    (bf16 tolerance) no proposal ever compresses."""
    import random

    from commweave.workloads import get_workload

    lossy = get_workload("gemm-allgather-lossy")
    template, shape = lossy.template(), lossy.parse_shape("16384x4096x8192", 4)
    proposer = OfflineProposer(template, 4, lossy.cost(shape, 4))
    seed = template.seed_directives()
    on = proposer.with_value(seed, "compression", "fp8_e4m3")
    assert (on.compression, on.group_size) == ("fp8_e4m3", 128) and template.check(on, 4) == []
    assert (proposer.with_value(on, "group_size", 0).compression, proposer.with_value(on, "compression", "none").group_size) == ("none", 0)
    first = proposer.propose(seed, "exploit", Memory(), random.Random(0))
    assert first.directives.compression == "fp8_e4m3" and first.directives.group_size in (32, 64, 128, 256, 512)
    plain = OfflineProposer(TEMPLATE, 4, TEMPLATE.workload.cost(SHAPE, 4))
    memory, rng = Memory(), random.Random(1)
    for phase in ("exploit", "explore") * 20:
        p = plain.propose(TEMPLATE.seed_directives(), phase, memory, rng)
        assert p.directives.compression == "none"
        memory.record(p.directives, TEMPLATE.seed_directives(), 0.0, None)


def test_cost_model_charges_decompression_where_the_gather_already_hides():
    """2 GPUs, 8192x8192x8192 (compute-bound: the BF16 gather hides behind the GEMM): FP8 measured
    slower (sweep-gemm-allgather-lossy-2gpu-20261201T095159Z.json: 912.7 against 781.6 µs) and the
    model says slower; 4 GPUs, 16384x4096x8192 (comm-bound): the model still predicts it faster."""
    from commweave.workloads import get_workload

    lossy = get_workload("gemm-allgather-lossy")
    seed = lossy.template().seed_directives()
    fp8 = seed.with_(compression="fp8_e4m3", group_size=128)
    square = lossy.cost(lossy.parse_shape("8192x8192x8192", 2), 2)
    assert predict_s(fp8, square, 2, MachineRates()) > predict_s(seed, square, 2, MachineRates())
    tall = lossy.cost(lossy.parse_shape("16384x4096x8192", 4), 4)
    assert predict_s(fp8, tall, 4, MachineRates()) < predict_s(seed, tall, 4, MachineRates())


def test_compile_ahead_never_compiles_one_source_twice_at_once():
    active: dict[str, int] = {}
    overlap = []
    lock = threading.Lock()

    def compile_fn(source: str) -> None:
        src = "unroll2" if "#define CW_UNROLL 2" in source else "unroll4"
        with lock:
            active[src] = active.get(src, 0) + 1
            overlap.append(active[src])
        time.sleep(0.02)
        with lock:
            active[src] -= 1

    ahead = CompileAhead(compile_fn, 4)
    base = TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)
    texts = [base.replace("comm_ctas=8", f"comm_ctas={n}") for n in (1, 2, 4, 16)]
    other = base.replace("#define CW_UNROLL 4", "#define CW_UNROLL 2")
    futures = [ahead.submit(t) for t in texts + [other]]
    assert all(f.result()[0].ok for f in futures)
    ahead.close()
    assert max(overlap) == 1  # the four texts sharing a source took turns
    assert len(overlap) == 5
    broken = CompileAhead(compile_fn, 1).submit("def setup(): pass")
    assert broken.result()[0].failure == "compile_error"


# -- resume and kill -9 -----------------------------------------------------------------------
def test_resume_continues_numbering_and_budget(tmp_path):
    path = tmp_path / "r.sqlite"
    first, _ = evolve(path, budget=30)
    last_id, last_gen = max(p.id for p in first.db.programs()), max(p.generation for p in first.db.programs())
    first.db.close()
    db = ProgramDB(path)
    db.set_meta(budget={"evaluations": 50, "seconds": None})
    resumed = Evolution(db, TEMPLATE, SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, rules=RULES), SHAPE, 4,
                        Budget(evaluations=999), SearchConfig(islands=4, seed=1))
    assert resumed.budget.evaluations == 50  # the run's own budget, not the caller's
    resumed.run()
    programs = db.programs()
    assert len(programs) == 50 and [p.id for p in programs] == list(range(1, 51))
    assert min(p.generation for p in programs if p.id > last_id) > 0
    assert max(p.generation for p in programs) > last_gen
    keys = [p.directive_key for p in programs]
    assert len(set(keys)) == len(keys)
    with pytest.raises(ValueError, match="cannot resume"):
        Evolution(db, TEMPLATE, SimulatedEvaluator(TEMPLATE, 4, OPTIMUM), SHAPE, 2, Budget(evaluations=5),
                  SearchConfig(islands=4))


KILLED = textwrap.dedent("""
    import sys
    from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
    from commweave.search.simulate import SimulatedEvaluator
    from commweave.workloads import get_workload
    t = get_workload("gemm-allgather").template(); shape = t.default_shape(4)
    opt = t.seed_directives().with_(comm_ctas=16)
    ev = SimulatedEvaluator(t, 4, opt, delay_s=0.03, log=sys.argv[2])
    Evolution(ProgramDB(sys.argv[1]), t, ev, shape, 4, Budget(evaluations=400), SearchConfig(islands=3, seed=5)).run()
""")


def test_sigkill_mid_run_loses_no_evaluated_program(tmp_path):
    path, log = tmp_path / "k.sqlite", tmp_path / "evaluated.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path), str(log)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists() and log.exists() and len(log.read_text().splitlines()) >= 15:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the search made no progress")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    evaluated = log.read_text().splitlines()
    db = ProgramDB(path)
    stored = {p.directive_key for p in db.programs()}
    lost = [k for k in evaluated if k not in stored]
    assert len(lost) <= 1 and (not lost or lost[0] == evaluated[-1])  # at most the one being committed
    before = db.count()
    assert before >= 14  # the log may hold one evaluation not yet committed
    t = TEMPLATE
    ev = SimulatedEvaluator(t, 4, t.seed_directives().with_(comm_ctas=16))
    db.set_meta(budget={"evaluations": before + 10, "seconds": None})
    Evolution(db, t, ev, SHAPE, 4, Budget(evaluations=1), SearchConfig(islands=3, seed=5)).run()
    programs = db.programs()
    assert len(programs) == before + 10 and [p.id for p in programs] == list(range(1, before + 11))
    assert ev.calls == 10


def test_compile_ahead_with_nvcc_reports_the_log():
    from commweave.runtime.compile import compile_cubin

    bad = (Path(__file__).parent / "programs_cpu" / "cuda_compile_error.py").read_text()
    ahead = CompileAhead(compile_cubin, 2)
    good = ahead.submit(TEMPLATE.render(TEMPLATE.seed_directives(), SHAPE, 4)).result()[0]
    verdict = ahead.submit(bad).result()[0]
    ahead.close()
    assert good.ok and verdict.failure == "compile_error" and "nvcc failed" in verdict.message


def test_wall_time_budget_stops_the_search(tmp_path):
    ev = SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, delay_s=0.02)
    start = time.monotonic()
    with ProgramDB(tmp_path / "t.sqlite") as db:
        search = Evolution(db, TEMPLATE, ev, SHAPE, 4, Budget(seconds=1.0), SearchConfig(islands=2))
        search.run()
        # ~0.1 s of the search's own Python per candidate on a loaded 2-core machine, 0.02 s evaluations
        assert 3 <= db.count() <= 50 and db.meta()["elapsed_s"] >= 1.0
    assert time.monotonic() - start < 5


def test_stop_after_leaves_budget_for_a_resume(tmp_path):
    """An invocation limited by stop_after_s stops early and says so; a resume continues the same
    run to its own budget with nothing lost or repeated, the first invocation's time counted."""
    path = tmp_path / "p.sqlite"
    with ProgramDB(path) as db:
        search = Evolution(db, TEMPLATE, SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, delay_s=0.02), SHAPE, 4,
                           Budget(seconds=1.5), SearchConfig(islands=2))
        search.run(stop_after_s=0.4)
        assert search.paused() and 0.4 <= db.meta()["elapsed_s"] < 1.5
        first = db.count()
    with ProgramDB(path) as db:
        resumed = Evolution(db, TEMPLATE, SimulatedEvaluator(TEMPLATE, 4, OPTIMUM, delay_s=0.02), SHAPE, 4,
                            Budget(seconds=99), SearchConfig(islands=2))
        resumed.run()
        assert not resumed.paused() and db.meta()["elapsed_s"] >= 1.5 and db.count() > first
        keys = [p.directive_key for p in db.programs()]
        assert len(set(keys)) == len(keys) and [p.id for p in db.programs()] == list(range(1, db.count() + 1))


def test_resume_after_a_kill_between_the_seed_and_its_copies(tmp_path):
    path = tmp_path / "s.sqlite"
    with ProgramDB(path) as db:
        Evolution(db, TEMPLATE, SimulatedEvaluator(TEMPLATE, 4, OPTIMUM), SHAPE, 4, Budget(evaluations=1),
                  SearchConfig(islands=3)).run()
        db.conn.execute("DELETE FROM migrations")  # as if killed right after the seed was committed
        db.set_meta(budget={"evaluations": 10, "seconds": None})
        search = Evolution(db, TEMPLATE, SimulatedEvaluator(TEMPLATE, 4, OPTIMUM), SHAPE, 4, Budget(evaluations=1),
                           SearchConfig(islands=3))
        search.run()
        assert db.count() == 10 and {m["to_island"] for m in db.migrations() if m["generation"] == 0} == {1, 2}
        assert all(p.parents for p in db.programs()[1:])  # every child knows its parent


def test_compile_errors_are_recorded_without_evaluating(tmp_path):
    from commweave.runtime.compile import CompileError

    def nvcc_refuses(source: str) -> None:
        raise CompileError("nvcc failed (exit 2)", "candidate.cu(1): error: expected a ';'")

    ev = SimulatedEvaluator(TEMPLATE, 4, OPTIMUM)
    with ProgramDB(tmp_path / "c.sqlite") as db:
        best = Evolution(db, TEMPLATE, ev, SHAPE, 4, Budget(evaluations=6), SearchConfig(islands=2),
                         compile_source=nvcc_refuses).run()
        programs = db.programs()
    assert best is None and ev.calls == 0 and len(programs) == 6
    assert all(p.failure == "compile_error" and "expected a ';'" in p.message for p in programs)
