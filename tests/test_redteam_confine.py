"""runtime.confine on its own: the environment allowlist, the private directory, death with the
parent, killing a whole tree (double-forked daemons included), the network namespace and Landlock.
Each confined piece runs in a forked child that reports over a pipe; pieces the machine does not
permit are skipped with the reason `confine.status()` gives."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from commweave.runtime import confine
from commweave.runtime.confine import SAFE_ENV
from commweave.runtime.toolchain import cache_dir

SRC = str(Path(__file__).parent.parent / "src")
NETNS_MISSING = confine.net_namespace_available()
needs_netns = pytest.mark.skipif(NETNS_MISSING is not None, reason=f"no network namespace here: {NETNS_MISSING}")
needs_landlock = pytest.mark.skipif(confine.landlock_abi() < 1, reason="Landlock is not available on this kernel")


def in_children(world: int, fn) -> list:
    """Run fn(rank) in `world` forked children at once; return what each returned, in rank order
    (an exception raised in a child fails the test with its message)."""
    reads, pids = [], []
    for rank in range(world):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                answer = {"value": fn(rank)}
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(write, json.dumps(answer, default=str).encode())
            os._exit(0)
        os.close(write)
        reads.append(read)
        pids.append(pid)
    answers = []
    for read in reads:
        with os.fdopen(read, "rb") as pipe:
            answers.append(json.loads(pipe.read()))
    for pid in pids:
        os.waitpid(pid, 0)
    errors = [a["error"] for a in answers if "error" in a]
    assert not errors, errors
    return [a["value"] for a in answers]


def in_child(fn, *args):
    """Run fn(*args) in a forked child; return what it returned."""
    return in_children(1, lambda _rank: fn(*args))[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_dead(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


# -- environment -----------------------------------------------------------------------------------
def test_env_allowlist_drops_secrets_and_run_paths_and_keeps_what_torch_needs(tmp_path):
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x", "PYTHONPATH": "/p", "CUDA_VISIBLE_DEVICES": "0",
            "NCCL_DEBUG": "WARN", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "COMMWEAVE_CACHE": "/c",
            "OPENAI_API_KEY": "sk-1", "ANTHROPIC_API_KEY": "sk-2", "GITHUB_TOKEN": "t", "AWS_SECRET_ACCESS_KEY": "s",
            "AWS_ACCESS_KEY_ID": "a", "SSH_AUTH_SOCK": "/run/ssh", "NCCL_AUTH_TOKEN": "n", "COMMWEAVE_DB": "/run/db",
            "COMMWEAVE_LLM_CONFIG": "/run/llm.toml", "HOME": "/root", "TMPDIR": "/tmp", "GOOGLE_APPLICATION_CREDENTIALS": "g",
            "NCCL_NVLS_ENABLE": "1"}
    env = confine.candidate_env(base, tmp_path, extra={"RANK": "1", "HF_TOKEN": "h"})
    for name in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "MASTER_ADDR",
                 "MASTER_PORT", "RANK"):
        assert env[name] == {**base, "RANK": "1"}[name], name
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID",
                 "SSH_AUTH_SOCK", "NCCL_AUTH_TOKEN", "COMMWEAVE_DB", "COMMWEAVE_LLM_CONFIG", "HF_TOKEN",
                 "GOOGLE_APPLICATION_CREDENTIALS"):
        assert name not in env, name
    assert env["HOME"] == str(tmp_path / "home") and env["TMPDIR"] == str(tmp_path / "tmp")
    assert all(env[k] == v for k, v in SAFE_ENV.items())  # forced, even over the base's NCCL_NVLS_ENABLE=1
    # the judge's compile cache is shared read-only; what the program compiles goes to its own
    assert env["COMMWEAVE_CACHE_SHARED"] == "/c" and env["COMMWEAVE_CACHE"] == str(tmp_path / "home" / ".cache" / "commweave")
    without_cache = confine.candidate_env({k: v for k, v in base.items() if k != "COMMWEAVE_CACHE"}, tmp_path)
    assert without_cache["COMMWEAVE_CACHE_SHARED"] == str(cache_dir())  # the judge's, not one below the new HOME
    assert confine.candidate_env(base)["COMMWEAVE_CACHE"] == "/c"  # no private folder (the zygote): the judge's
    runs = {"COMMWEAVE_DENY_READ": os.pathsep.join(["/data/runs", "/srv/db"])}
    assert confine.run_paths(runs) == ["/data/runs", "/srv/db"] and "COMMWEAVE_DENY_READ" not in confine.candidate_env(runs)


def test_a_program_reads_the_shared_compile_cache_and_writes_only_its_own(tmp_path, monkeypatch):
    from commweave.runtime.compile import compile_cubin

    source = 'extern "C" __global__ void cw_shared_cache_probe(float* p) { p[0] = 1.0f; }'
    monkeypatch.setenv("COMMWEAVE_CACHE", str(tmp_path / "judge"))
    compiled = compile_cubin(source)
    env = confine.candidate_env({"COMMWEAVE_CACHE": str(tmp_path / "judge")}, tmp_path / "program")
    monkeypatch.setenv("COMMWEAVE_CACHE", env["COMMWEAVE_CACHE"])
    monkeypatch.setenv("COMMWEAVE_CACHE_SHARED", env["COMMWEAVE_CACHE_SHARED"])
    again = compile_cubin(source)
    assert again.cached and again.path == compiled.path
    fresh = compile_cubin(source.replace("1.0f", "2.0f"))
    assert not fresh.cached and fresh.path.is_relative_to(tmp_path / "program")


# -- private directory -----------------------------------------------------------------------------
def test_private_workdir_is_fresh_private_and_removed_even_when_locked():
    with confine.private_workdir() as first, confine.private_workdir() as second:
        assert first != second and first.parent == second.parent == confine.candidates_root()
        assert stat.S_IMODE(first.stat().st_mode) == 0o700
        assert (first / "home").is_dir() and (first / "tmp").is_dir()
        locked = first / "home" / "locked"
        locked.mkdir()
        (locked / "f").write_text("x")
        locked.chmod(0)
    assert not first.exists() and not second.exists()


# -- processes --------------------------------------------------------------------------------------
MIDDLE = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {src!r})
    from commweave.runtime import confine
    parent = os.getpid()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        confine.die_with_parent(parent=parent)
        os.write(ready_w, b"1")
        time.sleep(60)
        os._exit(0)
    os.read(ready_r, 1)
    print(pid, flush=True)
    time.sleep(60)
""")


