"""Reference workers: W trusted processes that run a problem's input maker and reference together.

A problem's reference is a collective program, so one rank's expected result needs every rank's
reference running at once. The judges cannot run it among themselves (a judge computes a
reference whenever its own checks ask, not in step with its peers), so each judge owns W worker
processes of its own, joined in a process group of their own (gloo on CPU; on GPUs NCCL, worker r
on GPU r): every request goes to all W, and only the asking rank's answer comes back. Only the
problem's code runs here (the user's trusted reference and input maker), never a solution.
Requests: ('load', problem) makes it the one they run (workers outlive a problem, so a suite
starts them once per judge); ('inputs', seeds) -> per seed, this rank's arguments as
`values.flatten_args` splits them and the groups the input maker made (a judge's batch in one
round trip, its tensors packed in one buffer); ('reference', seed) -> the reference's result as
one vector (on GPUs both stay in the worker's memory and reach the judge by CUDA IPC); ('trace', seed) -> the
ops the reference dispatched (name, its tensor arguments' shapes, dtypes).
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from commweave.problems.format import Problem
from commweave.problems.values import flatten_args, flatten_result
from commweave.runtime.candidate import own_child
from commweave.runtime.pool import release_cached_memory
from commweave.runtime.shared_buffers import Reduced, Slot, layout, views

START_S = 180.0  # W interpreters importing torch and joining a group, on a loaded machine
REQUEST_S = 300.0  # one input draw or reference run
ERROR_GRACE_S = 10.0  # after one worker's error, how long its peers get to answer


class ReferenceError(RuntimeError):
    """The problem's own code (input maker or reference) failed, or its workers did: one line why."""


def load_module(path: str, name: str) -> types.ModuleType:
    """Execute a trusted file as a module registered in sys.modules (dataclasses need that)."""
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(Path(path).read_text(), path, "exec"), module.__dict__)
    return module


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)  # from our own workers only


# -- the worker side ------------------------------------------------------------------------------
class _Recorder:
    """Wraps dist.new_group while the input maker runs: one group per rank list (made once, kept
    across draws), and the order the lists were first asked for (what a program process repeats)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.original = dist.new_group
        self.made: dict[tuple[int, ...] | None, Any] = {}
        self.order: list[tuple[int, ...] | None] = []
        dist.new_group = self.new_group

    def new_group(self, ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        key = tuple(int(r) for r in ranks) if ranks is not None else None
        if key not in self.made:
            self.made[key] = self.original(ranks, *args, **kwargs)
            self.order.append(key)
        return self.made[key]

    def index(self, group: Any) -> int | None:
        if group is self.dist.group.WORLD or group is self.dist.distributed_c10d._get_default_group():
            return None
        for key, made in self.made.items():
            if made is group:
                return self.order.index(key)
        raise ReferenceError("the input maker passes a process group it did not create with dist.new_group")


class _Tracer(TorchDispatchMode):
    """Records every op a reference dispatches: name, tensor argument shapes and dtypes (c10d
    collectives are dispatched ops too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]], list[str]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors: list[torch.Tensor] = []

        def collect(value: Any) -> None:  # tensors, also inside the lists of lists collectives take
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    collect(v)

        collect((*args, *kwargs.values()))
        dtypes = [str(t.dtype) for t in tensors] + ([str(kwargs["dtype"])] if "dtype" in kwargs else [])
        self.ops.append((str(func), [tuple(t.shape) for t in tensors], dtypes))
        return func(*args, **kwargs)


def _maker(problem: Problem) -> Any:
    """(rank, world_size, seed, device) -> the arguments: PKB's create_input_tensor with the seed as
    its trial, or our format's make_inputs."""
    module = load_module(problem.inputs, "commweave_problem_inputs")
    dtype = problem.torch_dtype()

    def make(rank: int, w: int, seed: int, dev: torch.device) -> tuple:
        if problem.kind == "pkb":
            args = module.create_input_tensor(rank, w, problem.problem_id, problem.base_shape, dtype, trial=seed,
                                              device=dev)
        else:
            args = module.make_inputs(rank, w, seed, dev)
        if not isinstance(args, tuple):
            raise TypeError(f"the input maker returned a {type(args).__name__}, not a tuple of arguments")
        return args

    return make


def _drawn(args: Any, recorder: _Recorder) -> tuple[dict[str, torch.Tensor], Any]:
    """One draw: its tensors, and its skeleton with the groups made so far."""
    tensors, skeleton = flatten_args(args, recorder.index)
    return tensors, (skeleton, list(recorder.order))


