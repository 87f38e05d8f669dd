"""Running a workload's program on a user's tensors, inside the user's own distributed program.

The user has initialized torch.distributed (one process per GPU: NCCL on CUDA, gloo on CPU). This
process then gets one `RankContext` per process group an op is called over, made at the group's
first op call and kept (`context(group=)`); each program text is loaded once; and each program's
`setup` state is kept per (group, shape), because setup allocates symmetric windows, creates device
communicators and compiles kernels, far too slow to repeat per call, and impossible inside a CUDA
graph capture (a first call of a shape under capture raises; later calls are capturable).

Collective: setup talks to every rank of the group. All its ranks must make the same op calls, in
the same order, with tensors of the same shapes (kv-transfer: the same tables and cache geometry
on both ranks of a pair). When a call needs a new setup, the ranks first compare what they were given and all
raise the same ValueError if they differ, instead of hanging in a half-matched collective. An
error only one rank raises (a bad tensor on that rank alone) leaves the others waiting in the
program's collectives, as with any torch.distributed collective. Each shape's state (its windows)
is kept until `close()`: a model whose shapes vary call to call pays a setup for every new one.
"""

from __future__ import annotations

import inspect
import os
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commweave.contracts.program import load_program, parse_program, unavailable_reason
from commweave.ops.exported import export_info
from commweave.ops.groups import SINGLE, GroupLike, group_name, group_size, process_group
from commweave.runtime.context import RankContext
from commweave.runtime.default import close_context, contexts
from commweave.runtime.default import context as group_context
from commweave.runtime.launch import on_device
from commweave.contracts.workload import Shape, Workload
from commweave.workloads import get_workload

#: a program: None (the workload's seed), one of its program names, or a program file's path
ProgramSpec = str | os.PathLike | None

_modules: dict[str, types.ModuleType] = {}  # program text digest -> loaded module
_states: dict[tuple[Any, ...], tuple[RankContext, types.ModuleType, Any]] = {}  # (group, workload, digest, shape) -> ...
_warned: set[str] = set()  # workloads whose seed fallback was announced


def context(device: torch.device | str | None = None, group: GroupLike = None) -> RankContext:
    """This process's context over `group` (None: the default group; see `commweave.ops.groups`),
    made at its first use, a collective over the group's members."""
    name = group_name(group)
    return group_context(device, process_group(name))


def close() -> None:
    """Collective: tear down every program's state and this process's contexts (NCCL communicators,
    windows), every group's. Call it on every rank before `destroy_process_group()`; a later op
    call starts over."""
    try:
        for ctx, module, state in _states.values():
            teardown = getattr(module, "teardown", None)
            if teardown is not None:
                teardown(ctx, state)
    finally:
        _states.clear()
        close_context()


def _loaded(text: str, name: str) -> tuple[types.ModuleType, str]:
    """(module, digest) of a program text, executed once per process."""
    digest = parse_program(text).digest
    if digest not in _modules:
        _modules[digest] = load_program(text, name)
    return _modules[digest], digest


def program_source(wl: Workload, program: ProgramSpec) -> tuple[str, str]:
    """(name, text) of `program` for workload `wl`: None is its seed; a name of one of its
    programs; anything else a file (such as one `commweave export` wrote), which must not be
    exported for another workload."""
    if program is None:
        return wl.seed, wl.program_text(wl.seed)
    if not isinstance(program, (str, os.PathLike)):
        raise ValueError(f"program must be None, a program name or a file path, not {type(program).__name__}")
    if isinstance(program, str) and program in wl.program_names():
        return program, wl.program_text(program)
    path = Path(program)
    if not path.is_file():
        raise ValueError(f"program {os.fspath(program)!r} is neither a program of {wl.name} "
                         f"({', '.join(wl.program_names())}) nor a file")
    text = path.read_text()
    info = export_info(text)
    if info is not None and info["workload"] != wl.name:
        raise ValueError(f"{path} was exported for workload {info['workload']!r}, not {wl.name!r}")
    return path.stem, text