def test_a_child_dies_with_its_parent():
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE.format(src=SRC)], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    assert alive(child)
    middle.kill()
    middle.wait()
    assert wait_dead(child), f"child {child} outlived its parent"


DAEMON = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {src!r})
    from commweave.runtime import confine
    {setup}
    if os.fork() == 0:           # the candidate: double fork + setsid, then the middle exits
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                open({pidfile!r}, "w").write(str(os.getpid()))
                time.sleep(60)
                os._exit(0)
            os._exit(0)
        os._exit(0)
    while not os.path.exists({pidfile!r}):
        time.sleep(0.01)
    time.sleep(0.2)
    print(int(int(open({pidfile!r}).read()) in confine.descendants(os.getpid())), flush=True)
    {after}
""")


def daemon_judge(tmp_path: Path, setup: str, after: str) -> tuple[subprocess.Popen, int, bool]:
    """A stand-in judge whose candidate leaves a daemon: (judge, daemon pid, daemon is below the judge)."""
    pidfile = str(tmp_path / "daemon.pid")
    script = DAEMON.format(src=SRC, setup=setup, after=after, pidfile=pidfile)
    judge = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    below = judge.stdout.readline().strip() == "1"
    return judge, int(Path(pidfile).read_text()), below


def test_kill_tree_reaches_a_double_forked_daemon_through_the_subreaper(tmp_path):
    judge, daemon, below = daemon_judge(tmp_path, "confine.become_subreaper()",
                                        "confine.kill_tree(os.getpid(), include_root=False); time.sleep(60)")
    try:
        assert below, "the daemon was not reparented to the subreaper"
        assert wait_dead(daemon), "kill_tree left the daemon alive"
    finally:
        judge.kill()
        judge.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon, signal.SIGKILL)


def test_without_a_subreaper_the_daemon_escapes_the_tree(tmp_path):
    """Why the judge must be a subreaper: the same daemon is no descendant of a plain parent."""
    judge, daemon, below = daemon_judge(tmp_path, "", "")
    judge.wait()
    try:
        assert not below and alive(daemon)
    finally:
        os.kill(daemon, signal.SIGKILL)


def test_kill_tree_kills_a_group_and_its_descendants_but_keeps_what_it_is_told():
    tree = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                             "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
                             "print(a.pid, b.pid, flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    a, b = (int(p) for p in tree.stdout.readline().split())
    try:
        assert confine.left_session(tree.pid) == {b}
        confine.kill_tree(tree.pid, keep=[b])
        tree.wait(timeout=5)
        assert wait_dead(a) and alive(b)
    finally:
        confine.kill_tree(tree.pid)
        os.kill(b, signal.SIGKILL)


def test_close_fds_keeps_only_what_it_is_told():
    keep_r, keep_w = os.pipe()
    drop_r, drop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # exit status: bit i set when descriptor i of the four is still open
        confine.close_fds(keep=[keep_w])
        code = 0
        for bit, fd in enumerate((keep_r, drop_r, drop_w, keep_w)):
            try:
                os.fstat(fd)
                code |= 1 << bit
            except OSError:
                pass
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    for fd in (keep_r, keep_w, drop_r, drop_w):
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0b1000


# -- network namespace ------------------------------------------------------------------------------
@needs_netns
def test_network_namespace_has_loopback_and_nothing_else():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def child():
        confine.new_net_namespace()
        outcome = {}
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            outcome["host_listener"] = "reached"
        except OSError as exc:
            outcome["host_listener"] = type(exc).__name__
        inner = socket.create_server(("127.0.0.1", 0))
        socket.create_connection(inner.getsockname(), timeout=2).close()
        outcome["own_loopback"] = "reached"
        outcome["interfaces"] = sorted(name for _, name in socket.if_nameindex())
        return outcome

    try:
        outcome = in_child(child)
    finally:
        listener.close()
    assert outcome == {"host_listener": "ConnectionRefusedError", "own_loopback": "reached", "interfaces": ["lo"]}


@needs_netns
def test_ranks_share_one_namespace_and_run_gloo_in_it(tmp_path):
    import torch
    import torch.distributed as dist

    def rank(r):
        with_env = confine.candidate_env(os.environ, tmp_path)
        confine.confined_child_setup(workdir=tmp_path, env=with_env, rank=r, world_size=2, rendezvous=tmp_path,
                                     filesystem=False)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=r, world_size=2)
        t = torch.full((2,), float(r + 1))
        dist.all_reduce(t)
        dist.destroy_process_group()
        return {"sum": t.tolist(), "net": os.stat("/proc/self/ns/net").st_ino}

    (tmp_path / "home").mkdir()
    (tmp_path / "tmp").mkdir()
    answers = in_children(2, rank)
    assert len(answers) == 2 and all(a["sum"] == [3.0, 3.0] for a in answers)
    assert answers[0]["net"] == answers[1]["net"] != os.stat("/proc/self/ns/net").st_ino


# -- Landlock ---------------------------------------------------------------------------------------
@needs_landlock
def test_landlock_confines_reads_writes_proc_and_signals(tmp_path):
    secret_dir = tmp_path / "run"
    secret_dir.mkdir()
    (secret_dir / "db.sqlite").write_text("the run")
    outside = Path(tempfile.gettempdir()) / f"cw_outside_{os.getpid()}"

    (tmp_path / "workload.py").write_text("x = 1")

    def child(workdir):  # the run's folder sits inside a folder on the import path: it stays denied
        path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
        env = confine.candidate_env(os.environ, workdir, extra={"PYTHONPATH": path})
        checks = confine.confined_child_setup(workdir=workdir, env=env, network=False, deny_read=[secret_dir])
        out = {"checks": [c.name for c in checks]}

        def attempt(name, fn):
            try:
                fn()
                out[name] = "allowed"
            except OSError as exc:
                out[name] = type(exc).__name__

        attempt("read_run_db", lambda: (secret_dir / "db.sqlite").read_text())
        attempt("read_import_path", lambda: (tmp_path / "workload.py").read_text())
        attempt("write_run_db", lambda: (secret_dir / "db.sqlite").write_text("x"))
        attempt("write_outside", lambda: outside.write_text("x"))
        attempt("write_private", lambda: (workdir / "tmp" / "f").write_text("x"))
        attempt("read_parent_environ", lambda: Path(f"/proc/{os.getppid()}/environ").read_bytes())
        attempt("read_parent_cmdline", lambda: Path(f"/proc/{os.getppid()}/cmdline").read_bytes())
        attempt("list_parent_fds", lambda: os.listdir(f"/proc/{os.getppid()}/fd"))
        attempt("read_own_status", lambda: Path("/proc/self/status").read_text())
        attempt("read_system", lambda: Path("/proc/meminfo").read_text())
        attempt("name_own_thread", lambda: name_a_thread())
        attempt("use_dev_shm_and_null", lambda: (Path("/dev/shm") / f"cw_{os.getpid()}").write_text("x")
                or (Path("/dev/shm") / f"cw_{os.getpid()}").unlink() or Path("/dev/null").write_text("x")
                or os.close(os.open("/dev/urandom", os.O_RDONLY)))
        attempt("read_kernel_log", lambda: os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)))
        attempt("read_proc_kmsg", lambda: os.close(os.open("/proc/kmsg", os.O_RDONLY | os.O_NONBLOCK)))
        attempt("list_dev", lambda: os.listdir("/dev"))
        attempt("signal_parent", lambda: os.kill(os.getppid(), 0))
        attempt("import_torch", lambda: __import__("torch").ones(1))
        return out

    def name_a_thread():  # glibc writes /proc/self/task/<tid>/comm for a thread other than the caller
        done = threading.Event()
        thread = threading.Thread(target=done.wait)
        thread.start()
        code = ctypes.CDLL(None).pthread_setname_np(ctypes.c_ulong(thread.ident), b"cw-named")
        done.set()
        thread.join()
        if code:
            raise OSError(code, os.strerror(code))

    with confine.private_workdir() as workdir:
        out = in_child(child, workdir)
    assert not outside.exists()
    assert out["checks"] == ["output", "pdeathsig", "process group", "private dir", "landlock"]
    denied = "PermissionError"
    assert out["read_run_db"] == out["write_run_db"] == out["write_outside"] == denied
    assert out["read_parent_environ"] == out["read_parent_cmdline"] == out["list_parent_fds"] == denied
    assert out["write_private"] == out["read_own_status"] == out["read_system"] == out["import_torch"] == "allowed"
    assert out["read_import_path"] == out["name_own_thread"] == out["use_dev_shm_and_null"] == "allowed"
    assert out["list_dev"] == denied  # and no kernel log, which root could otherwise read:
    assert out["read_kernel_log"] in (denied, "FileNotFoundError") and out["read_proc_kmsg"] in (denied, "FileNotFoundError")
    assert out["signal_parent"] == (denied if confine.landlock_abi() >= 6 else "allowed")


def test_status_names_every_confinement_once():
    checks = confine.status()
    assert [c.name for c in checks] == ["env allowlist", "private dir", "landlock", "network namespace", "pid namespace",
                                        "private /dev/shm", "privileges", "output", "pdeathsig", "process group"]
    landlock = next(c for c in checks if c.name == "landlock")
    assert landlock.in_force == (confine.landlock_abi() >= 1)
    assert all("\n" not in c.line() for c in checks)


def test_doctor_prints_one_line_per_confinement():
    from typer.testing import CliRunner

    from commweave.cli import app

    result = CliRunner().invoke(app, ["doctor"], terminal_width=80)
    lines = [line.strip() for line in result.output.splitlines()]
    start = lines.index("candidate confinement")
    checks = confine.status()
    for check, line in zip(checks, lines[start + 1:start + 1 + len(checks)], strict=True):
        assert line.startswith(("yes", "NO")) and f"{check.name}: " in line, line


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes an unprivileged user: needs root to start as")
def test_an_unprivileged_user_gets_the_namespace_through_a_user_namespace_and_ranks_share_it():
    """The non-root path: rank 0 makes user + network namespaces, rank 1 joins both."""
    rendezvous = Path(tempfile.mkdtemp(prefix="cw_userns_"))
    rendezvous.chmod(0o777)

    def rank(r):
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            confine._prctl(4, 1)  # PR_SET_DUMPABLE, as for a user who never was root: /proc/self is ours
            how = confine.share_net_namespace(r, rendezvous, timeout_s=20)
            answer = [r, how, os.stat("/proc/self/ns/net").st_ino, [n for _, n in socket.if_nameindex()]]
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            answer = [r, f"{type(exc).__name__}: {exc}"]
        if r == 0:
            time.sleep(3)  # rank 0's namespace must live while rank 1 joins
        return answer

    answers = in_children(2, rank)
    confine.remove_tree(rendezvous)
    if answers[0][1].startswith(("PermissionError", "OSError")):
        pytest.skip(f"unprivileged user namespaces are not allowed here: {answers[0][1]}")
    assert [a[1] for a in answers] == ["in a user namespace", "joined rank 0's network namespace"], answers
    assert answers[0][2] == answers[1][2] != os.stat("/proc/self/ns/net").st_ino
    assert answers[0][3] == answers[1][3] == ["lo"]


@needs_netns
@needs_landlock
def test_the_cuda_probe_confines_a_fresh_interpreter_and_reports_what_cuda_said():
    """On a machine without GPUs the confined interpreters get as far as asking CUDA for devices
    (a confinement failure would be reported instead)."""
    checks = confine.probe_cuda(["everything", "Landlock on writes and signals only"])
    assert [c.name for c in checks] == ["CUDA under everything", "CUDA under Landlock on writes and signals only"]
    import torch

    if torch.cuda.device_count() == 0:
        assert [(c.in_force, c.detail) for c in checks] == [(False, "no CUDA GPU visible")] * 2


# -- pid namespace, privileges, /dev/shm, output, freezing -------------------------------------
PIDNS_MISSING = confine.pid_namespace_available()
needs_pidns = pytest.mark.skipif(PIDNS_MISSING is not None, reason=f"no pid namespace here: {PIDNS_MISSING}")


def in_pid_namespace(body: str) -> tuple[int, dict]:
    """Fork a program process into a pid namespace of its own (this test standing in for the
    zygote) that runs `body` (Python, with `report(dict)` to answer) and then sleeps: (the
    namespace's init's pid, the report)."""
    read, write = os.pipe()
    init = confine.fork_pid_namespace([read, write])
    if init == 0:
        try:
            os.close(read)

            def report(answer: dict) -> None:
                os.write(write, json.dumps(answer).encode() + b"\n")
                os.close(write)

            exec(body, {"report": report, "os": os, "confine": confine, "time": time, "signal": signal})
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:  # one line: the program's helpers hold the pipe open
        return init, json.loads(pipe.readline())


@needs_pidns
def test_a_program_in_its_pid_namespace_names_nothing_outside_and_dies_whole_with_its_init():
    outside = os.getpid()
    init, seen = in_pid_namespace(textwrap.dedent(f"""
        def attempt(fn):
            try:
                fn()
                return "allowed"
            except OSError as exc:
                return type(exc).__name__
        helpers = []
        for detach in (False, True):  # one plain helper, one double-forked into a session of its own
            r, w = os.pipe()
            if os.fork() == 0:
                if detach:
                    os.setsid()
                    if os.fork():
                        os._exit(0)
                os.write(w, str(confine.global_pid()).encode())
                time.sleep(60)
            helpers.append(int(os.read(r, 32)))
        report({{"pid": os.getpid(), "ppid": os.getppid(), "global": confine.global_pid(), "helpers": helpers,
                 "signal": attempt(lambda: os.kill({outside}, 0)),
                 "renice": attempt(lambda: os.setpriority(os.PRIO_PROCESS, {outside}, 19)),
                 "pin": attempt(lambda: os.sched_setaffinity({outside}, {{0}}))}})
    """))
    try:
        assert seen["pid"] == init + 1 and seen["ppid"] == 1  # a pid of its own, below the namespace's init
        assert seen["signal"] == seen["renice"] == seen["pin"] == "ProcessLookupError"
        assert confine.program_process(init) == seen["global"]
        assert all(alive(p) for p in [seen["global"], *seen["helpers"]])
        os.kill(init, signal.SIGKILL)  # killed from outside: everything in the namespace goes too
        os.waitpid(init, 0)
        assert all(wait_dead(p) for p in [seen["global"], *seen["helpers"]]), "a process outlived its namespace"
    finally:
        confine.kill_tree(init)


@needs_pidns
def test_the_init_exits_as_its_program_did_once_the_namespace_has_drained():
    init, seen = in_pid_namespace(textwrap.dedent("""
        r, w = os.pipe()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.write(w, str(confine.global_pid()).encode())
            time.sleep(60)
        report({"helper": int(os.read(r, 32))})
        os._exit(3)
    """))
    _, status = os.waitpid(init, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert not alive(seen["helper"])  # gone before the init could be reaped
    assert Path("/proc/self/ns/pid_for_children").stat().st_ino == Path("/proc/self/ns/pid").stat().st_ino


def test_shed_privileges_refuse_real_time_priority_renice_and_raised_limits():
    if (why := confine.privileges_available()) is not None:
        pytest.skip(f"privileges cannot be shed here: {why}")

    def child():
        import resource

        how = confine.drop_privileges()
        out = {"how": how, "capabilities": confine.capabilities()}
        for name, fn in (("sched_fifo", lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))),
                         ("renice_up", lambda: os.setpriority(os.PRIO_PROCESS, 0, -5)),
                         ("raise_limit", lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))),
                         ("rtprio", lambda: resource.setrlimit(resource.RLIMIT_RTPRIO, (1, 1)))):
            try:
                fn()
                out[name] = "allowed"
            except (OSError, ValueError) as exc:
                out[name] = type(exc).__name__
        return out

    out = in_child(child)
    assert out["capabilities"] == 0 and "no capabilities" in out["how"]
    assert out["sched_fifo"] == out["renice_up"] == "PermissionError"
    assert out["raise_limit"] in ("PermissionError", "ValueError") and out["rtprio"] in ("PermissionError", "ValueError")


def test_a_program_process_writes_nothing_to_the_judges_stdout_or_stderr(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("the judge's line\n")

    def child(workdir):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        confine.confined_child_setup(workdir=workdir, env=dict(os.environ), network=False, filesystem=False)
        print("rank 0: fitness 9.99 (forged)", flush=True)
        os.write(2, b"forged\n")
        with contextlib.suppress(OSError):
            os.ftruncate(1, 0)
        return True

    with confine.private_workdir() as workdir:
        assert in_child(child, workdir)
    assert log.read_text() == "the judge's line\n"


def test_the_zygote_writes_nothing_to_the_judges_stdout():
    from commweave.runtime.candidate import Zygote

    zygote = Zygote(["json"])
    try:
        assert os.readlink(f"/proc/{zygote.pid}/fd/1") == os.devnull
        assert os.readlink(f"/proc/{zygote.pid}/fd/2") != os.readlink("/proc/self/fd/2")
    finally:
        zygote.close()


@pytest.mark.skipif(confine.shm_namespace_available() is not None, reason="no private /dev/shm here")
def test_a_programs_ranks_share_a_private_dev_shm_that_leaves_nothing_behind(tmp_path):
    marker = f"cw_shm_{os.getpid()}"

    def rank(r):
        confine.share_namespaces(r, tmp_path, network=False, shm=True, timeout_s=20)
        Path(f"/dev/shm/{marker}_{r}").write_text(str(r))
        other = Path(f"/dev/shm/{marker}_{1 - r}")
        deadline = time.monotonic() + 20
        while not other.exists() and time.monotonic() < deadline:  # rank 0's namespace lives until both wrote
            time.sleep(0.01)
        return {"sees_peer": other.exists(), "size": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize}

    answers = in_children(2, rank)
    assert all(a["sees_peer"] for a in answers)
    assert all(a["size"] == confine.SHM_BYTES for a in answers)
    assert not list(Path("/dev/shm").glob(f"{marker}_*"))  # neither the machine's /dev/shm nor a later program's


def started_below(pid: int, count: int, timeout_s: float = 20.0) -> set[int]:
    """The processes below `pid` (a /proc scan) once there are `count` of them, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while len(found := confine.descendants(pid)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def test_freeze_stops_a_whole_tree_until_thaw():
    tree = subprocess.Popen([sys.executable, "-c", "import os, time\n"
                             "if os.fork() == 0:\n    while True: pass\n"
                             "while True: pass"], start_new_session=True)
    try:
        everyone = {tree.pid} | started_below(tree.pid, 1)
        assert len(everyone) == 2

        def states():
            return {Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] for p in everyone}

        stopped = confine.freeze(tree.pid)
        assert stopped == everyone
        time.sleep(0.1)
        assert states() == {"T"}
        confine.thaw(stopped)
        time.sleep(0.1)
        assert "T" not in states()
    finally:
        confine.kill_tree(tree.pid)


