"""Evolution: islands, parent selection, explore then exploit, failure memory, compile-ahead.

The search never touches a GPU: it renders directive sets into programs with the workload's
template, compiles them on a CPU thread pool (nvcc runs as a subprocess per source), and hands
compiled programs to evaluation pools (`search.pools`: one judge, `evaluate(text, shape) ->
EvalResult`, per pool of W GPUs, in this process or as Ray actors), keeping one candidate in flight
per pool. Each island keeps one candidate compiling or compiled ahead, so a pool finds the next
program ready when its last one finishes.

- islands: every island starts from the seed; every `migrate_every` evaluations per island, each
  island's best is copied to the next island (ring) unless it is already there;
- selection: weighted by fitness, with a bonus for programs with few children;
- phases: while less than `explore_fraction` of the budget is spent, children change several
  dimensions (and cross over with another island's program); afterwards, one dimension at a time
  around the island's best;
- failure memory: a failed directive set is never proposed again, and its failure class steers
  proposals away from the values that caused it (see `proposer.Memory`);
- duplicates: a directive set already tried, or a rendered text already in the database (two sets
  may render the same program), is rejected before compiling;
- LLM islands (`SearchConfig.llm_islands`, the last islands of the ring): a model writes each child
  (`llm_proposer.LLMProposer`) on a thread of its own, so the GPUs evaluate other islands'
  candidates meanwhile; the child's text goes through the same duplicate test, compile-ahead and
  evaluation, and is recorded with the model as proposer and its dollars as cost. Every call is a
  row of the database's `llm_calls`; the models are chosen by a bandit (`commweave.llm.ModelPool`)
  fed with each child's fitness gain over its parent per dollar; every `llm_meta_every`
  evaluations the next proposal first asks for a summary of what worked, which later prompts carry.
  Once the dollar budget is spent LLM islands stop proposing (the run stops if no other island
  remains); the spend is in the database, so `--resume` continues with it.
Every evaluated program is committed to the database (with the pool and node that measured it) by
this process alone as its result arrives, so a run killed at any moment resumes from the database
(`Evolution(..)` on the same file): candidates in flight are proposed again, none is recorded twice.
A pool that dies mid-candidate puts it back in the queue; a program that keeps killing pools
(`SearchConfig.max_pool_deaths`) is charged with a runtime_error.
"""

from __future__ import annotations

import hashlib
import random
import re
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from commweave.contracts.program import ProgramError, parse_program
from commweave.contracts.result import EvalResult, Judge
from commweave.contracts.workload import Workload
from commweave.contracts.verdict import FailureClass, Verdict
from commweave.llm import Ledger, ModelConfig, ModelPool, client_for
from commweave.runtime.compile import CompileError
from commweave.search import prompts
from commweave.search.db import ProgramDB, ProgramRecord, code_hash
from commweave.search.llm_proposer import CallLog, LLMProposal, LLMProposer
from commweave.search.pools import LocalPools, Outcome, Placement, PoolLost, Pools
from commweave.search.proposer import Memory, OfflineProposer
from commweave.space import DirectiveSet, Template, program_body


@dataclass(frozen=True)
class Budget:
    evaluations: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        """'200' (evaluations) or '20m' / '90s' / '1.5h' (wall time)."""
        text = text.strip().lower()
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh])", text)
        if match:
            value, unit = float(match.group(1)), match.group(2)
            seconds = value * {"s": 1, "m": 60, "h": 3600}[unit]
            if seconds <= 0:
                raise ValueError(f"budget {text!r} must be positive")
            return cls(seconds=seconds)
        if re.fullmatch(r"\d+", text) and int(text) > 0:
            return cls(evaluations=int(text))
        raise ValueError(f"budget {text!r} is neither a number of evaluations (200) nor a time (20m, 90s, 1h)")

    def to_dict(self) -> dict[str, Any]:
        return {"evaluations": self.evaluations, "seconds": self.seconds}

    def fraction(self, evaluations: int, elapsed_s: float) -> float:
        parts = []
        if self.evaluations:
            parts.append(evaluations / self.evaluations)
        if self.seconds:
            parts.append(elapsed_s / self.seconds)
        return max(parts) if parts else 1.0


