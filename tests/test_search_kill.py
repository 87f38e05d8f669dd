"""SIGKILL of a search takes its worker processes with it: judges, their zygotes and program
processes are gone 5 s later (none reparented to init, holding devices), and what they leave in the
temp folder is the pool's one folder (the killed search cannot remove it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

TESTS = Path(__file__).parent

SEARCH = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from commweave.evaluate import Evaluator
    from commweave.runtime import WorkerPool
    from commweave.search import Budget, Evolution, ProgramDB, SearchConfig
    from test_search_cli import ToyTemplate
    template = ToyTemplate()
    with WorkerPool(2, device="cpu", job_timeout_s=60) as pool:
        evaluator = Evaluator(pool, template.workload, warmup=1, iters=200, seeds=2)
        Evolution(ProgramDB(sys.argv[1]), template, evaluator, template.default_shape(2), 2,
                  Budget(evaluations=1000), SearchConfig(islands=2, seed=1)).run()
""")


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _running_workers(proc: subprocess.Popen, ready: Callable[[], bool]) -> set[int]:
    """The processes below `proc` once its judges, a zygote each and program processes run (and
    `ready()` holds), within 120 s."""
    deadline = time.monotonic() + 120
    workers: set[int] = set()
    while time.monotonic() < deadline:
        workers = _descendants(proc.pid)
        if len(workers) >= 6 and ready():
            break
        time.sleep(0.2)
    assert len(workers) >= 4, f"the workers never started: {workers}"
    return workers


def test_sigkill_of_the_search_leaves_no_worker(tmp_path) -> None:
    temp = tmp_path / "tmp"  # the search's temp folder: what the killed search leaves goes with tmp_path
    temp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SEARCH, str(tmp_path / "run.sqlite"), str(TESTS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(temp)})
    try:
        workers = _running_workers(proc, lambda: (tmp_path / "run.sqlite").exists())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(5)
        left = sorted(pid for pid in workers | _descendants(proc.pid) if _alive(pid))
        assert not left, f"processes alive 5 s after SIGKILL of the search: {left}"
        pools = [p.name for p in temp.iterdir()]
        assert len(pools) == 1 and pools[0].startswith("cw_pool_"), pools
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_of_a_command_tears_its_pool_down(tmp_path) -> None:
    """SIGTERM (a scheduler, `timeout`) interrupts a command like Ctrl-C: its judges and their
    program processes are killed at once, not after the job, and the pool's folder is removed."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    problem = TESTS / "problems" / "allgather_matmul.py"
    proc = subprocess.Popen([sys.executable, "-m", "commweave", "judge", str(problem), str(problem), "--gpus", "2",
                             "--device", "cpu", "--iters", "1000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(temp)})
    try:
        workers = _running_workers(proc, lambda: True)
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)
        assert proc.returncode == 130  # an interrupt's exit code, as after Ctrl-C
        time.sleep(2)
        left = sorted(pid for pid in workers if _alive(pid))
        assert not left, f"processes alive after SIGTERM of the command: {left}"
        assert not list(temp.iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
