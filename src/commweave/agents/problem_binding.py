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

import math
import secrets
from dataclasses import dataclass

from commweave.problems.format import Problem
from commweave.problems.service import ReferenceWorkers

GATHER = ("allgather", "_allgather_base", "allgather_into_tensor")
SCATTER = ("reduce_scatter", "_reduce_scatter_base")
ALL_TO_ALL = ("alltoall",)
P2P = ("c10d.send", "c10d.recv")
MATMUL = ("aten.mm.", "aten.addmm.", "aten.matmul.")
EXPERT_MATMUL = (*MATMUL, "aten.bmm.")
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


def _is(op: Op, names: tuple[str, ...]) -> bool:
    return any(n in op[0] for n in names)


def _numels(op: Op) -> list[int]:
    return [math.prod(s) for s in op[1]]


def _matmul_mnk(op: Op) -> tuple[int, int, int] | None:
    """(M, N, K) of a traced 2-D matmul (addmm's bias first), None for another rank."""
    shapes = [s for s in op[1] if len(s) == 2]
    if len(shapes) < 2 or shapes[-2][1] != shapes[-1][0]:
        return None
    a, b = shapes[-2], shapes[-1]
    return a[0], b[1], a[1]


def _gemm_collective(ops: list[Op], world_size: int) -> Binding | None:
    """A matmul and a collective joined by data, as far as shapes tell: the gathered tensor is a
    matmul operand (all-gather -> matmul), the matmul's output is what is gathered (matmul ->
    all-gather) or reduce-scattered (matmul -> reduce-scatter)."""
    for i, op in enumerate(ops):
        mnk = _matmul_mnk(op) if _is(op, MATMUL) else None
        if mnk is None:
            continue
        m, n, k = mnk
        operands = {math.prod(s) for s in op[1] if len(s) == 2}
        for j in range(i - 1, -1, -1):  # the nearest all-gather before it whose gathered tensor it multiplies
            if _is(ops[j], GATHER) and world_size * min(_numels(ops[j])) in operands:
                lossy = any("float8" in d for d in ops[j][2])
                return Binding("gemm-allgather-lossy" if lossy else "gemm-allgather", f"{m}x{n}x{k}",
                               ("FP8 quantize -> " if lossy else "") + "all-gather -> matmul")
        for later in ops[i + 1:]:
            if _is(later, GATHER) and min(_numels(later)) == m * n:
                return Binding("gemm-allgather", f"{m}x{n * world_size}x{k}", "matmul -> all-gather")
            if _is(later, SCATTER) and max(_numels(later)) == m * n:
                return Binding("gemm-reducescatter", f"{m}x{n}x{k * world_size}", "matmul -> reduce-scatter")
    return None


def _between(ops: list[Op], names: tuple[str, ...], inside: tuple[str, ...]) -> bool:
    """Two or more ops of `names`, and an op of `inside` between the first and the last."""
    at = [i for i, op in enumerate(ops) if _is(op, names)]
    return len(at) >= 2 and any(_is(op, inside) for op in ops[at[0]:at[-1]])


def bind_trace(ops: list[Op], world_size: int) -> Binding:
    """The binding of a traced reference, or Unbound naming what was (not) found."""
    gemm = _gemm_collective(ops, world_size)
    if gemm is not None:
        return gemm
    if _between(ops, ALL_TO_ALL, EXPERT_MATMUL) and not _between(ops, ALL_TO_ALL, SOFTMAX):
        return Binding("moe", "", "all-to-all dispatch -> expert matmuls -> all-to-all combine")
    if _between(ops, P2P, SOFTMAX):
        return Binding("attention-cp", "", "ring attention (point-to-point KV exchange around a softmax)")
    seen = sorted({op[0].split(".")[1] for op in ops if op[0].startswith("c10d.")}) or ["no collective"]
    matmul = any(_is(op, EXPERT_MATMUL) for op in ops)
    raise Unbound(f"no known pattern (all-gather/matmul, matmul/reduce-scatter, all-to-all around expert matmuls, "
                  f"ring attention, FP8 all-gather) in its reference: it runs {', '.join(seen)}"
                  f"{' and matmuls not joined to them' if matmul else ', no matmul'}")


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