@dataclass
class SearchConfig:
    islands: int = 4
    migrate_every: int = 5  # evaluations per island between migrations
    explore_fraction: float = 0.4
    children_bonus: float = 1.0
    compile_workers: int = 4
    seed: int = 0
    llm_islands: int = 0  # the last llm_islands islands propose with an LLM (0: offline only)
    llm_inspirations: int = 3  # good programs shown in a prompt (other islands' first)
    llm_failures: int = 5  # latest failed programs whose messages a prompt shows
    llm_meta_every: int = 10  # evaluations between two meta-summaries of what worked
    llm_max_resamples: int = 2  # unusable answers sent back with the reason, per proposal
    llm_max_failures: int = 3  # proposals in a row without a child before an LLM island rests
    max_pool_deaths: int = 3  # pools lost while evaluating one program before the program is blamed


@dataclass
class _Pending:
    directives: DirectiveSet | None  # None while a model writes the child
    text: str | None
    island: int
    generation: int
    parent_id: int | None
    parent_ds: DirectiveSet | None
    how: str
    score: float
    future: Future | None  # the compile: (verdict, seconds); None while a model writes the child
    submitted: float
    proposer: str | None = None  # the model of an LLM child; None: the seed or the offline proposer
    writing: Future | None = None  # the model's job: (LLMProposal, llm_calls row ids)
    parent_fitness: float = 0.0
    asked_meta: bool = False
    cost: float = 0.0
    samples: int = 0
    calls: list[int] = field(default_factory=list)


class CompileAhead:
    """Compiles programs' CUDA sources on a thread pool, ahead of their evaluation.

    The text is parsed in the submitting thread (under `evaluate.program.PARSE_LOCK`, since CPython
    3.11's parser is not safe in several threads at once: gh-106905), only nvcc runs in the pool.
    The compile cache publishes
    by (key, pid), so one source must never be compiled by two threads at once: sources are
    serialised by a lock per source. The result is the verdict `Evaluator.compile` would give.
    """

    def __init__(self, compile_source: Callable[[str], Any], workers: int):
        self.compile_source = compile_source
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="cw-compile")
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock_for(self, source: str) -> threading.Lock:
        key = hashlib.sha256(source.encode()).hexdigest()
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _run(self, sources: dict[str, str]) -> tuple[Verdict, float]:
        start = time.perf_counter()
        for name, source in sources.items():
            with self._lock_for(source):
                try:
                    self.compile_source(source)
                except CompileError as exc:
                    return (Verdict.failed(FailureClass.COMPILE_ERROR, f"{name}: {exc}\n{exc.log}"),
                            time.perf_counter() - start)
        return Verdict.passed(f"{len(sources)} CUDA source(s) compiled"), time.perf_counter() - start

    def submit(self, text: str) -> Future:
        try:
            sources = parse_program(text).cuda_sources
        except ProgramError as exc:
            future: Future = Future()
            future.set_result((Verdict.failed(FailureClass.COMPILE_ERROR, str(exc)), 0.0))
            return future
        return self.pool.submit(self._run, sources)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def body_hash(text: str) -> str:
    """Hash of what runs (the directive header left out): the duplicate test."""
    return code_hash(program_body(text))


def result_timings(result: EvalResult) -> dict[str, Any]:
    """The measured figures of an evaluation, as plain JSON, with the judge's resolution (calls
    per timed batch, a batch's crossing, timed batches whose hold let go early) per program."""
    timed = {name: t for name, t in result.baselines.items()}
    if result.candidate is not None:
        timed["candidate"] = result.candidate
    resolution = {name: t.resolution() for name, t in timed.items() if t.batch is not None}
    return {"candidate_us": result.candidate.median_us if result.candidate is not None else None,
            "baseline": result.baseline, "baselines_us": {name: t.median_us for name, t in result.baselines.items()},
            "floor_us": result.floor_us, "resolution": resolution}


