"""Program processes: where a candidate's (or a baseline's) code runs, never in the judge.

Each judge process (a `WorkerPool` worker, one per rank) owns a *zygote*: a Python interpreter
exec'd with the allowlisted environment (`confine.candidate_env`, so no secret is in its memory
or its /proc environ), which imports torch and the program side once and then only forks. For
every program of a job, each judge asks its zygote for one *program process*: on CPU pools it is
forked into a pid namespace of its own (`confine.fork_pid_namespace`), then confines itself
(`confine.confined_child_setup`: output on /dev/null, own session, private directory, the
program's shared network namespace and private /dev/shm, no privileges, Landlock), builds a process group of its own with the other ranks' program
processes of the same program (gloo on CPU, NCCL through `RankContext` on GPUs; rendezvous in a
judge-made folder), says `ready`, and serves the judge's requests (`serve`, by import path) over
a unix socket until it is told to exit or killed. A program process runs one program and dies;
the judge kills its whole tree (its pid namespace), waits until it has died, and as a child
subreaper also finds what escaped it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any

from commweave.runtime import confine
from commweave.runtime.wire import MAX_JUDGE_FRAME, MAX_PROGRAM_FRAME, Channel, WireError

ZYGOTE_START_S = 120.0  # an interpreter importing torch on a loaded machine
MESSAGE_CHARS = 16 << 10  # what of an exception's message crosses the wire (program side cuts it)
TRACEBACK_CHARS = 256 << 10
NOT_STARTED = "a program process did not start"  # how a failed start reads in a verdict


class ProgramStartError(RuntimeError):
    """A program process could not be started (zygote gone, confinement or process group failed)
    before any program code ran: the machine's fault, never a candidate's."""


# -- the zygote (its own interpreter) ---------------------------------------------------------------
def _zygote_main(control_fd: int, preload: list[str]) -> None:
    """Import once, then fork program processes on request and report their exit codes."""
    import importlib

    confine.die_with_parent()
    for module in preload:
        importlib.import_module(module)
    control = Connection(control_fd)
    codes: dict[int, int] = {}

    def reap(pid: int | None = None, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                done, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                codes[done] = os.waitstatus_to_exitcode(status)
                continue
            if pid is None or pid in codes or time.monotonic() >= deadline:
                return
            time.sleep(0.005)

    control.send(("ready", os.getpid()))
    while True:
        try:
            message = control.recv()
        except EOFError:
            os._exit(0)
        reap()
        if message[0] == "fork":
            child_fd = recv_handle(control)
            if message[1]["pid_namespace"]:  # the judge's handle is then the namespace's init
                pid = confine.fork_pid_namespace([child_fd, control.fileno()])
            else:
                pid = os.fork()
            if pid == 0:
                control.close()
                _program_main(child_fd, message[1])  # never returns
            os.close(child_fd)
            control.send(("forked", pid))
        elif message[0] == "exitcode":
            reap(message[1], wait_s=1.0)
            control.send(("exitcode", codes.pop(message[1], None)))


def _program_main(fd: int, args: dict[str, Any]) -> None:
    """A program process: confine, join the program's process group, say ready, serve, exit."""
    conn = Channel(socket.socket(fileno=fd), MAX_JUDGE_FRAME)
    try:
        began = time.perf_counter()
        checks = confine.confined_child_setup(
            workdir=args["workdir"], env=args["env"], rank=args["rank"], world_size=args["world_size"],
            rendezvous=args["rendezvous"], network=args["network"], filesystem=args["filesystem"],
            shm=args["shm"], privileges=args["privileges"], deny_read=args["deny_read"], keep_fds=[fd])
        confined = time.perf_counter()
        from commweave.runtime.pool import _build_context, resolve_function

        ctx = _build_context(args["rank"], args["world_size"], args["device"], str(Path(args["rendezvous"]) / "store"))
        serve = resolve_function(args["serve"])
    except BaseException as exc:  # noqa: BLE001 - reported to the judge, then this process ends
        with contextlib.suppress(Exception):
            conn.send({"init_failed": {"message": f"{type(exc).__name__}: {exc}"[:MESSAGE_CHARS],
                                       "traceback": traceback.format_exc()[-TRACEBACK_CHARS:]}})
        os._exit(2)
    conn.send({"ready": {"confine_s": confined - began, "init_s": time.perf_counter() - confined,
                         "confined": [c.line() for c in checks]}})
    code = 1  # serve reports program errors itself; anything it raises ends us
    with contextlib.suppress(BaseException):
        serve(ctx, conn)
        code = 0
        while True:  # until the judge hangs up: it looks for escaped processes while this one lives
            conn.receive(None)
    os._exit(code)


