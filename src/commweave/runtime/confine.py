"""Confinement of candidate processes: code written by a search or a model runs here, and a
search optimises against every hole in its judge.

Trusted side (the judge, before it starts a program process): `candidate_env` (an allowlisted
environment, given at exec so nothing else is in /proc/self/environ), `private_workdir` (a fresh
0700 directory, removed after), `become_subreaper` and `kill_tree` (everything a candidate
spawned, double-forked or not, is found and killed). Untrusted side, first thing in the program
process: `confined_child_setup` (die with the parent, own session, no new privileges, the shared
network namespace of the candidate's ranks with loopback up, Landlock: writes only to the private
directory, /dev/shm, GPU device nodes and named paths, reads away from the run, the judge's home
and working directory, disks and the kernel log, no signal or /proc access to processes outside).
`status` says what is in force on this machine (`commweave doctor`). Linux only; ctypes
syscalls, standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import pwd
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path



class ConfineError(RuntimeError):
    """A confinement that was asked for could not be put in force."""


@dataclass(frozen=True)
class Check:
    """One confinement: whether it is in force, and how or why not."""

    name: str
    in_force: bool
    detail: str

    def line(self) -> str:
        return f"{'yes' if self.in_force else 'NO '}  {self.name}: {self.detail}"


# -- environment ------------------------------------------------------------------------------------
ENV_KEEP = frozenset({
    "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHASHSEED", "LANG", "TZ", "TERM", "USER", "LOGNAME",
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "COMMWEAVE_CACHE", "COMMWEAVE_CACHE_SHARED", "COMMWEAVE_NCCL_HOME",
    "COMMWEAVE_NVCC",
})
ENV_KEEP_PREFIXES = ("LC_", "CUDA_", "NCCL_", "GLOO_", "NVSHMEM_", "NVIDIA_", "TORCH_", "PYTORCH_", "TRITON_", "CUBLAS_", "CUDNN_")
# Dropped even where a name or prefix above matches: whatever looks like a credential.
ENV_DENY_WORDS = ("KEY", "TOKEN", "SECRET", "PASSW", "CREDENTIAL", "AUTH", "COOKIE", "SESSION")


# NVLink multicast can take a shared host's GPUs down: never let any process of ours use it.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def apply_safe_env(env: dict[str, str] | None = None) -> None:
    """Force the multicast-off variables into `env` (default: this process's environment)."""
    target = os.environ if env is None else env
    target.update(SAFE_ENV)


def env_allowed(name: str) -> bool:
    """Whether a variable of this name may reach a candidate."""
    upper = name.upper()
    if any(word in upper for word in ENV_DENY_WORDS):
        return False
    return name in ENV_KEEP or name.startswith(ENV_KEEP_PREFIXES)


def candidate_env(base: Mapping[str, str], workdir: Path | str | None = None,
                  extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a program process is exec'd with: `base` and `extra` through the allowlist,
    HOME/TMPDIR/caches inside `workdir` (its private directory, when given), multicast off, and
    the judge's compile cache named (with `workdir`: as COMMWEAVE_CACHE_SHARED, read-only, and a
    private COMMWEAVE_CACHE for what the program compiles itself)."""
    from commweave.runtime.toolchain import cache_dir

    env = {k: v for k, v in {**base, **(extra or {})}.items() if env_allowed(k)}
    judges_cache = env.get("COMMWEAVE_CACHE") or str(cache_dir())
    env["COMMWEAVE_CACHE"] = judges_cache
    if workdir is not None:
        home, tmp = Path(workdir) / "home", Path(workdir) / "tmp"
        # the judge's cache is read-only to it (a planted artefact would run in other programs);
        # what it compiles itself goes to a cache of its own
        env["COMMWEAVE_CACHE_SHARED"] = os.pathsep.join(filter(None, [judges_cache, env.get("COMMWEAVE_CACHE_SHARED")]))
        env["COMMWEAVE_CACHE"] = str(home / ".cache" / "commweave")
        env.update(HOME=str(home), TMPDIR=str(tmp), XDG_CACHE_HOME=str(home / ".cache"),
                   TRITON_CACHE_DIR=str(home / ".cache" / "triton"),
                   TORCHINDUCTOR_CACHE_DIR=str(home / ".cache" / "inductor"))
    env.update(SAFE_ENV)
    return env


RUN_PATHS_ENV = "COMMWEAVE_DENY_READ"


def run_paths(env: Mapping[str, str] = os.environ) -> list[str]:
    """The run's folders (its database, logs) that candidates must not read, wherever they are:
    $COMMWEAVE_DENY_READ (os.pathsep-separated), set for the pool by whoever knows the run; the
    judge passes them as `confined_child_setup(deny_read=...)`. The variable itself, like every
    COMMWEAVE_* path, never reaches a candidate's environment."""
    return [p for p in env.get(RUN_PATHS_ENV, "").split(os.pathsep) if p]


# -- private directory ------------------------------------------------------------------------------
def candidates_root() -> Path:
    """The folder holding every candidate's private directory (0700, one per machine user)."""
    root = Path(tempfile.gettempdir()) / f"cw_candidates_{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    if root.is_symlink() or root.stat().st_uid != os.getuid():
        raise ConfineError(f"{root} is not a directory of this user: refusing to put candidates there")
    os.chmod(root, 0o700)
    return root


@contextlib.contextmanager
def private_workdir(root: Path | None = None) -> Iterator[Path]:
    """A fresh 0700 directory with home/ and tmp/ inside, removed (with whatever the candidate
    left there) when the block ends."""
    path = Path(tempfile.mkdtemp(prefix="cand_", dir=root or candidates_root()))
    try:
        (path / "home").mkdir(mode=0o700)
        (path / "tmp").mkdir(mode=0o700)
        yield path
    finally:
        remove_tree(path)


def remove_tree(path: Path) -> None:
    """rmtree that also removes what a candidate made unwritable (chmod 0) inside. Only folders
    are unlocked, through descriptors opened without following links: a link the candidate left
    never makes us chmod its target."""
    def unlock(func, name, _exc):  # noqa: ANN001 - shutil's onerror signature
        for folder in (os.path.dirname(name), name):
            with contextlib.suppress(OSError):
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    os.fchmod(fd, 0o700)
                finally:
                    os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            func(name)

    shutil.rmtree(path, onerror=unlock)


# -- processes --------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36


def _prctl(option: int, arg: int = 0) -> int:
    result = _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")
    return result


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """PR_SET_PDEATHSIG: this process gets `sig` when the thread that forked it ends; exits at
    once if `parent` (default: the current parent) is already gone. Reset by fork: every process
    calls it for itself."""
    expected = proc_parent() if parent is None else parent
    _prctl(PR_SET_PDEATHSIG, sig)
    if proc_parent() != expected:
        os._exit(1)


def global_pid() -> int:
    """This process's pid as the machine's /proc names it (inside a pid namespace os.getpid() is
    the namespace's own number)."""
    return int(os.readlink("/proc/self"))


def proc_parent(pid: int | str = "self") -> int:
    """The parent's pid as the machine's /proc names it (os.getppid() is 0 for a parent outside
    the caller's pid namespace)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def new_session() -> None:
    """Lead a session and process group of its own (a no-op where it already does), so the judge
    can kill the whole group and the candidate's killpg(0) reaches only its own processes."""
    if os.getsid(0) != os.getpid():
        os.setsid()


def become_subreaper() -> None:
    """Orphans among our descendants (a double-forked daemon) are reparented to us, not to init,
    so `kill_tree(os.getpid(), keep=...)` still finds them."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int, parents: dict[int, int] | None = None) -> set[int]:
    """Every process below `pid`: down the kernel's children lists (`children`), whose cost grows
    with the tree, not with every process on the machine (a scan of /proc: ~2 ms with 70
    processes, more on a busy machine); from `parents`, a snapshot of `_parents()`, when given or
    where the kernel keeps no lists. A list can miss a fork racing the walk: `freeze` and
    `kill_tree` walk again until nothing is new, once what they found is stopped."""
    if parents is None and _children_lists():
        step = children
    else:
        by_parent: dict[int, set[int]] = {}
        for child, parent in (_parents() if parents is None else parents).items():
            by_parent.setdefault(parent, set()).add(child)

        def step(p: int) -> set[int]:
            return by_parent.get(p, set())
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in step(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found


@functools.cache
def _children_lists() -> bool:
    """Whether the kernel keeps each thread's children list (/proc/<pid>/task/<tid>/children)."""
    return Path(f"/proc/self/task/{os.getpid()}/children").exists()


def children(pid: int) -> set[int]:
    """`pid`'s children from the kernel's lists, every thread's (a thread's forks are listed under
    it), without reading every process's stat; a scan of /proc where the kernel keeps no lists."""
    if not _children_lists():
        return {child for child, parent in _parents().items() if parent == pid}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return set()
    found: set[int] = set()
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            found.update(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return found


def left_session(root: int, program: int | None = None) -> set[int]:
    """Live processes below `root` that left the program process `program` (default: `root`
    itself; else below it, as below its pid namespace's init): in a session other
    than the program's, or no longer below it (double-forked, reparented to its namespace's
    init). A program process leads its session; honest programs neither setsid() nor orphan."""
    program = root if program is None else program
    try:
        session = os.getsid(program)
    except ProcessLookupError:
        return set()
    if not _alive(program):  # ended: its namespace's init, about to exit, is no escapee
        return set()
    parents = _parents()
    chain, up = set(), parents.get(program)
    while up is not None and up != root and up not in chain:  # between them: not the program's
        chain.add(up)
        up = parents.get(up)
    below = descendants(program, parents)
    escaped = set()
    for other in descendants(root, parents) - chain - {program}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if _alive(other) and (other not in below or os.getsid(other) != session):
                escaped.add(other)
    return escaped


def kill_tree(pid: int, keep: Iterable[int] = (), include_root: bool = True) -> int:
    """SIGKILL `pid` (unless include_root=False), its process group when it leads one, and every
    descendant except `keep` and their own descendants; descendants are stopped first so none can
    fork away while we walk. Repeats until no victim is left. Returns how many were signalled."""
    kept = set(keep)
    for k in list(kept):
        kept |= descendants(k)
    killed: set[int] = set()
    if include_root:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
    for _ in range(50):
        victims = (descendants(pid) - kept) | ({pid} if include_root else set())
        victims = {v for v in victims if _alive(v)}
        if not victims:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for v in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(v, sig)
        killed |= victims
        _wait_dead(victims)
        _reap(victims)
    return len(killed)


def _wait_dead(pids: set[int], timeout_s: float = 10.0) -> None:
    """Wait until every one of `pids` has died (a zombie counts): a SIGKILLed process tearing down
    a large address space is still running for a while, and read as alive then it would look
    like something that escaped."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.002)


STOP_WAIT_S = 0.05  # freeze's wait for a stopped process's threads (one in uninterruptible sleep stops late)


def all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (or gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
                state = stat.read().rpartition(b")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


def freeze(pid: int, first: Iterable[int] = ()) -> frozenset[int]:
    """Stop `pid` and every process below it (SIGSTOP, again for whatever a process forked in the
    meantime, until none is new): the whole program stands still until `thaw`, e.g. from the
    moment its reply arrives until the judge has read its output. Give a program's
    `ProgramProcess.pid` (its pid namespace's init, where it has one) to reach all of it, and the
    processes known already (the program process) as `first`: they stop before the first walk of
    the tree, in which a thread of the program could still finish work it deferred past its
    reply. Returns the processes stopped: a stopped process forks nothing, so `thaw` needs no new
    walk (and the judge freezes once per batch)."""
    stopped: set[int] = set()
    todo = {pid, *first}
    for _ in range(50):
        for victim in todo:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGSTOP)
        stopped |= todo
        deadline = time.monotonic() + STOP_WAIT_S  # then a fork it was in has finished: its child is listed
        while not all(map(all_threads_stopped, todo)) and time.monotonic() < deadline:
            time.sleep(0.0001)
        todo = ({pid} | descendants(pid)) - stopped
        if not todo:
            break
    return frozenset(stopped)


def thaw(stopped: frozenset[int]) -> None:
    """Let the processes `freeze` stopped run again (SIGCONT)."""
    for victim in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGCONT)


def _alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _reap(pids: set[int]) -> None:
    """Collect our own children among `pids` (others are reaped by their parents)."""
    deadline = time.monotonic() + 2.0
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                break
            time.sleep(0.005)


# -- network namespace ------------------------------------------------------------------------------
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
NETNS_FILE = "netns.json"


def _unshare(flags: int) -> None:
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _setns(path: str, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, ctypes.c_int(flags)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def _ns_inode(kind: str, pid: int | str = "self") -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def new_net_namespace() -> str:
    """This thread (and what it forks afterwards) moves into a fresh network namespace with only
    loopback, up. As root directly; otherwise inside a new user namespace (where unprivileged user
    namespaces are allowed). Returns how. Call it while single-threaded, before any socket."""
    if os.geteuid() == 0:
        _unshare(CLONE_NEWNET)
        how = "as root"
    else:
        uid, gid = os.geteuid(), os.getegid()
        _unshare(CLONE_NEWUSER | CLONE_NEWNET)
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
        how = "in a user namespace"
    _loopback_up()
    return how


def share_net_namespace(rank: int, rendezvous: Path, timeout_s: float = 60.0) -> str:
    """All ranks of one program in one network namespace (`share_namespaces` with the network only)."""
    return share_namespaces(rank, rendezvous, network=True, shm=False, timeout_s=timeout_s)[0]


def share_namespaces(rank: int, rendezvous: Path, network: bool = True, shm: bool = False,
                     timeout_s: float = 60.0) -> list[str]:
    """All ranks of one program in one network namespace (`new_net_namespace`) and, with `shm`,
    one mount namespace with a private /dev/shm (`new_shm_namespace`; NCCL's ranks meet there):
    rank 0 makes them and publishes its pid (as /proc names it) and their inodes in `rendezvous`;
    the others wait for that and join. Returns how, one line per namespace. Must run before any
    other confinement (joining needs privileges over rank 0, which the later pieces remove)."""
    target = rendezvous / NETNS_FILE
    kinds = [k for k, wanted in (("net", network), ("mnt", shm)) if wanted]
    if rank == 0:
        how = [new_net_namespace()] if network else []
        how += [new_shm_namespace()] if shm else []
        staged = rendezvous / f".{NETNS_FILE}.{global_pid()}"
        info = {"pid": global_pid(), "user": _ns_inode("user"), **{k: _ns_inode(k) for k in kinds}}
        staged.write_text(json.dumps(info))
        staged.replace(target)
        return how
    deadline = time.monotonic() + timeout_s
    while not target.exists():
        if time.monotonic() > deadline:
            raise ConfineError(f"rank 0 published no namespaces in {rendezvous} within {timeout_s:.0f} s")
        time.sleep(0.01)
    info = json.loads(target.read_text())
    pid = info["pid"]
    if any(k not in info for k in kinds):
        raise ConfineError(f"rank 0 made no {' and '.join(k for k in kinds if k not in info)} namespace")
    if any(_ns_inode(k, pid) != info[k] for k in kinds):
        raise ConfineError(f"rank 0's namespaces (pid {pid}) are gone")
    if _ns_inode("user", pid) != _ns_inode("user"):
        _setns(f"/proc/{pid}/ns/user", CLONE_NEWUSER)
    for kind in kinds:
        _setns(f"/proc/{pid}/ns/{kind}", {"net": CLONE_NEWNET, "mnt": CLONE_NEWNS}[kind])
        if _ns_inode(kind) != info[kind]:
            raise ConfineError(f"joined the wrong {kind} namespace (rank 0 was pid {pid})")
    return [f"joined rank 0's {'network' if k == 'net' else 'mount'} namespace" for k in kinds]


# -- private /dev/shm -------------------------------------------------------------------------------
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_SLAVE = 0x2, 0x4, 0x4000, 0x80000
SHM_BYTES = 1 << 30  # per program, all its ranks together: NCCL's shared-memory transport fits many times


def new_shm_namespace(size_bytes: int = SHM_BYTES) -> str:
    """This process moves into a mount namespace of its own (nothing it mounts reaches the
    machine's) with a fresh tmpfs of `size_bytes` on /dev/shm: nothing shared with other programs,
    nothing left when the namespace's last process ends. Needs root; call it single-threaded."""
    _unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_SLAVE, None)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_bytes},mode=1777")
    return f"private /dev/shm ({size_bytes >> 20} MiB tmpfs)"


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def c(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    if _libc.mount(c(source), c(target), c(fstype), ctypes.c_ulong(flags), c(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def net_namespace_available() -> str | None:
    """None if this machine lets us make a network namespace (tried in a throwaway child), else why not."""
    return refused(new_net_namespace)


def shm_namespace_available() -> str | None:
    """None if a program can get a private /dev/shm here (tried in a throwaway child), else why not."""
    if os.geteuid() != 0:
        return "needs a root judge"
    return refused(new_shm_namespace)


def refused(attempt: Callable[[], object]) -> str | None:
    """Run `attempt` in a throwaway forked child: None if it worked, else the error it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: try, report, leave without running any of the parent's cleanup
        os.close(read)
        try:
            attempt()
            message = b""
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            message = f"{type(exc).__name__}: {exc}".encode()[:500]
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message or None


# -- pid namespace ----------------------------------------------------------------------------------
CLONE_NEWPID = 0x20000000


def fork_pid_namespace(close_in_init: Iterable[int] = ()) -> int:
    """Fork (like os.fork: 0 in the child) a program process into a pid namespace of its own: the
    caller gets the namespace's init, a minimal pid 1 that forks the program process and stays
    its parent; the program process can name no process outside the namespace (signals, renice,
    prlimit, affinity, ptrace), and all it starts, reparented or detached, dies when it ends.
    The init exits when the program process does, as it did (a signal as 128 + its number),
    once the namespace has emptied: its exit is the program's, drained. The program process's
    pid inside is the init's outside + 1, unique among a program's ranks (torch names IPC sockets
    by pid). The init closes `close_in_init` (the program's end of the judge's socket, the
    caller's own). Needs root; the caller's next children are its own again after the call."""
    parent = global_pid()
    _unshare(CLONE_NEWPID)
    try:
        init = os.fork()
    except OSError:
        _setns("/proc/self/ns/pid", CLONE_NEWPID)
        raise
    if init != 0:  # the caller: its next children in its own namespace again
        _setns("/proc/self/ns/pid", CLONE_NEWPID)
        return init
    try:
        die_with_parent(parent=parent)
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(global_pid()))
        program = os.fork()
    except BaseException:  # noqa: BLE001 - the judge sees the program's socket close: it did not start
        os._exit(2)
    if program == 0:
        die_with_parent()
        return 0
    for fd in close_in_init:
        os.close(fd)
    _init(program)


def _init(program: int) -> None:
    """pid 1 of a program's namespace: reap whatever is reparented here; when the program process
    ends, exit as it did (the kernel then kills the rest, and our exit waits until it has)."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(2)
        except InterruptedError:
            continue
        if pid == program:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def program_process(init: int) -> int | None:
    """The program process of a pid namespace's init (its oldest child), or None."""
    return _oldest_child(init)


def _oldest_child(pid: int) -> int | None:
    started = {}
    for child in children(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            started[child] = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return min(started, key=lambda c: (started[c], c)) if started else None


def pid_namespace_available() -> str | None:
    """None if program processes can get a pid namespace here (tried in a throwaway child), else why not."""
    if os.geteuid() != 0:
        return "needs a root judge"

    def attempt() -> None:
        read, write = os.pipe()
        init = fork_pid_namespace([read, write])
        if init == 0:  # the program process, inside
            os.write(write, str(os.getpid()).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            inside = pipe.read()
        _, status = os.waitpid(init, 0)
        if inside != str(init + 1) or os.waitstatus_to_exitcode(status) != 0:
            raise ConfineError(f"the program process was pid {inside or 'none'} inside (exit {status})")

    return refused(attempt)


# -- privileges -------------------------------------------------------------------------------------
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def drop_privileges() -> str:
    """No capability and no real-time or raised priority, for good: RLIMIT_RTPRIO 0 and RLIMIT_NICE
    at its default (0), hard limits too; the bounding, ambient, effective, permitted and
    inheritable capability sets emptied; no new privileges (exec gains none back). SCHED_FIFO,
    renice below 0, raising a limit, mounting, loading modules all fail. The uid stays the
    judge's: its Python and the program's code may be readable by it alone (as under a 0700
    /root), so files are guarded by Landlock, other processes by the pid namespace. Capabilities
    are a thread's: call it single-threaded (a fresh fork), so every later thread inherits none.
    Returns how."""
    import resource

    resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
    for cap in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
        with contextlib.suppress(OSError):  # without CAP_SETPCAP there is nothing to drop
            _prctl(PR_CAPBSET_DROP, cap)
    _libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                ctypes.c_ulong(0))  # fails only before Linux 4.3, which has no ambient set to clear
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    if _libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    return f"uid {os.geteuid()}, no capabilities, RLIMIT_RTPRIO 0, RLIMIT_NICE 0"


def capabilities() -> int:
    """This process's effective capability set (a bit per capability)."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("CapEff:"))
    return int(line.split()[1], 16)


def privileges_available() -> str | None:
    """None if program processes can shed every privilege here (tried in a throwaway child), else why not."""

    def attempt() -> None:
        drop_privileges()
        if capabilities():
            raise ConfineError(f"capabilities left: {capabilities():#x}")

    return refused(attempt)


# -- Landlock ---------------------------------------------------------------------------------------
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_WRITE_ABI1 = sum(1 << b for b in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
SCOPE_SIGNAL = 1 << 1
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is missing or disabled."""
    if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"):
        return 0
    version = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(version, 0)


def _fs_write_rights(abi: int) -> int:
    return FS_WRITE_FILE | FS_WRITE_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)


def _real(path: Path | str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _readable_roots(deny: list[str], start: str = "/") -> list[str]:
    """Paths whose subtrees together cover `start`'s tree except `deny` (and except the listing of
    the denied paths' ancestors, which a Landlock rule cannot grant without granting everything
    below)."""
    roots: list[str] = []

    def walk(folder: str) -> None:
        try:
            entries = sorted(os.listdir(folder))
        except OSError:
            return
        for name in entries:
            path = os.path.join(folder, name)
            if path in deny:
                continue
            if any(d.startswith(path.rstrip("/") + "/") for d in deny) and os.path.isdir(path) and not os.path.islink(path):
                walk(path)
            else:
                roots.append(path)

    walk(start)
    return roots


def _beneath(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _granting_none_of(paths: Iterable[str], protect: list[str]) -> list[str]:
    """`paths`, where one holds a protected path, replaced by its parts that do not; a path
    beneath a protected one is dropped."""
    granted: list[str] = []
    for path in paths:
        if any(_beneath(path, p) for p in protect):
            continue
        inside = [p for p in protect if _beneath(p, path)]
        granted += _readable_roots(inside, start=path) if inside else [path]
    return granted


# Device nodes a program process may open (read and write), by name prefix: shared memory, the
# harmless character devices, NVIDIA's GPU/UVM/NVSwitch/capability nodes, RDMA and GDRCopy (NCCL's
# network plugins). Never a disk, /dev/mem, the kernel log or a terminal: as root those would read the
# very files the other rules deny.
DEVICES = ("shm", "null", "zero", "full", "random", "urandom", "nvidia", "infiniband", "gdrdrv", "hugepages")


def _device_paths() -> list[str]:
    return [os.path.join("/dev", e) for e in sorted(os.listdir("/dev")) if e.startswith(DEVICES)]


# System-wide /proc entries that show more than this process's business: physical memory and
# page maps, the kernel log, the kernel's keyrings.
PROC_WITHHELD = frozenset({"kcore", "kmsg", "kpagecount", "kpageflags", "kpagecgroup", "keys", "key-users",
                           "sysrq-trigger", "self", "thread-self"})


def _own_proc_entries() -> list[str]:
    """/proc as a program process may read it: its own /proc/<pid> and the system-wide entries
    (cpuinfo, meminfo, sys/, driver/, ...) but PROC_WITHHELD, never another process's directory
    (environ, cmdline, fd/, maps of the judge or of anyone else); /proc itself cannot be listed."""
    entries = [os.path.join("/proc", e) for e in os.listdir("/proc") if not e.isdigit() and e not in PROC_WITHHELD]
    return [*entries, f"/proc/{global_pid()}"]


def restrict_filesystem(writable: Iterable[Path | str] = (), deny_read: Iterable[Path | str] = (),
                        readable: Iterable[Path | str] = (), protect: Iterable[Path | str] = (),
                        private_proc: bool = True) -> int:
    """Landlock this process and all it starts later: writes only beneath `writable` and the
    DEVICES of /dev (/dev/shm, GPU nodes); reads everywhere except beneath `deny_read`, `protect`,
    other processes' /proc entries and the rest of /dev, with `readable` (and `writable`)
    re-allowed inside denied trees but never over a `protect`ed path (a readable folder holding
    one is granted around it); with ABI >= 6 no
    signals to processes outside this domain. Processes this one starts later cannot read their
    own /proc/<pid> either (private_proc=False leaves /proc readable). Returns the ABI used;
    raises ConfineError where Landlock is unavailable."""
    abi = landlock_abi()
    if abi < 1:
        raise ConfineError("Landlock is not available on this kernel")
    write = _fs_write_rights(abi)
    attr = _RulesetAttr(FS_READ | write, 0, SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 8  # older kernels know only handled_access_fs
    ruleset = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise ConfineError(f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        protected = sorted({_real(p) for p in (*protect, *(["/proc"] if private_proc else []))})
        deny = sorted({_real(p) for p in (*deny_read, "/dev")} | set(protected))
        writable_paths = [_real(p) for p in (*writable, *_device_paths())]
        rules = [(p, FS_READ) for p in _readable_roots(deny)]
        rules += [(p, FS_READ) for p in (_own_proc_entries() if private_proc else [])]
        # its own threads' files (task/<tid>/comm: naming another thread, as CUDA's driver does)
        rules += [(f"/proc/{global_pid()}", FS_READ | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))]
        rules += [(p, FS_READ) for p in _granting_none_of([_real(p) for p in readable], protected)]
        rules += [(p, FS_READ | write) for p in writable_paths]
        for path, access in rules:
            _add_path_rule(ruleset, path, access)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise ConfineError(f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return abi


def _add_path_rule(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # gone, or a dangling link: nothing to grant
    try:
        if not os.path.isdir(path):
            access &= FS_EXECUTE | FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE  # file rules take file rights only
        rule = _PathBeneathAttr(access, fd)
        if _libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                         ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            raise ConfineError(f"landlock_add_rule {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def default_deny_read() -> list[str]:
    """What a candidate never reads, whatever the caller adds: the temp folders (other candidates,
    the pool's rendezvous, run files placed there), the user's home (keys, tokens, configs) and
    the judge's working directory (where runs and their databases are written). Call it before
    the environment and working directory are swapped for the candidate's."""
    paths = {tempfile.gettempdir(), "/tmp", "/var/tmp", pwd.getpwuid(os.getuid()).pw_dir, os.getcwd(), "/root"}
    return sorted(p for p in paths if _real(p) != "/")


def default_readable() -> list[str]:
    """Re-allowed inside denied trees: the Python installation and import path (the package,
    site-packages, the workload's folder), and the compile cache and toolchain (read-only)."""
    paths = [p for p in {sys.prefix, sys.exec_prefix, sys.base_prefix, *sys.path} if p and os.path.exists(p)]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.exists(p)]
    paths += [p for p in os.environ.get("COMMWEAVE_CACHE_SHARED", "").split(os.pathsep) if p and os.path.exists(p)]
    for name in ("COMMWEAVE_NCCL_HOME", "CUDA_HOME"):
        if os.environ.get(name):
            paths.append(os.environ[name])
    return paths


def close_fds(keep: Iterable[int] = ()) -> None:
    """Close every descriptor >= 3 but `keep` (what the judge passed on purpose)."""
    kept = sorted({fd for fd in keep if fd >= 3})
    low = 3
    for fd in [*kept, 1 << 20]:
        if low < fd:
            os.closerange(low, fd)
        low = fd + 1


# -- the program process ---------------------------------------------------------------------------
def confined_child_setup(*, workdir: Path | str, env: Mapping[str, str], rank: int = 0, world_size: int = 1,
                         rendezvous: Path | str | None = None, writable: Iterable[Path | str] = (),
                         deny_read: Iterable[Path | str] = (), keep_fds: Iterable[int] | None = None,
                         network: bool = True, filesystem: bool = True, shm: bool = False, privileges: bool = False,
                         memory_limit_bytes: int | None = None, parent: int | None = None,
                         private_reads: bool = True) -> list[Check]:
    """First call in a program process, before candidate code: stdin/stdout/stderr on /dev/null
    (never the judge's log), dies with its parent, leads its own session, joins its program's
    network namespace and (`shm`) mount namespace with a private /dev/shm (through `rendezvous`,
    the judge-made folder its ranks share; also writable), runs in `workdir` with `env`, sheds
    every privilege (`privileges`, see `drop_privileges`), Landlock (see `restrict_filesystem`;
    `deny_read`, e.g. the run's folder, stays unreadable even where an import path holds it),
    optional data-size limit, then closes fds but `keep_fds` (None: leave them). Returns what is
    in force; raises ConfineError where an asked-for piece cannot be had — pass False for what
    `status()` says the machine lacks (private_reads=False: Landlock on writes and signals only,
    for `probe_cuda`)."""
    checks = []
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    checks.append(Check("output", True, "stdin, stdout and stderr on /dev/null"))
    denied = default_deny_read()  # before the swap below
    protected = [str(Path(workdir).parent), *map(str, deny_read)]  # other candidates, the run: never re-allowed
    die_with_parent(parent=parent)
    checks.append(Check("pdeathsig", True, "SIGKILL when the parent dies"))
    new_session()
    checks.append(Check("process group", True, f"own session {os.getsid(0)}"))
    os.environ.clear()
    os.environ.update(env)
    if network or shm:
        if world_size > 1 and rendezvous is None:
            raise ConfineError("namespaces shared by several ranks need their rendezvous folder")
        try:
            if world_size > 1:
                how = share_namespaces(rank, Path(rendezvous), network=network, shm=shm)
            else:
                how = ([new_net_namespace()] if network else []) + ([new_shm_namespace()] if shm else [])
        except OSError as exc:
            raise ConfineError(f"namespaces: {exc}") from exc
        if network:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the only interface there: no guessing from the hostname
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            checks.append(Check("network namespace", True, f"{how[0]}, loopback only"))
        if shm:
            checks.append(Check("private /dev/shm", True, how[-1]))
    os.chdir(workdir)  # after joining a mount namespace, which moves us to its root
    tempfile.tempdir = None  # re-read TMPDIR
    checks.append(Check("private dir", True, str(workdir)))
    if memory_limit_bytes is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (memory_limit_bytes, memory_limit_bytes))
        checks.append(Check("memory limit", True, f"RLIMIT_DATA {memory_limit_bytes >> 20} MiB"))
    if privileges:
        try:
            checks.append(Check("privileges", True, drop_privileges()))
        except OSError as exc:
            raise ConfineError(f"privileges: {exc}") from exc
    if filesystem:
        extra_writable = [workdir, *writable, *([rendezvous] if rendezvous is not None else [])]
        if private_reads:
            abi = restrict_filesystem(writable=extra_writable, deny_read=denied, readable=default_readable(),
                                      protect=protected)
        else:
            abi = restrict_filesystem(writable=extra_writable, private_proc=False)
        checks.append(Check("landlock", True, f"ABI {abi}: writes to the private dir, /dev/shm and GPU nodes only; "
                                              f"run, home, temp, disks and other processes unreadable"
                                              f"{'; no signals out' if abi >= 6 else ''}"))
    else:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if keep_fds is not None:
        close_fds(keep_fds)
    return checks


# -- does CUDA start under it? ---------------------------------------------------------------------
CUDA_PROBES = {  # name -> confined_child_setup flags; the first is what program processes on GPUs get
    "everything": dict(network=True, filesystem=True, privileges=True),
    "privileges kept": dict(network=True, filesystem=True),
    "network namespace only": dict(network=True, filesystem=False),
    "Landlock only": dict(network=False, filesystem=True),
    "Landlock on writes and signals only": dict(network=False, filesystem=True, private_reads=False),
}
_PROBE_CHILD = """
import json, os, sys
from commweave.runtime import confine
flags = json.loads(sys.argv[3])
report = os.fdopen(os.dup(1), "w")  # stdout itself goes to /dev/null under the confinement
try:
    confine.confined_child_setup(workdir=sys.argv[1], env=json.loads(sys.argv[2]), **flags)
    import torch
    count = torch.cuda.device_count()
    if count == 0:
        print(json.dumps({"ok": False, "detail": "no CUDA GPU visible"}), file=report)
    else:
        value = torch.ones(4, device="cuda").sum().item()
        print(json.dumps({"ok": value == 4.0, "detail": f"{count} GPU(s), a kernel ran"}), file=report)
except BaseException as exc:
    print(json.dumps({"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}), file=report)
"""


def probe_cuda(names: Iterable[str] | None = None, timeout_s: float = 180.0) -> list[Check]:
    """Start a fresh interpreter under each confinement of `names` (default: all of CUDA_PROBES)
    and see whether CUDA initialises and runs a kernel there: which piece, if any, a GPU driver
    cannot live with. Fresh interpreters, not forks: a fork cannot use CUDA its parent started."""
    import subprocess

    checks = []
    for name in names or CUDA_PROBES:
        with private_workdir() as workdir:
            env = candidate_env(os.environ, workdir)
            if env.get("PYTHONPATH"):  # it starts in `workdir`: relative entries would point elsewhere
                env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
            argv = [sys.executable, "-c", _PROBE_CHILD, str(workdir), json.dumps(env), json.dumps(CUDA_PROBES[name])]
            try:
                done = subprocess.run(argv, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout_s,
                                      start_new_session=True)
                lines = done.stdout.strip().splitlines()
                answer = json.loads(lines[-1]) if lines else {"ok": False, "detail": done.stderr.strip()[-300:]}
            except (subprocess.TimeoutExpired, ValueError) as exc:
                answer = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}
        checks.append(Check(f"CUDA under {name}", answer["ok"], answer["detail"]))
    return checks


# -- what this machine offers (commweave doctor) ---------------------------------------------------
def status() -> list[Check]:
    """One Check per confinement, as a program process on this machine would get it."""
    checks = []
    kept = sorted(k for k in os.environ if env_allowed(k))
    checks.append(Check("env allowlist", True, f"{len(kept)} of {len(os.environ)} variables of this shell would "
                                               f"reach a candidate: {', '.join(kept) or 'none'}"))
    try:
        with private_workdir() as path:
            checks.append(Check("private dir", True, f"fresh 0700 dir per program under {path.parent}, removed after"))
    except (OSError, ConfineError) as exc:
        checks.append(Check("private dir", False, f"cannot create one: {exc}"))
    abi = landlock_abi()
    checks.append(Check("landlock", abi >= 1, f"ABI {abi}: writes only to its private dir, /dev/shm and GPU nodes; "
                        f"no reads of temp, home, the judge's cwd, the run, disks or other processes' /proc"
                        f"{'; no signals out' if abi >= 6 else ''}" if abi else
                        "unavailable on this kernel: a candidate can read every file this user can "
                        "(the DB path is still never passed, fds are still closed)"))
    why_not = net_namespace_available()
    how = "as root" if os.geteuid() == 0 else "with user namespaces"
    checks.append(Check("network namespace", why_not is None,
                        f"one per program ({how}), loopback only" if why_not is None
                        else f"unavailable ({why_not}): a candidate can open sockets to anything this machine reaches"))
    why_not = pid_namespace_available()
    checks.append(Check("pid namespace", why_not is None,
                        ("one per program process: it names no process outside (no signal, renice, prlimit, "
                         "pinning, ptrace), and all it started dies with it, drained before the judge looks"
                         if why_not is None else f"unavailable ({why_not}): a candidate can name every process "
                         f"of this user (renice, pin, prlimit the judge's zygote); detached processes are found "
                         f"by walking the tree") + "; CPU pools only (CUDA IPC crosses no pid namespace)"))
    why_not = shm_namespace_available()
    checks.append(Check("private /dev/shm", why_not is None,
                        (f"a {SHM_BYTES >> 20} MiB tmpfs per program (its ranks share it), gone when it ends"
                         if why_not is None else f"unavailable ({why_not}): /dev/shm is the machine's, shared "
                         f"between programs and kept after them") + "; CPU pools only (torch's CUDA IPC opens the "
                        "judge's reference counts there)"))
    why_not = privileges_available()
    checks.append(Check("privileges", why_not is None,
                        "no capabilities, RLIMIT_RTPRIO 0 (no SCHED_FIFO), RLIMIT_NICE 0, no new privileges"
                        if why_not is None else f"cannot be shed ({why_not}): a root judge's candidates keep "
                        f"every capability"))
    checks.append(Check("output", True, "stdout and stderr of a program on /dev/null, never the judge's"))
    linux = sys.platform.startswith("linux")
    checks.append(Check("pdeathsig", linux, "program processes get SIGKILL when their parent dies" if linux
                        else "no prctl on this OS: a program process outlives a killed judge"))
    checks.append(Check("process group", linux, "own session per program process, killed as a tree; the judge "
                                                "is a child subreaper, so double-forked daemons are found too"
                        if linux else "own session per program process; orphans escape to init"))
    return checks