def test_the_walk_down_the_kernels_children_lists_finds_what_a_scan_of_proc_finds():
    """`descendants` (the walk freeze and kill_tree use) finds a grandchild and a child forked by a
    thread other than the main one (the kernel lists it under that thread), as a scan of /proc does."""
    tree = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys, threading, time\n"
                             "def spawn():\n"
                             "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                             "    time.sleep(60)\n"
                             "threading.Thread(target=spawn, daemon=True).start()\n"
                             "if os.fork() == 0:\n    subprocess.Popen(['sleep', '60']); time.sleep(60)\n"
                             "time.sleep(60)"], start_new_session=True)
    try:
        started_below(tree.pid, 3)
        found = confine.descendants(tree.pid, confine._parents())  # the scan
        assert len(found) == 3 and confine.descendants(tree.pid) == found
        if confine._children_lists():  # the main thread's own list lacks the thread's child
            main = {int(c) for c in Path(f"/proc/{tree.pid}/task/{tree.pid}/children").read_text().split()}
            assert len({c for c in found if confine.proc_parent(c) == tree.pid} - main) == 1
    finally:
        confine.kill_tree(tree.pid)


def test_freeze_stops_a_tree_that_keeps_forking():
    """A process forking all the time (a child each ~millisecond, each sleeping on): once freeze
    returns, every process below it is stopped, forks that raced the walk included (freeze waits
    for what it stopped to stand still, then walks again until nothing is new)."""
    tree = subprocess.Popen([sys.executable, "-c", "import os, time\n"
                             "for _ in range(400):\n"
                             "    if os.fork() == 0:\n        time.sleep(60); os._exit(0)\n"
                             "    time.sleep(0.001)\n"
                             "time.sleep(60)"], start_new_session=True)
    try:
        started_below(tree.pid, 20)
        stopped = confine.freeze(tree.pid)
        time.sleep(0.05)  # a child missed would have been forked by now, and would be running
        below = confine.descendants(tree.pid)
        assert len(below) >= 20 and below | {tree.pid} <= stopped
        assert all(confine.all_threads_stopped(p) for p in below | {tree.pid})
        confine.thaw(stopped)
    finally:
        confine.kill_tree(tree.pid)


