"""The offline fast path for a problem: recognise a known pattern in its reference, bind a template.

The reference is traced in its reference workers (every op it dispatches, collectives included,
with argument shapes and dtypes, on rank 0 of a fresh seed). A pattern we have a template for is
matched on that op sequence: an all-gather beside a matmul (gemm-allgather; after an FP8 cast,
gemm-allgather-lossy), a matmul then a reduce-scatter (gemm-reducescatter), an all-to-all around
expert matmuls (moe), point-to-point exchanges around a softmax (ring attention: attention-cp).
The binding names the workload and its shape from the traced matmul, so `commweave evolve`
searches that template at the problem's size; a problem it cannot bind gets one line saying why.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from commweave.problems.format import Problem
from commweave.problems.service import ReferenceWorkers

GATHER = ("allgather", "_allgather_base", "allgather_into_tensor")
SCATTER = ("reduce_scatter", "_reduce_scatter_base")
ALL_TO_ALL = ("alltoall",)
P2P = ("c10d.send", "c10d.recv")
MATMUL = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.matmul.")
SOFTMAX = ("softmax", "aten.exp.", "logsumexp")


@dataclass(frozen=True)
class Binding:
    """A problem bound to a workload's template at a shape (the workload's own shape label)."""

    workload: str
    shape: str
    pattern: str


class Unbound(ValueError):
    """No known pattern in the reference: one line why."""


Op = tuple[str, list[tuple[int, ...]], list[str]]


def _first(ops: list[Op], names: tuple[str, ...], start: int = 0) -> int | None:
    return next((i for i in range(start, len(ops)) if any(n in ops[i][0] for n in names)), None)


def _matmul_mnk(op: Op) -> tuple[int, int, int]:
    """(M, N, K) of a traced 2-D matmul (addmm's bias first)."""
    shapes = [s for s in op[1] if len(s) == 2]
    a, b = shapes[-2], shapes[-1]
    return a[0], b[1], a[1]


def bind_trace(ops: list[Op], world_size: int) -> Binding:
    """The binding of a traced reference, or Unbound naming what was (not) found."""
    names = [o[0] for o in ops]
    gather, scatter = _first(ops, GATHER), _first(ops, SCATTER)
    a2a, p2p, soft = _first(ops, ALL_TO_ALL), _first(ops, P2P), _first(ops, SOFTMAX)
    mm = _first(ops, MATMUL)
    fp8 = next((i for i, o in enumerate(ops) if any("float8" in d for d in o[2])), None)
    if a2a is not None and mm is not None:
        return Binding("moe", "", "all-to-all dispatch / expert matmuls / combine")
    if p2p is not None and soft is not None:
        return Binding("attention-cp", "", "ring attention (point-to-point KV exchange around a softmax)")
    if mm is not None and scatter is not None and mm < scatter:
        m, n, k_local = _matmul_mnk(ops[mm])
        return Binding("gemm-reducescatter", f"{m}x{n}x{k_local * world_size}", "matmul -> reduce-scatter")
    if gather is not None and mm is not None and len([s for s in ops[mm][1] if len(s) == 2]) >= 2:
        m, n, k = _matmul_mnk(ops[mm])
        lossy = fp8 is not None and fp8 < gather
        if mm > gather:  # the gathered operand is the matmul's input
            return Binding("gemm-allgather-lossy" if lossy else "gemm-allgather", f"{m}x{n}x{k}",
                           ("FP8 quantize -> " if lossy else "") + "all-gather -> matmul")
        return Binding("gemm-allgather", f"{m}x{n * world_size}x{k}", "matmul -> all-gather")
    seen = sorted({n.split(".")[1] for n in names if n.startswith("c10d.")}) or ["no collective"]
    raise Unbound(f"no known pattern (all-gather/matmul, matmul/reduce-scatter, all-to-all, ring attention, FP8 "
                  f"all-gather) in its reference: it runs {', '.join(seen)}"
                  f"{' and a matmul' if mm is not None else ', no matmul'}")


def bind_problems(problems: list[Problem], world_size: int, device: str) -> dict[str, Binding | str]:
    """Each problem's binding, or the one line why it has none (traced at `world_size` on `device`,
    in one set of reference workers)."""
    from commweave.problems.service import ReferenceError

    bound: dict[str, Binding | str] = {}
    workers: ReferenceWorkers | None = None
    try:
        for problem in problems:
            if workers is None or not workers.alive:
                workers = ReferenceWorkers(world_size, device)
            try:
                workers.load(problem)
                bound[problem.name] = bind_trace(workers.request("trace", secrets.randbelow(1 << 30), 0), world_size)
            except (Unbound, ReferenceError) as exc:
                bound[problem.name] = str(exc)
    finally:
        if workers is not None:
            workers.close()
    return bound


def bind_problem(problem: Problem, world_size: int, device: str) -> Binding:
    """Trace the problem's reference at `world_size` on `device` and bind it (Unbound if not)."""
    workers = ReferenceWorkers(world_size, device)
    try:
        workers.load(problem)
        ops = workers.request("trace", secrets.randbelow(1 << 30), 0)
    finally:
        workers.close()
    return bind_trace(ops, world_size)