Draw = tuple[list[str], dict[str, torch.Tensor], Any]  # a draw as it travels: tensor names, those by value, the rest


def _packed(draws: list[tuple[dict[str, torch.Tensor], Any]], device: torch.device,
            on_device: bool) -> tuple[Any, list[Slot], list[Draw]]:
    """A request's draws as they travel: every dense tensor's bytes in one buffer on `device`, laid
    out as the judge's shared buffers are (`shared_buffers.layout`, slot '<draw>.<name>'; on GPUs
    one CUDA IPC mapping a request, where one a tensor cost the judge ~2 ms a call to open and
    close); a tensor with no dense bytes (sparse, nested, empty) by value."""
    dense = {f"{i}.{name}": tensor for i, (tensors, _) in enumerate(draws) for name, tensor in tensors.items()
             if tensor.layout == torch.strided and not tensor.is_nested and tensor.numel() > 0}
    slots, size = layout({key: (tuple(t.shape), t.dtype) for key, t in dense.items()})
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for key, view in views(buffer, slots).items():
        view.copy_(dense[key])
    travel = [(list(tensors), {n: t.detach().cpu() for n, t in tensors.items() if f"{i}.{n}" not in dense}, rest)
              for i, (tensors, rest) in enumerate(draws)]
    return _traveling(buffer, on_device), slots, travel


def unpacked(buffer: torch.Tensor, slots: list[Slot], draws: list[Draw]) -> list[tuple[dict[str, torch.Tensor], Any]]:
    """What `_packed` sent, as the draws were: each one's tensors (views of the buffer, or by value)
    in their order, and the rest (skeleton, groups)."""
    packed = views(buffer, slots)
    return [({n: loose[n] if n in loose else packed[f"{i}.{n}"] for n in names}, rest)
            for i, (names, loose, rest) in enumerate(draws)]


def _traveling(tensor: torch.Tensor, on_device: bool) -> torch.Tensor | Reduced:
    """A tensor (a request's buffer of draws, a reference's result) as it goes to the judge: by CUDA
    IPC where `on_device` and it is a dense GPU tensor with memory behind it (IPC maps an
    allocation), else its values on the host (sparse, nested, empty, CPU tensors; every tensor on
    CPU workers). By IPC the judge maps this worker's memory, waits on its event and copies device
    to device, instead of the bytes going to the host, through torch.save and a socket and back
    (~6 ms a 4 MiB draw on an H100). The worker keeps the memory until the judge lets go (torch's
    IPC reference count; `torch.cuda.ipc_collect` frees it then)."""
    if (on_device and tensor.is_cuda and tensor.layout == torch.strided and not tensor.is_nested
            and tensor.untyped_storage().nbytes() > 0):
        return Reduced(*reduce_tensor(tensor.detach()))  # whether it asks for gradients travels in the skeleton
    return tensor.cpu()


def worker_main(fd: int, rank: int, world_size: int, device_kind: str, store: str, parent: int) -> None:
    """One reference worker: join the group, then answer requests until told to exit."""
    from commweave.runtime.confine import die_with_parent

    die_with_parent(parent=parent)
    conn = Connection(fd)
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        if device_kind == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{store}", rank=rank,
                                    world_size=world_size, device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        recorder = _Recorder()
    except BaseException as exc:  # noqa: BLE001 - reported, then this worker ends
        conn.send_bytes(_dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())))
        os._exit(2)
    conn.send_bytes(_dumps(("ready", None, "")))
    make = solution = None
    while True:
        op, arg, send = _loads(conn.recv_bytes())
        if op == "exit":
            break
        failed = False
        try:
            if op == "load":
                release_cached_memory(device)  # the last problem's tensors: this worker outlives problems
                problem = Problem.from_json(arg)
                make = _maker(problem)
                solution = load_module(problem.reference, "commweave_problem_reference").solution
                conn.send_bytes(_dumps(("ok", None, "")))
                continue
            if make is None:
                raise RuntimeError(f"{op!r} before any problem was loaded")
            on_device = device.type == "cuda"  # what is sent stays on the GPU (CUDA IPC)
            value = None  # every rank runs the request (the maker and reference are collective); one answers
            if op == "inputs":  # several seeds per request: one round trip for a judge's batch
                if on_device:
                    torch.cuda.ipc_collect()  # the draws the judge has let go of since
                drawn = [_drawn(make(rank, world_size, seed, device), recorder) for seed in arg]
                if send:
                    value = _packed(drawn, device, on_device)
            elif op == "trace":
                args = make(rank, world_size, arg, device)
                with _Tracer() as tracer:
                    solution(*args)
                if send:
                    value = tracer.ops
            else:
                args = make(rank, world_size, arg, device)
                result = solution(*args)
                flat = flatten_result(args if result is None else result)
                if send:
                    value = _traveling(flat, on_device)
            conn.send_bytes(_dumps(("ok", value, "")))
        except Exception as exc:  # noqa: BLE001 - the problem's own failure, reported to the judge
            conn.send_bytes(_dumps(("error", f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc())))
            del exc
            failed = True
        args = result = value = drawn = flat = None  # nothing of a request outlives it but what the judge holds
        if failed:
            release_cached_memory(device)  # and what a failed request's tensors reserved goes back
    dist.destroy_process_group()
    os._exit(0)