class Op:
    """A workload's program as a function of a user's tensors: `Op("gemm-allgather")(a=..., b=...)`
    returns this rank's output. Tensors are named as in the workload's `make_inputs`; `out` is an
    output the caller owns (written in place, e.g. kv-transfer's paged cache), else one is made;
    `group` picks the ranks (`commweave.ops.groups`); other keywords are options of the workload's
    `shape_from_inputs` (attention's `causal`). A call goes through the custom op
    `torch.ops.commweave.call` (or `call_out`), so torch.compile sees one opaque op.

    With `program=None` it runs the workload's seed, or, where the seed says it cannot run here
    (`available(ctx)`, e.g. on CPU), the workload's fitness baseline, with one warning."""

    def __init__(self, workload: str | Workload, program: ProgramSpec = None):
        self.workload = get_workload(workload) if isinstance(workload, str) else workload
        self.default = program is None
        self.spec = None if program is None else os.fspath(program)
        self.program, self._text = program_source(self.workload, program)
        parse_program(self._text)  # a malformed file fails here, not at the first call
        self._module: types.ModuleType | None = None
        self._digest = ""
        params = inspect.signature(self.workload.shape_from_inputs).parameters
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.options = {n for n, p in params.items() if p.kind in named and n not in ("inputs", "world_size", "rank", "out")}
        _ops.setdefault((self.workload.name, self.spec), self)

    def __repr__(self) -> str:
        return f"Op({self.workload.name!r}, program={self.program!r})"

    def __call__(self, out: torch.Tensor | None = None, group: GroupLike = None, **kwargs: Any) -> torch.Tensor:
        options = {k: v for k, v in kwargs.items() if k in self.options}
        inputs = {k: v for k, v in kwargs.items() if k not in self.options}
        return self._call_custom_op(inputs, out, group_name(group), options)

    def _call_custom_op(self, inputs: dict[str, Any], out: torch.Tensor | None, group: str,
                        options: dict[str, Any]) -> torch.Tensor:
        """`op(**inputs)` through the generic custom op: tensors in the workload's order, options as
        one string (what a custom op's schema can carry)."""
        order = self.input_order(inputs)
        unknown = sorted(set(inputs) - set(order))
        if unknown:
            raise ValueError(f"unexpected input {', '.join(unknown)} for {self.workload.name} (expects {', '.join(order)})")
        for name, value in inputs.items():
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, not {type(value).__name__}")
        if out is not None and not isinstance(out, torch.Tensor):
            raise ValueError(f"the output must be a torch.Tensor, not {type(out).__name__}")
        no_backward(f"op({self.workload.name!r})", {**inputs, "out": out})
        tensors = [inputs.get(n) for n in order]
        encoded = ",".join(f"{k}={options[k]!r}" for k in sorted(options))
        if out is None:
            return torch.ops.commweave.call(self.workload.name, self.spec, group, ",".join(order), tensors, encoded)
        torch.ops.commweave.call_out(self.workload.name, self.spec, group, ",".join(order), tensors, encoded, out)
        return out

    def input_order(self, inputs: dict[str, Any]) -> tuple[str, ...]:
        """The names of a call's tensors in the order the custom op carries them: the workload's
        declared `input_names`, else the caller's names, sorted."""
        return tuple(self.workload.op_inputs) or tuple(sorted(inputs))

    def shape(self, inputs: dict[str, torch.Tensor], world_size: int, rank: int, out: torch.Tensor | None,
              options: dict[str, Any]) -> Shape:
        """The call's shape (the workload checks the tensors); None inputs are absent ones."""
        given = {k: v for k, v in inputs.items() if v is not None}
        if not given and out is None:
            raise ValueError(f"{self.workload.name} got no tensors (expects them named as in make_inputs)")
        return self.workload.shape_from_inputs(given, world_size, rank, out=out, **options)

    def run(self, group: str, inputs: dict[str, torch.Tensor | None], out: torch.Tensor | None = None,
            **options: Any) -> torch.Tensor:
        """This rank's output over the group named `group` (W >= 2): the program on the group's
        context. What the custom ops execute; call the Op itself from user code."""
        wl = self.workload
        inputs = {k: v for k, v in inputs.items() if v is not None}
        first = next((v for v in [*inputs.values(), out] if isinstance(v, torch.Tensor)), None)
        if first is None:
            raise ValueError(f"{wl.name} got no tensors (expects them named as in make_inputs)")
        pg = process_group(group)
        capturing = first.is_cuda and torch.cuda.is_current_stream_capturing()
        ctx = group_context(first.device, pg) if not capturing else _existing_context(wl, group, first.device)
        shape = self.shape(inputs, ctx.world_size, ctx.rank, out, options)
        inputs = {k: v.contiguous() for k, v in inputs.items()}
        if out is not None:
            _check_out(out, wl.make_output(shape, ctx.world_size, ctx.rank, torch.device("meta")), ctx.device)
        if getattr(wl, "symmetric_output", False) and ctx.is_cuda:
            _check_symmetric(ctx, wl, out)
        with on_device(ctx.device):
            module = self._resolve(ctx)
            state = self._state(ctx, group, module, shape, capturing)
            if out is None:
                out = wl.make_output(shape, ctx.world_size, ctx.rank, ctx.device)
            module.run(ctx, state, inputs, out)
        return out

    def _resolve(self, ctx: RankContext) -> types.ModuleType:
        """The program module to run on this rank (the seed, or its fallback; loaded once)."""
        if self._module is not None:
            return self._module
        wl = self.workload
        module, digest = _loaded(self._text, self.program)
        reason = unavailable_reason(module, ctx)
        if reason and not self.default:
            raise RuntimeError(f"program {self.program!r} of {wl.name} cannot run here: {reason}")
        if reason:
            fallback = wl.baselines[0]
            module, digest = _loaded(wl.program_text(fallback), fallback)
            why_not = unavailable_reason(module, ctx)
            if why_not:
                raise RuntimeError(f"{wl.name}: neither its seed ({reason}) nor its baseline {fallback!r} ({why_not}) "
                                   "can run here")
            if wl.name not in _warned:
                _warned.add(wl.name)
                warnings.warn(f"commweave.ops: {wl.name}'s seed cannot run here ({reason}); running its baseline "
                              f"program {fallback!r} instead", RuntimeWarning, stacklevel=4)
            self.program = fallback
        self._module, self._digest = module, digest
        return module

    def _state(self, ctx: RankContext, group: str, module: types.ModuleType, shape: Shape, capturing: bool) -> Any:
        """`setup(ctx, shape)`'s state, made once per (group, program, shape) after the ranks agree."""
        key = (group, self.workload.name, self._digest, shape.label, tuple(sorted(shape.params.items())))
        if key not in _states:
            if capturing:
                raise RuntimeError(_CAPTURE_FIRST.format(what=f"{self.workload.name} on {shape.label} over group {group!r}"))
            everyone: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(everyone, (self.program, key), group=ctx.cpu_group)
            if any(theirs != key for _, theirs in everyone):
                listed = "; ".join(f"rank {r}: {k[1]} program {name!r} on {k[3]}" for r, (name, k) in enumerate(everyone))
                raise ValueError(f"ranks called {self.workload.name} with different programs or shapes ({listed}); "
                                 "setup is collective: every rank must pass tensors of the same shapes")
            _states[key] = (ctx, module, module.setup(ctx, shape))
        return _states[key][2]