class Evolution:
    """One run of the search on one database. Construct, then `run()`; constructing it on an
    existing database resumes that run (its metadata must match)."""

    def __init__(self, db: ProgramDB, template: Template, evaluator: Judge | None, shape: Any, world_size: int,
                 budget: Budget, config: SearchConfig | None = None, *, proposer: OfflineProposer | None = None,
                 compile_source: Callable[[str], Any] | None = None, rates: Any = None,
                 capabilities: Any = None, on_result: Callable[[ProgramRecord, Evolution], None] | None = None,
                 llm_models: Sequence[ModelConfig] = (), llm_budget_usd: float | None = None,
                 hardware: Mapping[str, Any] | None = None, pools: Pools | None = None):
        """`llm_models`: the models of the LLM islands (`config.llm_islands` > 0 needs one);
        `llm_budget_usd`: their dollar cap (None: the resumed run's own, else none); `hardware`:
        facts measured about the machine, shown to the models as they are; `pools`: where
        candidates are evaluated, several at once (default: `evaluator` alone, one at a time)."""
        self.db, self.template = db, template
        if pools is None and evaluator is None:
            raise ValueError("the search needs an evaluator or evaluation pools")
        self.pools: Pools = pools if pools is not None else LocalPools.single(evaluator)
        self.shape, self.world_size, self.budget = shape, world_size, budget
        self.config = config or SearchConfig()
        workload = template.workload
        work = workload.cost(shape, world_size)
        self.capabilities = capabilities
        self.proposer = proposer or OfflineProposer(template, world_size, work, rates, capabilities=capabilities)
        self.compile_source = compile_source or self.pools.compile_source
        self.on_result = on_result
        self._started = time.monotonic()  # reset by run()
        self._deadline: float | None = None  # run()'s stop_after_s, as a monotonic time
        if not 0 <= self.config.llm_islands <= self.config.islands:
            raise ValueError(f"llm_islands={self.config.llm_islands} must be between 0 and islands={self.config.islands}")
        if bool(self.config.llm_islands) != bool(llm_models):
            raise ValueError(f"llm_islands={self.config.llm_islands} with {len(llm_models)} LLM model(s): LLM islands need "
                             "at least one model, and models need llm_islands > 0")
        self.llm_budget_usd = llm_budget_usd
        self._init_meta(workload, llm_models)
        self.llm: LLMProposer | None = None
        if llm_models:
            self.calls = CallLog(db)
            self.ledger = Ledger(self.llm_budget_usd, on_call=self.calls.call, spent_usd=db.llm_spent())
            self.models = ModelPool([client_for(m, self.ledger) for m in llm_models], seed=self.config.seed)
            self.llm = LLMProposer(template, world_size, shape, rates=rates, hardware=hardware,
                                   capabilities=capabilities, max_resamples=self.config.llm_max_resamples,
                                   on_unusable=self.calls.unusable)
        self._load()

    # -- state ----------------------------------------------------------------------------------
    def _init_meta(self, workload: Workload, llm_models: Sequence[ModelConfig]) -> None:
        meta = self.db.meta()
        llm = {"llm_models": [asdict(m) for m in llm_models]} if llm_models else {}
        wanted = {"workload": workload.name, "shape": str(self.shape),
                  "gpus": self.world_size, "islands": self.config.islands}
        if meta:
            clash = {k: (meta.get(k), v) for k, v in wanted.items() if meta.get(k) != v}
            if clash:
                raise ValueError("cannot resume: the run was started with " +
                                 ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in clash.items()))
            self.budget = Budget(**meta["budget"]) if meta.get("budget") else self.budget
            self.config.seed = meta.get("seed", self.config.seed)
            if self.llm_budget_usd is None:
                self.llm_budget_usd = meta.get("llm_budget_usd")
            if llm:
                self.db.set_meta(**llm, llm_budget_usd=self.llm_budget_usd, config=asdict(self.config))
            return
        self.db.set_meta(**wanted, budget=self.budget.to_dict(), seed=self.config.seed, elapsed_s=0.0,
                         started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         proposer=self.proposer.name, config=asdict(self.config), **llm,
                         **({"llm_budget_usd": self.llm_budget_usd} if llm else {}))

    def _load(self) -> None:
        self.records: dict[int, ProgramRecord] = {r.id: r for r in self.db.programs()}
        self.members: dict[int, list[int]] = {i: [] for i in range(self.config.islands)}
        self.children: dict[int, int] = {}
        self.generation: dict[int, int] = {i: 0 for i in range(self.config.islands)}
        self.memory = Memory()
        self.codes: set[str] = set()
        for r in self.records.values():
            self.codes.add(body_hash(r.code))
            self.members.setdefault(r.island, []).append(r.id)
            self.generation[r.island] = max(self.generation.get(r.island, 0), r.generation)
            for p in r.parents:
                self.children[p] = self.children.get(p, 0) + 1
            if r.directives is not None:
                ds = DirectiveSet.from_dict(r.directives)
                parent = self.records.get(r.parents[0]) if r.parents else None
                parent_ds = DirectiveSet.from_dict(parent.directives) if parent and parent.directives else None
                self.memory.record(ds, parent_ds, r.fitness, r.failure if not r.ok else None)
        for m in self.db.migrations():
            self.members.setdefault(m["to_island"], []).append(m["program_id"])
        meta = self.db.meta()
        self.meta_summary: str = meta.get("llm_meta_summary", "")
        self.meta_at: int = int(meta.get("llm_meta_at", 0))  # evaluations when the last summary was asked for
        self._meta_pending = False
        self.llm_failures = {i: 0 for i in range(self.config.islands)}  # proposals in a row without a child
        self.llm_last_error = ""
        self.llm_stopped: str | None = None  # why LLM islands stopped proposing (the budget)
        self.elapsed_before = float(meta.get("elapsed_s", 0.0))
        self._pool_deaths: dict[str, int] = {}  # program body hash -> pools lost while evaluating it
        self.evaluated = self.db.count()
        self.rng = random.Random(f"{self.config.seed}:{self.evaluated}:{len(self.db.migrations())}")

    @property
    def best(self) -> ProgramRecord | None:
        ok = [r for r in self.records.values() if r.ok]
        return max(ok, key=lambda r: (r.fitness, -r.id)) if ok else None

    def elapsed_s(self) -> float:
        return self.elapsed_before + (time.monotonic() - self._started)

    def fraction(self) -> float:
        return self.budget.fraction(self.evaluated, self.elapsed_s())

    def exhausted(self) -> bool:
        """The run's budget is spent, or this invocation's `stop_after_s` has passed."""
        return self.fraction() >= 1.0 or self._past_deadline()

    def paused(self) -> bool:
        """Stopped by `stop_after_s` with budget left: a `--resume` has more to do."""
        return self.fraction() < 1.0 and self._past_deadline()

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def phase(self) -> str:
        return "explore" if self.fraction() < self.config.explore_fraction else "exploit"

    # -- selection ------------------------------------------------------------------------------
    def _ok_members(self, island: int) -> list[ProgramRecord]:
        return [self.records[i] for i in dict.fromkeys(self.members.get(island, [])) if self.records[i].ok
                and self.records[i].directives is not None]

    def select_parent(self, island: int, phase: str) -> ProgramRecord | None:
        """Exploit: the island's best. Explore: weighted by fitness x (1 + bonus / (1 + children))."""
        members = self._ok_members(island)
        if not members:
            return None
        if phase == "exploit":
            return max(members, key=lambda r: (r.fitness, -r.id))
        weights = [r.fitness * (1 + self.config.children_bonus / (1 + self.children.get(r.id, 0))) for r in members]
        return self.rng.choices(members, weights=weights)[0] if sum(weights) > 0 else self.rng.choice(members)

    def migrate(self) -> list[tuple[int, int, int]]:
        """Each island's best goes to the next island (ring) unless already there."""
        moved = []
        bests = {i: max(self._ok_members(i), key=lambda r: (r.fitness, -r.id), default=None)
                 for i in range(self.config.islands)}
        for island, best in bests.items():
            if best is None:
                continue
            to = (island + 1) % self.config.islands
            if to != island and best.id not in self.members[to]:
                self.db.add_migration(best.id, island, to, self.generation[island])
                self.members[to].append(best.id)
                moved.append((best.id, island, to))
        return moved

    # -- the loop -------------------------------------------------------------------------------
    def _start_seed(self, compiler: CompileAhead) -> None:
        """Evaluate the seed before anything else (the other islands get it as a migrant)."""
        ds = self.template.seed_directives()
        text = self.template.render(ds, self.shape, self.world_size, self.capabilities)
        pending = _Pending(ds, text, 0, 0, None, None, "seed", 0.0, compiler.submit(text), time.monotonic())
        while True:
            started = self._start(pending)
            if started is None:
                return
            future, timings, began = started
            try:
                self._evaluated(pending, future.result(), timings, began)
                return
            except PoolLost as exc:
                if self._blame_pools(pending, exc, timings):
                    return

    def _start(self, p: _Pending) -> tuple[Future, dict[str, Any], float] | None:
        """Send a compiled candidate to a pool; a compile failure is recorded at once (None)."""
        verdict, timings = self._compiled(p)
        if not verdict.ok:
            self._record(p, verdict, 0.0, timings)
            return None
        return self.pools.submit(p.text, self.shape), timings, time.monotonic()

    def _blame_pools(self, p: _Pending, exc: PoolLost, timings: dict[str, Any]) -> bool:
        """A pool died under `p`: True once the program has killed `max_pool_deaths` pools (it is
        then recorded as a runtime_error), else False (evaluate it again elsewhere)."""
        digest = body_hash(p.text)
        self._pool_deaths[digest] = self._pool_deaths.get(digest, 0) + 1
        if self._pool_deaths[digest] < self.config.max_pool_deaths:
            return False
        why = Verdict.failed(FailureClass.RUNTIME_ERROR, f"{self._pool_deaths[digest]} pools died while evaluating "
                                                         f"this program (last: {exc})")
        self._record(p, why, 0.0, timings | {"pool": exc.placement.pool, "node": exc.placement.node})
        return True

    def _propose(self, island: int, compiler: CompileAhead, in_flight: set[str], in_flight_code: set[str]) -> _Pending | None:
        if self.is_llm(island):
            return self._propose_llm(island)
        phase = self.phase()
        parent = self.select_parent(island, phase)
        parent_ds = DirectiveSet.from_dict(parent.directives) if parent else self.template.seed_directives()
        others = [r for i in self.members if i != island for r in self._ok_members(i)]
        other = DirectiveSet.from_dict(self.rng.choice(others).directives) if others else None
        for _ in range(20):
            proposal = self.proposer.propose(parent_ds, phase, self.memory, self.rng, other, exclude=in_flight)
            if proposal is None:
                return None
            text = self.template.render(proposal.directives, self.shape, self.world_size, self.capabilities)
            digest = body_hash(text)
            if digest in self.codes or digest in in_flight_code:
                # Another directive set already rendered this exact program: not worth a GPU.
                self.memory.tried.add(proposal.directives.key)
                continue
            self.generation[island] += 1
            return _Pending(proposal.directives, text, island, self.generation[island], parent.id if parent else None,
                            parent_ds, f"{phase}: {proposal.how}", proposal.score, compiler.submit(text), time.monotonic())
        return None

    # -- LLM islands ----------------------------------------------------------------------------
    def is_llm(self, island: int) -> bool:
        return island >= self.config.islands - self.config.llm_islands

    def _inspirations(self, island: int, parent: ProgramRecord) -> list[ProgramRecord]:
        """The best correct programs, other islands' first, the parent left out."""
        def best(records: list[ProgramRecord]) -> list[ProgramRecord]:
            return sorted(records, key=lambda r: (-r.fitness, r.id))
        others = best([r for i in self.members if i != island for r in self._ok_members(i)])
        picked: dict[int, ProgramRecord] = {}
        for r in others + best(self._ok_members(island)):
            if r.id != parent.id and len(picked) < self.config.llm_inspirations:
                picked.setdefault(r.id, r)
        return list(picked.values())

    def _propose_llm(self, island: int) -> _Pending | None:
        """Start a model writing a child on the island's parent; None when the island rests."""
        if self.ledger.exhausted:
            if self.llm_stopped is None:
                self.llm_stopped = (f"the LLM budget of ${self.ledger.budget_usd:.4f} is spent "
                                    f"(${self.ledger.spent_usd:.4f})")
                self.db.set_meta(llm_stopped=self.llm_stopped)
            return None
        if self.llm_failures[island] >= self.config.llm_max_failures:
            return None
        phase = self.phase()
        parent = self.select_parent(island, phase)
        if parent is None:
            return None
        failed = sorted((r for r in self.records.values() if not r.ok), key=lambda r: -r.id)[:self.config.llm_failures]
        meta_prompt = None
        if not self._meta_pending and self.evaluated >= self.meta_at + self.config.llm_meta_every:
            best = sorted((r for r in self.records.values() if r.ok), key=lambda r: (-r.fitness, r.id))[:10]
            every_failure = [r for r in self.records.values() if not r.ok]
            meta_prompt = prompts.meta_request(best, every_failure, self.meta_summary)
            self.meta_at, self._meta_pending = self.evaluated, True
        request = self.llm.request(parent, phase, self.rng, self._inspirations(island, parent), failed,
                                   self.meta_summary, meta_prompt)
        client = self.models.choose()
        self.generation[island] += 1
        job = self._llm_pool.submit(self._write, client, request)
        return _Pending(None, None, island, self.generation[island], parent.id, DirectiveSet.from_dict(parent.directives),
                        f"{phase}: llm {request.patch}", 0.0, None, time.monotonic(), proposer=client.name, writing=job,
                        parent_fitness=parent.fitness, asked_meta=meta_prompt is not None)

    def _write(self, client: Any, request: Any) -> tuple[LLMProposal, list[int]]:
        """The model's job (an LLM thread): the proposal and the llm_calls rows it wrote."""
        self.calls.start()
        try:
            proposal = self.llm.write(client, request)
        finally:
            rows = self.calls.collect()
        return proposal, rows

    def _take_child(self, p: _Pending, compiler: CompileAhead, in_flight_code: set[str]) -> bool:
        """A finished model job: its child starts compiling (True), or it gave none (False)."""
        proposal, p.calls = p.writing.result()
        p.writing = None
        if p.asked_meta:
            self._meta_pending = False
            if proposal.meta_summary is not None:
                self.meta_summary = proposal.meta_summary
                self.db.set_meta(llm_meta_summary=self.meta_summary, llm_meta_at=self.meta_at)
        if proposal.outcome == "budget":
            return False  # the next _propose_llm stops the island, with the reason
        digest = body_hash(proposal.text) if proposal.text is not None else None
        if digest is not None and (digest in self.codes or digest in in_flight_code):
            why = "the child's program is already in the database"
            self.db.add_llm_call(model=p.proposer, purpose="propose", outcome="duplicate", message=why)
            proposal = LLMProposal(proposal.model, proposal.patch, "duplicate", None, None, proposal.cost_usd,
                                   proposal.samples, why)
        if proposal.text is None:
            self.models.reward(p.proposer, 0.0, proposal.cost_usd)
            self.llm_failures[p.island] += 1
            self.llm_last_error = f"{proposal.outcome}: {proposal.message}"
            return False
        self.llm_failures[p.island] = 0
        p.text, p.directives, p.cost, p.samples = proposal.text, proposal.directives, proposal.cost_usd, proposal.samples
        p.future = compiler.submit(p.text)
        in_flight_code.add(digest)
        return True

    def _next(self, queue: deque[_Pending], compiler: CompileAhead, in_flight_code: set[str],
              refill: Callable[[int], None], block: bool = True) -> _Pending | None:
        """The next candidate to evaluate: a compiled one first, then one compiling; a model's
        finished child joins them (a job without a child refills its island). Waits for a model
        only when nothing else is queued, and only if `block` (else None)."""
        while queue and not self.exhausted():
            for p in [p for p in queue if p.writing is not None and p.writing.done()]:
                if not self._take_child(p, compiler, in_flight_code):
                    queue.remove(p)
                    refill(p.island)
            compiling = [p for p in queue if p.writing is None]
            if compiling:
                chosen = next((p for p in compiling if p.future.done()), compiling[0])
                queue.remove(chosen)
                return chosen
            if queue:
                if not block:
                    return None
                wait([p.writing for p in queue], timeout=1.0, return_when=FIRST_COMPLETED)
        return None

    def stop_reason(self) -> str:
        """Why the last run() ended, in words."""
        if self.paused():
            return "stopped by stop_after_s with budget left"
        if self.fraction() >= 1.0:
            return "the budget is spent"
        why = []
        if self.config.llm_islands < self.config.islands:
            why.append("the offline islands found no untried candidate")
        if self.llm_stopped:
            why.append(self.llm_stopped)
        elif any(n >= self.config.llm_max_failures for n in self.llm_failures.values()):
            why.append(f"the LLM islands stopped after {self.config.llm_max_failures} proposals in a row without a "
                       f"usable child (last: {self.llm_last_error})")
        elif self.llm is not None:
            why.append("the LLM islands have no correct program to start from")
        return "; ".join(why)

    def _compiled(self, p: _Pending) -> tuple[Verdict, dict[str, Any]]:
        """Wait for the candidate's compile: its verdict and the compile's timings."""
        wait_start = time.monotonic()
        verdict, compile_s = p.future.result()
        waited = time.monotonic() - wait_start
        return verdict, {"compile_s": round(compile_s, 4), "compile_wait_s": round(waited, 4)}

    def _evaluated(self, p: _Pending, outcome: Outcome, timings: dict[str, Any], started: float) -> ProgramRecord:
        """Record a finished evaluation (in the search's thread: only it writes the database)."""
        result = outcome.result
        timings = timings | {"evaluate_s": round(time.monotonic() - started, 4), "pool": outcome.placement.pool,
                             "node": outcome.placement.node} | result_timings(result)
        return self._record(p, result.verdict, float(result.fitness), timings)

    def _record(self, p: _Pending, verdict: Verdict, fitness: float, timings: dict[str, Any]) -> ProgramRecord:
        ok = bool(verdict.ok) and fitness > 0
        failure = None if ok else str(verdict.failure or FailureClass.RUNTIME_ERROR)
        extra = {"llm_samples": p.samples} if p.proposer else {}
        self.evaluated += 1
        row_id = self.db.add_program(
            code=p.text, directives=p.directives.to_dict(), directive_key=p.directives.key,
            parents=[p.parent_id] if p.parent_id is not None else [], island=p.island, generation=p.generation,
            status="ok" if ok else "failed", fitness=fitness if ok else 0.0, failure=failure,
            message=verdict.message or "", timings=timings | {"how": p.how, "score": p.score} | extra,
            proposer=p.proposer or ("seed" if p.how == "seed" else self.proposer.name),
            cost=p.cost if p.proposer else self.proposer.cost_per_proposal, meta={"elapsed_s": self.elapsed_s()})
        if p.proposer:
            self.db.link_llm_calls(p.calls, row_id)
        record = self.db.get(row_id)
        self.records[row_id] = record
        self.members[p.island].append(row_id)
        self.codes.add(body_hash(record.code))
        if p.parent_id is not None:
            self.children[p.parent_id] = self.children.get(p.parent_id, 0) + 1
        self.memory.record(p.directives, p.parent_ds, record.fitness, failure)
        if p.proposer:
            self.models.reward(p.proposer, record.fitness - p.parent_fitness, p.cost)
        if self.on_result is not None:
            self.on_result(record, self)
        return record

    def _may_start(self, in_flight: int) -> bool:
        """Whether one more evaluation fits the budget with `in_flight` already running."""
        if self.exhausted():
            return False
        limit = self.budget.evaluations
        return limit is None or self.evaluated + in_flight < limit

    def run(self, stop_after_s: float | None = None) -> ProgramRecord | None:
        """Search until the budget is spent (or no new candidate can be proposed); the best program.

        `stop_after_s`: leave this invocation after that many seconds even with budget left (a
        machine lent for 10 minutes at a time); `--resume` continues, with the time spent so far
        counted against the run's budget."""
        self._started = time.monotonic()
        self._deadline = None if stop_after_s is None else self._started + stop_after_s
        compiler = CompileAhead(self.compile_source, self.config.compile_workers)
        # one model call at a time per LLM island, beside the compiles
        self._llm_pool = ThreadPoolExecutor(self.config.llm_islands, "cw-llm") if self.llm is not None else None
        if self.llm is not None:
            self.ledger.reopen()  # a previous run() closed it
        try:
            running: dict[Future, tuple[_Pending, dict[str, Any], float]] = {}
            if not self.records:
                self._start_seed(compiler)
            first = min(self.records)
            for island in range(1, self.config.islands):
                if not self.members.get(island):  # killed between the seed and its copies
                    self.db.add_migration(first, self.records[first].island, island, 0)
                    self.members[island] = [first]
            queue: deque[_Pending] = deque()
            in_flight: set[str] = set()
            in_flight_code: set[str] = set()

            def refill(island: int) -> None:
                if self.exhausted():
                    return
                pending = self._propose(island, compiler, in_flight, in_flight_code)
                if pending is None:  # every neighbour tried and no jump found (or the LLM stopped): the island rests
                    return
                if pending.writing is None:
                    in_flight.add(pending.directives.key)
                    in_flight_code.add(body_hash(pending.text))
                queue.append(pending)

            if not self.exhausted():
                for island in range(self.config.islands):
                    refill(island)

            def done_with(pending: _Pending) -> None:
                if pending.proposer is None:
                    in_flight.discard(pending.directives.key)
                in_flight_code.discard(body_hash(pending.text))
                every = self.config.migrate_every * self.config.islands
                if self.config.islands > 1 and self.evaluated % every == 0:
                    self.migrate()
                refill(pending.island)

            while (queue or running) and not self._past_deadline():
                while queue and len(running) < self.pools.slots and self._may_start(len(running)):
                    if self.llm is None:
                        pending = queue.popleft()
                    else:
                        pending = self._next(queue, compiler, in_flight_code, refill, block=not running)
                    if pending is None:
                        break
                    started = self._start(pending)
                    if started is None:
                        done_with(pending)
                    else:
                        running[started[0]] = (pending, started[1], started[2])
                if not running:
                    if not queue or not self._may_start(0):
                        break
                    if self.pools.slots == 0:
                        raise PoolLost("every evaluation pool is lost", Placement("-", "-"))
                    continue
                writing = [p.writing for p in queue if p.writing is not None]
                finished, _ = wait([*running, *writing], timeout=1.0, return_when=FIRST_COMPLETED)
                for future in [f for f in finished if f in running]:
                    pending, timings, began = running.pop(future)
                    try:
                        self._evaluated(pending, future.result(), timings, began)
                    except PoolLost as exc:
                        if not self._blame_pools(pending, exc, timings):
                            queue.appendleft(pending)  # compiled already: it goes to the next free pool
                            continue
                    done_with(pending)
        finally:
            for future in running:
                future.cancel()
            compiler.close()
            if self._llm_pool is not None:
                # calls still in flight are abandoned now (each books itself), so the pool ends on time
                self.ledger.close("the search run ended before the reply")
                self._llm_pool.shutdown(wait=True, cancel_futures=True)
            self.db.set_meta(elapsed_s=self.elapsed_s(), stop_reason=self.stop_reason())
        return self.best