# -- the judge side -------------------------------------------------------------------------------
class ReferenceWorkers:
    """W reference workers on this machine's `device` ('cpu' or 'cuda'), one problem loaded at a time."""

    def __init__(self, world_size: int, device: str):
        self.world_size, self.device = world_size, device
        self.problem: Problem | None = None
        self._dir = tempfile.mkdtemp(prefix="cw_problem_")
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        code = ("import sys; from commweave.problems.service import worker_main; a = sys.argv; "
                "worker_main(int(a[1]), int(a[2]), int(a[3]), a[4], a[5], int(a[6]))")
        try:
            for rank in range(world_size):
                ours, theirs = socket.socketpair()
                argv = [str(theirs.fileno()), str(rank), str(world_size), device, str(Path(self._dir) / "store"),
                        str(os.getpid())]
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-c", code, *argv],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True))
                own_child(self._procs[-1].pid)
                theirs.close()
                self._conns.append(Connection(ours.detach()))
            self._replies(START_S, "starting")
        except BaseException:
            self.close()
            raise

    def _replies(self, timeout_s: float, what: str) -> list[Any]:
        """Every worker's answer; the first error raised once all answered. After an error the
        others get ERROR_GRACE_S (a peer may wait in a collective the failed rank never joins):
        then the workers are closed (the next use starts fresh ones)."""
        deadline = time.monotonic() + timeout_s
        values: list[Any] = []
        error: ReferenceError | None = None
        for rank, conn in enumerate(self._conns):
            limit = deadline if error is None else min(deadline, time.monotonic() + ERROR_GRACE_S)
            if not conn.poll(max(0.0, limit - time.monotonic())):
                self.close()
                raise error or ReferenceError(f"the problem's reference workers gave no answer {what} within "
                                              f"{timeout_s:.0f} s (a deadlock in the reference or its input maker?)")
            try:
                status, value, _ = _loads(conn.recv_bytes())
            except (EOFError, OSError):
                self.close()
                raise error or ReferenceError(f"reference worker {rank} died {what}") from None
            if status == "error" and error is None:
                error = ReferenceError(f"rank {rank}: {value}")
            values.append(value)
        if error is not None:
            if what == "starting":
                self.close()
            raise error
        return values

    @property
    def alive(self) -> bool:
        return bool(self._conns)

    def load(self, problem: Problem) -> None:
        """Make `problem` the one the workers run (its files read and executed there)."""
        if problem != self.problem:
            self.problem = None
            self.request("load", problem.to_json(), None)
            self.problem = problem

    def request(self, op: str, seed: Any, rank: int | None) -> Any:
        """Every worker runs `op` on `seed` (for 'load': the problem); rank `rank`'s answer (every
        rank's, for None)."""
        if not self._conns:
            raise ReferenceError("the problem's reference workers were closed")
        for r, conn in enumerate(self._conns):
            conn.send_bytes(_dumps((op, seed, rank is None or r == rank)))
        answers = self._replies(REQUEST_S, f"to {op!r}")
        return answers if rank is None else answers[rank]

    def draws(self, seeds: list[int], rank: int) -> list[tuple[dict[str, torch.Tensor], Any]]:
        """Rank `rank`'s arguments drawn from each seed, in one request: its tensors (views of the
        request's one buffer) and the rest (skeleton, groups)."""
        return unpacked(*self.request("inputs", seeds, rank))

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(_dumps(("exit", 0, False)))
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)