_CAPTURE_FIRST = ("commweave.ops: the first call of {what} runs the program's setup (symmetric windows, device "
                  "communicators, kernel compiles, a collective among the ranks), which a CUDA graph capture cannot "
                  "hold: call the op once with these shapes before capturing")

_ops: dict[tuple[str, str | None], Op] = {}  # (workload, program spec) -> its Op


def op(workload: str, program: ProgramSpec = None) -> Op:
    """The process's `Op` for (workload, program), made once (a file is read once)."""
    key = (workload, None if program is None else os.fspath(program))
    if key not in _ops:
        _ops[key] = Op(workload, program)
    return _ops[key]


def _existing_context(wl: Workload, group: str, device: torch.device) -> RankContext:
    """The group's context during a CUDA graph capture, which cannot create one."""
    ctx = contexts().get(group)
    if ctx is None:
        raise RuntimeError(_CAPTURE_FIRST.format(what=f"an op over group {group!r} ({wl.name})"))
    return ctx


def symmetric_zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str | None = None, group: GroupLike = None) -> torch.Tensor:
    """A zeroed tensor in a symmetric window of this process's context over `group`, which peers'
    device programs can store into: on GPUs, the output of a workload whose programs need one
    (kv-transfer's paged cache). Collective: every rank of the group the op will run over calls it
    in the same order with the same shape. It lives until `close()`. On CPU, or on one rank
    (nothing stores into it from elsewhere), a plain zeroed tensor."""
    name = group_name(group)
    if name == SINGLE or group_size(name) == 1:
        return torch.zeros(tuple(shape), dtype=dtype, device=device or "cpu")
    ctx = context(device, name)
    if not ctx.is_cuda:
        return torch.zeros(tuple(shape), dtype=dtype, device=ctx.device)
    with torch.cuda.device(ctx.device):
        return ctx.symmetric(tuple(shape), dtype)


def _check_symmetric(ctx: RankContext, wl: Workload, out: torch.Tensor | None) -> None:
    """A ValueError unless `out` lies in one of this context's windows (a workload whose device
    programs store into peers' outputs: its output must be symmetric on every rank)."""
    how = "allocate it with commweave.ops.symmetric_zeros(shape, dtype) on every rank"
    if out is None:
        raise ValueError(f"on GPUs {wl.name}'s programs store into peers' outputs: pass the output, {how}")
    try:
        ctx.window(out)
    except ValueError:
        raise ValueError(f"on GPUs {wl.name}'s programs store into peers' outputs, so the output must lie in a "
                         f"symmetric window: {how}") from None


def _check_out(out: Any, expected: torch.Tensor, device: torch.device) -> None:
    """A ValueError unless the caller's `out` matches the workload's output for this call."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the output must be a torch.Tensor, not {type(out).__name__}")
    if tuple(out.shape) != tuple(expected.shape) or out.dtype != expected.dtype:
        raise ValueError(f"the output must be {tuple(expected.shape)} {expected.dtype} for these inputs, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if out.device != device:
        raise ValueError(f"the output is on {out.device}, the inputs on {device}")
    if not out.is_contiguous():
        raise ValueError("the output must be contiguous (programs write it in place)")


def no_backward(name: str, tensors: dict[str, Any]) -> None:
    """A RuntimeError naming what is missing when a call would need a gradient this op lacks."""
    needing = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if needing and torch.is_grad_enabled():
        raise RuntimeError(f"commweave.ops.{name} has no backward yet, and {', '.join(needing)} require grad: call it "
                           "under torch.no_grad() or with detached tensors (gemm_allgather and gemm_reducescatter "
                           "have backward)")
