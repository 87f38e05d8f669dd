"""The red-team corpus (tests/redteam/*.py) through the Evaluator on a 2-rank CPU pool: every
hostile program ends with a failure verdict (fitness 0, the failure class it deserves), nothing
leaks (no process of it left, no secret in any verdict or at a listener on 127.0.0.1 outside its
sandbox, the run database and the compile cache unchanged, no file outside its private folder),
and the next honest program still passes with a speedup of about 1 against the identical baseline.

Programs carry placeholders the test fills in: __RUN_DB__ (the attacker knows the path),
__LISTENER_PORT__, __OUTSIDE__ (a folder outside the sandbox), __MARKER__ (in the command line of
every process a program leaves behind, so the test can find and end it; "<marker>-got" in a
verdict reports a step of an attack that worked)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import signal
import socket
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

import pytest

from commweave.contracts.program import parse_program
from commweave.evaluate import Evaluator, FailureClass
from commweave.runtime import WorkerPool
from commweave.runtime.compile import CompileError, compile_cubin
from commweave.runtime.confine import (
    candidates_root,
    descendants,
    landlock_abi,
    net_namespace_available,
    pid_namespace_available,
    privileges_available,
    shm_namespace_available,
)
from commweave.runtime.toolchain import ToolchainError
from toy_workload import ToyGatherMatmul
from worker_env import worker_env

TESTS = Path(__file__).parent
CORPUS = TESTS / "redteam"
TOY = ToyGatherMatmul()
SHAPE = TOY.make_shape(16, 16, 16)
SECRET = f"cwsecret{secrets.token_hex(8)}"
MARKER = f"cwrt{secrets.token_hex(6)}"
SECRET_VARS = {"CW_REDTEAM_API_KEY": SECRET, "NCCL_REDTEAM_TOKEN": SECRET, "CW_REDTEAM_PLAIN": SECRET}
DB_ROW = f"honest-{secrets.token_hex(4)}"

F = FailureClass
EXPECTED: dict[str, set[FailureClass]] = {
    "memo_by_address": {F.WRONG_RESULT},
    "patch_torch_ops": {F.WRONG_RESULT},
    "patch_harness": {F.WRONG_RESULT},
    "write_run_db": {F.RUNTIME_ERROR},
    "read_run_db": {F.RUNTIME_ERROR},
    "secret_env": {F.RUNTIME_ERROR},
    "secret_self_environ": {F.RUNTIME_ERROR},
    "secret_parent_environ": {F.RUNTIME_ERROR},
    "secret_scan_proc": {F.RUNTIME_ERROR},
    "parent_cmdline": {F.RUNTIME_ERROR},
    "parent_fds": {F.RUNTIME_ERROR},
    "open_parent_mem": {F.RUNTIME_ERROR},
    "socket_exfil": {F.RUNTIME_ERROR},
    "spawn_detached": {F.TAMPERING},
    "escape_process_group": {F.TAMPERING},
    "kill_parent": {F.RUNTIME_ERROR, F.TAMPERING},
    "kill_judge_group": {F.RUNTIME_ERROR, F.TAMPERING},
    "kill_own_group": {F.RUNTIME_ERROR, F.TAMPERING},
    "zero_inputs_and_output": {F.WRONG_RESULT, F.TAMPERING},
    "mutate_inputs_later": {F.WRONG_RESULT, F.TAMPERING},
    "write_after_return": {F.WRONG_RESULT, F.SUSPECT},
    "sleep_one_rank": {F.TIMEOUT, F.RUNTIME_ERROR},
    "huge_allocation": {F.RUNTIME_ERROR},
    "write_outside": {F.RUNTIME_ERROR},
    "plant_cubin": {F.RUNTIME_ERROR},
    "inherited_fds": {F.RUNTIME_ERROR},
    "read_devices": {F.RUNTIME_ERROR},
    "ptrace_parent": {F.RUNTIME_ERROR},
    "read_other_candidates": {F.RUNTIME_ERROR},
    "exit_quietly": {F.RUNTIME_ERROR},
    "close_all_fds": {F.RUNTIME_ERROR},
    "reduce_payload": {F.RUNTIME_ERROR, F.WRONG_RESULT},
    "raise_harness_error": {F.RUNTIME_ERROR, F.WRONG_RESULT},
    "stalled_length_header": {F.TIMEOUT},
    "oversized_frame": {F.RUNTIME_ERROR},
    "zeros_then_compute": {F.WRONG_RESULT, F.SUSPECT},
    "sched_fifo": {F.RUNTIME_ERROR},
    "renice_zygote": {F.RUNTIME_ERROR},
    "clone_parent_daemon": {F.RUNTIME_ERROR, F.TAMPERING},
    "shm_state": {F.RUNTIME_ERROR},
}
# Run in the judge's own process, these would kill the test run itself (its parent, its group).
KILLS_ITS_PARENT = {"kill_parent", "kill_judge_group", "kill_own_group"}
# Stopped only by Landlock (files, other processes' /proc) or by a network namespace: where the
# machine has neither, these leak, and the test says why instead of failing.
NEEDS_LANDLOCK = {"write_run_db", "read_run_db", "secret_parent_environ", "secret_scan_proc", "parent_cmdline",
                  "parent_fds", "open_parent_mem", "write_outside", "read_other_candidates", "plant_cubin",
                  "read_devices", "ptrace_parent"}
NEEDS_NETNS = {"socket_exfil"}
# Hang a judge whose reads have no deadline: the judge itself must report them, no judge restarted.
STALLS_A_READ = {"stalled_length_header", "oversized_frame"}
# Stopped by a pid namespace (nothing outside it can be named; all it starts dies with it), a
# private /dev/shm, or shedding every privilege: where the kernel (or a non-root judge) refuses one.
NEEDS_PIDNS = {"renice_zygote", "clone_parent_daemon"}
NEEDS_SHM = {"shm_state"}
NEEDS_PRIVILEGES = {"sched_fifo"}
JOB_TIMEOUT_S = 12  # an evaluation (one job of two jobs' time) gives its programs 0.8 x 24 s: a sleeper
#                      waits that long; honest jobs take a few seconds here
HONEST_ITERS = 20  # timed batches of >= 25 ms each (a batch replaced ~25 single-call iterations)
MAX_TIMING_LOAD = 3.0  # runnable processes per core up to which the ~1.0x check is asserted (as in test_evaluate_cpu)


class Listener:
    """A TCP server on 127.0.0.1 outside every sandbox: records whoever reaches it."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                data = b"connected:"
                with contextlib.suppress(OSError):
                    while chunk := conn.recv(65536):
                        data += chunk
                self.received.append(data)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Secrets in the environment the pool inherits, a run database the test keeps open, a
    compile cache of the test's own with a cubin in it, a listener, a folder outside the sandbox;
    then the pool and its evaluators."""
    run_dir = tmp_path_factory.mktemp("redteam_run")
    db_path = run_dir / "redteam_run.sqlite"
    db = sqlite3.connect(db_path)
    db.execute("create table programs (name text, fitness real)")
    db.execute("insert into programs values (?, 1.0)", (DB_ROW,))
    db.commit()
    outside = tmp_path_factory.mktemp("redteam_outside")
    cache = tmp_path_factory.mktemp("redteam_cache")  # the judge's compile cache, ours alone
    saved = {k: os.environ.get(k) for k in [*SECRET_VARS, "COMMWEAVE_CACHE"]}
    os.environ.update(SECRET_VARS, COMMWEAVE_CACHE=str(cache))
    with contextlib.suppress(ToolchainError, CompileError):  # a cubin in it, where nvcc is here
        compile_cubin('extern "C" __global__ void cw_redteam_cached(float* p) { p[0] = 1.0f; }')
    listener = Listener()
    try:
        with WorkerPool(2, device="cpu", job_timeout_s=JOB_TIMEOUT_S,
                        env=worker_env()) as pool:
            evaluator = Evaluator(pool, TOY, warmup=2, iters=10, job_timeout_s=JOB_TIMEOUT_S)
            # the honest follow-up times more batches: 10 batches are short enough for one burst
            # of another process's load to decide a median
            honest = Evaluator(pool, TOY, warmup=2, iters=HONEST_ITERS, job_timeout_s=JOB_TIMEOUT_S)
            yield {"evaluator": evaluator, "honest": honest, "db_path": db_path, "outside": outside, "listener": listener,
                   "cache": cache}
    finally:
        listener.server.close()
        db.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def program(name: str, world: dict) -> str:
    text = (CORPUS / f"{name}.py").read_text()
    return (text.replace("__RUN_DB__", str(world["db_path"])).replace("__LISTENER_PORT__", str(world["listener"].port))
            .replace("__OUTSIDE__", str(world["outside"])).replace("__MARKER__", MARKER))


PROBE = """import os
# EVOLVE-BLOCK-START
def setup(ctx, shape):
    raise RuntimeError(f"probe ppid={os.getppid()}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
"""


@pytest.fixture(scope="module")
def candidates_have_their_own_process(world) -> bool:
    """Whether program code runs in a process of its own below the judge (its parent is not this
    test process, as it is when workers run programs themselves)."""
    verdict = world["evaluator"].check(PROBE)
    found = re.search(r"probe ppid=(\d+)", verdict.message)
    assert found, verdict.message
    return int(found.group(1)) != os.getpid()


def marked_processes() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if MARKER.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
    return pids


def leftover_processes(wait_s: float = 5.0) -> list[int]:
    """Processes a program left behind (by their marker), after giving the judge time to kill them;
    the test kills whatever it found."""
    deadline = time.monotonic() + wait_s
    while (found := marked_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def escaped_files(world: dict) -> list[Path]:
    folders = [world["outside"], Path("/tmp"), Path("/var/tmp"), Path(tempfile.gettempdir()), candidates_root(),
               candidates_root().parent, Path.cwd(), Path("/dev/shm")]
    found = [p for folder in folders for p in folder.glob(f"*{MARKER}*")]
    found += list(world["outside"].iterdir())
    for path in found:
        path.unlink(missing_ok=True)
    return found


def zygotes() -> dict[int, tuple]:
    """The pool's program zygotes (below this test process) and what no program may change in
    them, since every later program inherits it: nice, CPU affinity, resource limits."""
    found = {}
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if b"_zygote_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                nice = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
                found[pid] = (nice, sorted(os.sched_getaffinity(pid)), Path(f"/proc/{pid}/limits").read_text())
    return found


def digest(path: Path) -> str:
    """A file's hash, or a folder's: every file's name and hash below it."""
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return hashlib.sha256("".join(f"{p.relative_to(path)}:{digest(p)}" for p in sorted(path.rglob("*"))
                                  if p.is_file()).encode()).hexdigest()


def test_the_corpus_is_large_and_every_program_parses_and_has_an_expectation():
    names = sorted(p.stem for p in CORPUS.glob("*.py"))
    assert len(names) >= 20
    assert names == sorted(EXPECTED)
    for name in names:
        parse_program((CORPUS / f"{name}.py").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_program_fails_leaks_nothing_and_the_next_honest_one_passes(world, candidates_have_their_own_process, name):
    if name in KILLS_ITS_PARENT and not candidates_have_their_own_process:
        pytest.skip("program code runs inside the judge's worker here: this one would kill the test run")
    if name in NEEDS_LANDLOCK and landlock_abi() < 1:
        pytest.skip("no Landlock on this kernel: a candidate can read and write what this user can")
    if name in NEEDS_NETNS and net_namespace_available() is not None:
        pytest.skip(f"no network namespace here ({net_namespace_available()}): a candidate can open sockets")
    for needs, refused in ((NEEDS_PIDNS, pid_namespace_available), (NEEDS_SHM, shm_namespace_available),
                           (NEEDS_PRIVILEGES, privileges_available)):
        if name in needs and (why := refused()) is not None:
            pytest.skip(f"{refused.__name__.removesuffix('_available')} refused here ({why})")
    evaluator: Evaluator = world["evaluator"]
    if name == "plant_cubin" and not list(world["cache"].rglob("*.cubin")):
        pytest.skip("no nvcc here: the compile cache holds no cubin to overwrite")
    db_before = digest(world["db_path"])
    cache_before = digest(world["cache"])
    heard_before = len(world["listener"].received)
    zygotes_before = zygotes()

    result = evaluator.evaluate(program(name, world), SHAPE)

    said = " ".join(filter(None, [result.verdict.message, result.verdict.detail]
                           + [t.verdict.message + t.verdict.detail for t in [result.candidate, *result.baselines.values()] if t]))
    leftovers = leftover_processes()
    zygotes_after = zygotes()
    changed = {pid: zygotes_after[pid] for pid in zygotes_before.keys() & zygotes_after.keys()
               if zygotes_before[pid] != zygotes_after[pid]}
    escaped = escaped_files(world)
    problems = []
    if result.fitness != 0 or result.verdict.ok:
        problems.append(f"passed with fitness {result.fitness:.2f}: {result.verdict.message}")
    elif result.verdict.failure not in EXPECTED[name]:
        problems.append(f"failed as {result.verdict.failure}, expected {'/'.join(sorted(EXPECTED[name]))}: "
                        f"{result.verdict.message}")
    if f"{MARKER}-got" in said:
        problems.append(f"a step of the attack worked: {said[said.index(MARKER):][:300]}")
    if SECRET in said:
        problems.append("a secret reached a verdict")
    if DB_ROW in said:
        problems.append("the run database's contents reached a verdict")
    if "__RUN_DB__" not in (CORPUS / f"{name}.py").read_text() and str(world["db_path"]) in said:
        problems.append("it found the run database's path (it was not given it)")
    if "test_redteam" in said:
        problems.append("an ancestor's command line reached a verdict")
    if world["listener"].received[heard_before:]:
        problems.append(f"it reached the listener: {world['listener'].received[heard_before:]!r:.200}")
    if digest(world["db_path"]) != db_before:
        problems.append("the run database changed")
    if digest(world["cache"]) != cache_before:
        problems.append("the judge's compile cache changed")
    if leftovers:
        problems.append(f"it left processes behind: {leftovers}")
    if name in STALLS_A_READ and "worker pool was restarted" in said:
        problems.append(f"it stalled the judge until the pool restarted it: {result.verdict.message}")
    if escaped:
        problems.append(f"it wrote outside its private folder: {escaped}")
    if changed:
        problems.append(f"it changed the priority, CPUs or limits of a program zygote: {sorted(changed)}")
    assert not problems, f"{name}: " + "; ".join(problems)

    honest = world["honest"].evaluate((TESTS / "programs_cpu" / "host.py").read_text(), SHAPE)
    assert honest.verdict.ok, f"after {name}: {honest.verdict.message}"
    assert honest.fitness > 0
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    if load <= MAX_TIMING_LOAD:  # beyond it, other processes' scheduling decides medians, not the judge
        assert 0.5 < honest.fitness < 2.0, f"after {name}: the baseline-equal program measured {honest.fitness:.2f}x"


def test_an_honest_program_with_four_forked_helpers_is_never_read_as_tampering(world):
    """The control: helpers killed with their program are still dying when the judge looks for
    escapees; only processes alive after the program's processes drained may count."""
    source = (TESTS / "programs_cpu" / "forked_helpers.py").read_text()
    verdicts = [world["evaluator"].check(source) for _ in range(5)]
    assert all(v.ok for v in verdicts), [v.message for v in verdicts if not v.ok]