class Zygote:
    """Judge side: the zygote process and its control socket."""

    def __init__(self, preload: list[str]):
        ours, theirs = socket.socketpair()
        env = confine.candidate_env(os.environ)
        if env.get("PYTHONPATH"):  # it starts in another directory: relative entries would point elsewhere
            env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
        # never the judge's stdout/stderr (its log): a file of its own, read when it fails to start
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from commweave.runtime.candidate import _zygote_main; "
             "_zygote_main(int(sys.argv[1]), sys.argv[2:])", str(theirs.fileno()), *preload],
            env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self._stderr, cwd=confine.candidates_root(), start_new_session=True)
        theirs.close()
        self._control = Connection(ours.detach())
        if not self._control.poll(ZYGOTE_START_S):
            self.close()
            raise ProgramStartError(f"the program zygote did not start within {ZYGOTE_START_S:.0f} s")
        try:
            _, self.pid = self._control.recv()
        except EOFError:
            code = self._proc.wait()
            self._stderr.seek(0)
            said = self._stderr.read().decode(errors="replace").strip().splitlines()
            raise ProgramStartError(f"the program zygote exited with code {code} while importing "
                                    f"{', '.join(preload)}: {said[-1] if said else 'it said nothing'}") from None

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def fork(self, args: dict[str, Any]) -> tuple[int, Channel]:
        ours, theirs = socket.socketpair()
        try:
            self._control.send(("fork", args))
            send_handle(self._control, theirs.fileno(), self.pid)
            _, pid = self._control.recv()
        except (EOFError, OSError) as exc:
            raise ProgramStartError(f"the program zygote is gone: {exc}") from exc
        finally:
            theirs.close()
        return pid, Channel(ours, MAX_PROGRAM_FRAME)

    def exit_code(self, pid: int) -> int | None:
        with contextlib.suppress(EOFError, OSError):
            self._control.send(("exitcode", pid))
            return self._control.recv()[1]
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._control.close()
        confine.kill_tree(self._proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        self._stderr.close()


_ZYGOTE: Zygote | None = None
_OWN_CHILDREN: set[int] = set()  # the judge's children before any zygote: never a candidate's
PRELOAD = ["torch", "torch.distributed", "commweave.runtime.pool", "commweave.runtime.context",
           "commweave.runtime.shared_buffers"]


def own_child(pid: int) -> None:
    """A process the judge started for itself after its zygote (a problem's reference worker):
    never taken for one a program left behind."""
    _OWN_CHILDREN.add(pid)


def zygote(serve: str) -> Zygote:
    """This judge's zygote, started at first use (again if it died); the judge becomes a child
    subreaper then, so whatever a program process double-forks stays below it."""
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive:
        if _ZYGOTE is not None:
            _ZYGOTE.close()
        confine.become_subreaper()
        _OWN_CHILDREN.update(confine.descendants(os.getpid()))
        _ZYGOTE = Zygote([*PRELOAD, serve.partition(":")[0]])
    return _ZYGOTE


@dataclass(frozen=True)
class Confinement:
    """Which optional confinements program processes get on this machine (decided once per judge);
    `dropped` says which were given up and why."""

    network: bool
    filesystem: bool
    pid_namespace: bool = False
    shm: bool = False
    privileges: bool = False
    dropped: str = ""


_CONFINEMENT: Confinement | None = None


def confinement(device: str, serve: str) -> Confinement:
    """What this machine offers; on GPUs, also what lets a program process start CUDA and NCCL."""
    global _CONFINEMENT
    if _CONFINEMENT is None:
        refusals = {"network namespace": confine.net_namespace_available(),
                    "Landlock": None if confine.landlock_abi() >= 1 else "not on this kernel",
                    "pid namespace": confine.pid_namespace_available(),
                    "private /dev/shm": confine.shm_namespace_available(),
                    "privileges dropped": confine.privileges_available()}
        if device == "cuda":  # legacy CUDA IPC (the judge's buffers) works within one pid namespace only, and
            # torch's IPC reference counts are files of the machine's /dev/shm that a program opens by name
            refusals["pid namespace"] = refusals["pid namespace"] or "CUDA IPC crosses no pid namespace"
            refusals["private /dev/shm"] = refusals["private /dev/shm"] or "torch's CUDA IPC opens the judge's there"
        offered = Confinement(*(refusals[k] is None for k in ("network namespace", "Landlock", "pid namespace",
                                                              "private /dev/shm", "privileges dropped")))
        refused = "; ".join(f"{k} ({why})" for k, why in refusals.items() if why is not None)
        if refused:  # once per judge: the kernel, not a candidate, decides these
            warnings.warn(f"program processes run without: {refused} (see `commweave doctor`)", stacklevel=2)
        _CONFINEMENT = _startable(offered, serve, device) if device == "cuda" else offered
    return _CONFINEMENT


def _startable(offered: Confinement, serve: str, device: str) -> Confinement:
    """Start a throwaway program process (a world of one; on GPUs its CUDA context and NCCL
    communicator) under `offered`; where it cannot start, try without each piece in turn
    (Landlock, the network namespace, the pid namespace, the private /dev/shm, dropped
    privileges), then without all, and warn which was dropped: a judge whose programs cannot
    start on its GPUs judges nothing at all."""
    tries = [offered, replace(offered, filesystem=False), replace(offered, network=False),
             replace(offered, pid_namespace=False), replace(offered, shm=False), replace(offered, privileges=False),
             Confinement(False, False)]
    failures: list[str] = []
    for rules in dict.fromkeys(tries):
        rendezvous = make_rendezvous()
        try:
            proc = ProgramProcess.spawn(rank=0, world_size=1, device=device, rendezvous=rendezvous, serve=serve,
                                        rules=rules)
            proc.await_ready(time.monotonic() + ZYGOTE_START_S, lambda: False)
            proc.close()
        except ProgramStartError as exc:
            failures.append(f"{_pieces(rules)}: {exc}")
            continue
        finally:
            remove_rendezvous(rendezvous)
        if not failures:
            return rules
        dropped = "; ".join(failures)
        warnings.warn(f"program processes run with less confinement on this machine ({_pieces(rules)}); "
                      f"none could start with more: {dropped}", stacklevel=2)
        return replace(rules, dropped=dropped)
    raise ProgramStartError("no program process can start on this machine: " + "; ".join(failures))


def _pieces(rules: Confinement) -> str:
    return (f"network namespace {rules.network}, Landlock {rules.filesystem}, pid namespace {rules.pid_namespace}, "
            f"private /dev/shm {rules.shm}, privileges dropped {rules.privileges}")


# -- judge side: one program process --------------------------------------------------------------
@dataclass
class Reply:
    """What came back from a request: 'ok' (value), 'error' (exception type, message, traceback:
    strings), 'died' (exit code), 'timeout', 'invalid' (a frame that breaks the wire or the
    request's schema: message says how), or 'aborted' (a peer rank's judge gave up on this program)."""

    status: str
    value: Any = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""


def _strings(fields: Any, names: tuple[str, ...]) -> tuple[str, ...] | None:
    """`fields[name]` for each name when `fields` is an object of exactly those string fields."""
    if not isinstance(fields, dict) or set(fields) != set(names) or not all(isinstance(fields[n], str) for n in names):
        return None
    return tuple(fields[n] for n in names)


def _ready_fields(fields: Any) -> bool:
    """The 'ready' report: timings (numbers) and the confinement lines (strings)."""
    return (isinstance(fields, dict) and set(fields) == {"confine_s", "init_s", "confined"}
            and all(type(fields[k]) in (int, float) for k in ("confine_s", "init_s"))
            and isinstance(fields["confined"], list) and all(isinstance(c, str) for c in fields["confined"]))


@dataclass
class ProgramProcess:
    """Judge side of one rank's program process."""

    pid: int
    conn: Channel
    zygote: Zygote
    workdir: contextlib.ExitStack
    ready: dict[str, Any] = field(default_factory=dict)
    closed: bool = False
    #: CPU judges: stop the program's process group the moment an answer arrives and continue it
    #: with the next request, so what the judge reads (outputs, inputs) is what existed at the reply
    stop_at_reply: bool = False
    stopped: frozenset[int] = frozenset()  # what the last stop froze, until resumed
    replied_at: float = 0.0  # perf_counter() when the last answer arrived (before any stop)
    program_pid: int | None = None  # below `pid` (its namespace's init) in a pid namespace; else `pid` itself

    @classmethod
    def spawn(cls, *, rank: int, world_size: int, device: str, rendezvous: Path, serve: str,
              rules: Confinement) -> ProgramProcess:
        """Fork a program process (it then confines itself by `rules` and joins its process group)."""
        stack = contextlib.ExitStack()
        workdir = stack.enter_context(confine.private_workdir())
        z = zygote(serve)
        args = dict(rank=rank, world_size=world_size, device=device, rendezvous=str(rendezvous), serve=serve,
                    workdir=str(workdir), env=confine.candidate_env(os.environ, workdir),
                    network=rules.network, filesystem=rules.filesystem, pid_namespace=rules.pid_namespace,
                    shm=rules.shm, privileges=rules.privileges, deny_read=confine.run_paths())
        try:
            pid, conn = z.fork(args)
        except ProgramStartError:
            stack.close()
            raise
        return cls(pid, conn, z, stack, program_pid=None if rules.pid_namespace else pid)

    def await_ready(self, deadline: float, abort: Callable[[], bool]) -> None:
        """Wait until it is confined and its process group is up; ProgramStartError if not. (No
        program code has run yet: only the harness speaks here.)"""
        reply = self.wait(deadline, abort)
        if reply.status == "ok" and _ready_fields(reply.value.get("ready")):
            self.ready = reply.value["ready"]
            if self.program_pid is None:
                self.program_pid = confine.program_process(self.pid)
            return
        self.close()
        if reply.status == "aborted":
            raise ProgramStartError("aborted: a peer rank's program process failed to start")
        failed = _strings(reply.value.get("init_failed"), ("message", "traceback")) if reply.status == "ok" else None
        what = (failed[0] if failed else {"ok": "it sent something else than 'ready'", "invalid": reply.message,
                                          "died": f"it died (exit code {reply.value})",
                                          "timeout": "no answer in time"}[reply.status])
        raise ProgramStartError(f"{NOT_STARTED}: {what}")

    def wait(self, deadline: float, abort: Callable[[], bool]) -> Reply:
        """The next message (a JSON object), unless the process dies, sends a frame that breaks
        the wire, `deadline` passes (a frame begun and not finished by then too) or `abort()`
        turns true."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Reply("timeout")
            try:
                message = self.conn.receive(min(0.05, remaining))
            except WireError as exc:
                return Reply("invalid", message=str(exc))
            except (EOFError, OSError):
                return Reply("died", self.zygote.exit_code(self.pid))
            if message is not None:
                self.replied_at = time.perf_counter()
                return Reply("ok", message)
            if abort():
                return Reply("aborted")

    def request(self, message: dict[str, Any], deadline: float, abort: Callable[[], bool],
                then: Callable[[], None] | None = None, expect: tuple[type, ...] = (type(None),)) -> Reply:
        """Send `message` (and whatever `then()` sends after it), then check the answer against the
        schema: {"ok": value of a type in `expect`} or {"error": {"type", "message", "traceback"}}
        (strings); anything else is 'invalid'."""
        try:
            self.resume()
            self.conn.send(message)
            if then is not None:
                then()
        except OSError:
            return Reply("died", self.zygote.exit_code(self.pid))
        reply = self.wait(deadline, abort)
        if reply.status in ("ok", "invalid") and self.stop_at_reply:
            self.stop(deadline)
        if reply.status != "ok":
            return reply
        answer = reply.value
        if set(answer) == {"ok"} and type(answer["ok"]) in expect:
            return Reply("ok", answer["ok"])
        error = _strings(answer.get("error"), ("type", "message", "traceback")) if set(answer) == {"error"} else None
        if error is not None:
            return Reply("error", None, *error)
        names = " or ".join(t.__name__ for t in expect)
        return Reply("invalid", message=f"an answer outside the schema ({{'ok': {names}}} or {{'error': ...}}): "
                                        f"{sorted(answer)[:5]}")

    def stop(self, deadline: float) -> None:
        """Stop the program's processes (`confine.freeze`: its pid namespace's init and all below
        it, or its tree) and wait (until `deadline`) for every thread of the program process to be
        stopped."""
        self.stopped = confine.freeze(self.pid, [self.program_pid] if self.program_pid else [])
        target = self.program_pid or self.pid
        while time.monotonic() < deadline and not confine.all_threads_stopped(target):
            time.sleep(0.0001)

    def resume(self) -> None:
        """Continue what `stop` stopped."""
        if self.stopped:
            confine.thaw(self.stopped)
            self.stopped = frozenset()

    def close(self) -> int:
        """Kill the program process's whole tree (its pid namespace with it), wait until it has
        died, then whatever escaped it (double-forked, now our children); remove its private
        directory. Returns how many processes had escaped: in a session other than the program's,
        or reparented to the judge and alive after the program drained."""
        if self.closed:
            return 0
        self.closed = True
        left = confine.left_session(self.pid, self.program_pid) if self.program_pid else set()
        with contextlib.suppress(OSError):
            self.conn.close()
        confine.kill_tree(self.pid)
        self.zygote.exit_code(self.pid)  # let the zygote reap it
        orphans = confine.kill_tree(os.getpid(), keep=[self.zygote.pid, *_OWN_CHILDREN], include_root=False)
        self.workdir.close()
        return len(left) + orphans


def make_rendezvous() -> Path:
    """A fresh folder the ranks of one program share (process-group store, network namespace)."""
    return Path(tempfile.mkdtemp(prefix="rdzv_", dir=confine.candidates_root()))


def remove_rendezvous(path: Path) -> None:
    if path.exists():
        confine.remove_tree(path)