def test_freeze_stops_the_known_program_process_before_it_walks_the_tree(monkeypatch):
    """The program process (below its namespace's init) stops before freeze's first walk of the
    tree: a scan of /proc took milliseconds on a loaded machine, and a thread of the program that
    deferred its work past its reply (red team: zeros_then_compute) finished it in them and passed."""
    init = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(60)"], start_new_session=True)
    program = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    seen = []
    scan = confine.descendants

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def scanned(pid: int, *args):  # stopped by now, or stopping: a SIGSTOP not yet sent never comes
        deadline = time.monotonic() + 2
        while state(program.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(state(program.pid))
        return scan(pid, *args)

    monkeypatch.setattr(confine, "descendants", scanned)
    try:
        stopped = confine.freeze(init.pid, [program.pid])
        assert seen and seen[0] == "T" and stopped == {init.pid, program.pid}
        confine.thaw(stopped)
    finally:
        for process in (init, program):
            process.kill()
            process.wait()


def test_the_judge_warns_once_for_a_piece_the_machine_refuses(monkeypatch):
    import warnings

    from commweave.runtime import candidate

    monkeypatch.setattr(candidate, "_CONFINEMENT", None)
    monkeypatch.setattr(confine, "pid_namespace_available", lambda: "needs a root judge")
    with pytest.warns(UserWarning, match=r"without: pid namespace \(needs a root judge\)"):
        rules = candidate.confinement("cpu", "commweave.evaluate.runner:serve")
    assert not rules.pid_namespace
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert candidate.confinement("cpu", "commweave.evaluate.runner:serve") is rules
