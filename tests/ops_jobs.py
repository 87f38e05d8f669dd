"""Jobs for tests/test_ops*.py and tests/test_nn.py, run inside WorkerPool workers
(imported by name). They call `commweave.ops` the way a user's distributed program does: the
worker's process group is initialized, and the ops make their own context from it (the pool's
`ctx` is not used)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import commweave.ops as ops
from commweave.contracts.poison import poison_
from commweave.contracts.workload import Shape, Workload
from commweave.evaluate.checks import judge_output
from commweave.ops import runner
from commweave.workloads import get_workload


def _call(wl: Workload, shape: Shape, inputs: dict[str, torch.Tensor], out: torch.Tensor | None,
          program: str | None, group=None) -> torch.Tensor:
    """The workload's op by name, with its declared inputs and the options its shape implies: no
    test code names a workload (a plugin's op runs the same way)."""
    return ops.op(wl.name, program)(out=out, group=group, **inputs, **wl.op_options(shape))


def _error(wl: Workload, shape: Shape, world: int, rank: int, seed: int, out: torch.Tensor) -> float:
    """Relative Frobenius error against the reference over the elements a call writes, after the
    harness's own judgement (poison left, NaN, elements it must leave alone): inf if that fails."""
    ref = wl.reference(shape, world, rank, seed, out.device)
    untouched = wl.untouched(shape, world, rank, seed, out.device)
    if not judge_output(out, ref, wl.tolerance(), untouched).ok:
        return float("inf")
    keep = ~untouched if untouched is not None else torch.ones_like(ref, dtype=torch.bool)
    return float((out.float()[keep] - ref[keep]).norm() / ref[keep].norm())


def op_check(ctx, workload: str, shape_text: str, seed: int, calls: int = 2, program: str | None = None,
             path: str | None = None, pairs: bool = False) -> dict:
    """Call a workload's op (or `ops.load(path)`) `calls` times with fresh inputs from make_inputs:
    the largest error, whether the inputs stayed intact, and the warnings raised. `pairs`: over
    groups of two ranks ({0, 1}, {2, 3}, ...), each pair computing its own call at W = 2."""
    wl = get_workload(workload)
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    group = None
    if pairs:
        groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        group, world, rank = groups[rank // 2], 2, rank % 2
    shape = wl.parse_shape(shape_text, world)
    worst, intact = 0.0, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(calls):
            inputs = wl.make_inputs(shape, world, rank, seed + call, device)
            if wl.op_inputs:  # what a user passes (kv-transfer's stand-in prefill inputs are not)
                inputs = {k: v for k, v in inputs.items() if k in wl.op_inputs}
            out = None
            if wl.symmetric_output:  # the caller's output, allocated as a user does (a window on GPUs)
                like = wl.make_output(shape, world, rank, torch.device("meta"))
                out = poison_(ops.symmetric_zeros(like.shape, like.dtype, device, group=group))
            if path is not None:
                result = ops.load(path)(out=out, group=group, **inputs)
            else:
                result = _call(wl, shape, inputs, out, program, group)
            if out is not None and result is not out:
                raise AssertionError("an op given its output must write and return that tensor")
            worst = max(worst, _error(wl, shape, world, rank, seed + call, result))
            pristine = wl.make_inputs(shape, world, rank, seed + call, device)
            intact = intact and all(torch.equal(inputs[k], pristine[k]) for k in inputs)
    return {"error": worst, "inputs_intact": intact, "warnings": [str(w.message) for w in caught],
            "device": str(ops.context(group=group).device)}


def fallback_warns_once(ctx) -> list[str]:
    """Two gemm calls from a fresh start: the seed cannot run on CPU, so one warning, then none."""
    runner._ops.pop(("gemm-allgather", None), None)
    runner._warned.discard("gemm-allgather")
    wl = get_workload("gemm-allgather")
    shape = wl.check_shapes(ctx.world_size)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (1, 2):
            inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, seed, ctx.device)
            ops.gemm_allgather(inputs["a"], inputs["b"])
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def close_and_start_over(ctx) -> dict:
    """`ops.close()` drops the context and the setups; the next call makes new ones and works."""
    wl = get_workload("gemm-allgather")
    shape = wl.check_shapes(ctx.world_size)[0]
    inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, 9, ctx.device)
    ops.gemm_allgather(inputs["a"], inputs["b"])
    before = ops.context()
    ops.close()
    ops.close()  # a second close does nothing
    out = ops.gemm_allgather(inputs["a"], inputs["b"])
    return {"new_context": ops.context() is not before, "states": len(runner._states),
            "error": _error(wl, shape, ctx.world_size, ctx.rank, 9, out)}


def _raises(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_calls(ctx) -> dict[str, str]:
    """What each bad call raises, on every rank (the same bad call on every rank, or, for
    'ranks_disagree', different shapes per rank: caught when the ranks compare before setup)."""
    rank, world = ctx.rank, ctx.world_size
    a = torch.randn(8, 16).bfloat16()
    b = torch.randn(16, 4).bfloat16()
    got = {
        "dtype": _raises(ops.gemm_allgather, a.float(), b),
        "inner_dim": _raises(ops.gemm_allgather, a, b[:15]),
        "seed_on_cpu": _raises(ops.gemm_allgather, a, b, program="seed"),
        "unknown_program": _raises(ops.gemm_allgather, a, b, program="no_such_program"),
        "causal_not_bool": _raises(ops.context_parallel_attention, a.view(8, 2, 8), a.view(8, 2, 8), a.view(8, 2, 8),
                                   causal="yes"),
        "kv_on_destination": _raises(ops.transfer_kv, torch.zeros(1, 2, 16, 1, 128).bfloat16(),
                                     torch.tensor([0]), torch.tensor([1]), torch.zeros(1, 2, 4, 16, 1, 128).bfloat16())
        if rank % 2 else "skipped",
        "ranks_disagree": _raises(ops.gemm_allgather, torch.randn(8 + 2 * rank, 16).bfloat16(), b),
    }
    # The ops still work after all that (no rank is left inside a collective).
    wl = get_workload("gemm-allgather")
    shape = wl.check_shapes(world)[0]
    inputs = wl.make_inputs(shape, world, rank, 5, ctx.device)
    out = ops.gemm_allgather(inputs["a"], inputs["b"])
    got["after"] = f"{_error(wl, shape, world, rank, 5, out):.3g}"
    dist.barrier(group=ops.context().cpu_group)
    return got


def gemm_vs_torch(ctx, shape_text: str, seed: int, calls: int = 3) -> dict:
    """GPU: `ops.gemm_allgather` with the seed (no fallback) against NCCL all-gather + torch.matmul
    in float32, `calls` times with fresh inputs (the seed's first call runs eagerly, later ones
    through CUDA graphs)."""
    wl = get_workload("gemm-allgather")
    world, rank = ctx.world_size, ctx.rank
    shape = wl.parse_shape(shape_text, world)
    worst = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(calls):
            inputs = wl.make_inputs(shape, world, rank, seed + call, ctx.device)
            out = ops.gemm_allgather(inputs["a"], inputs["b"])
            parts = [torch.empty_like(inputs["a"]) for _ in range(world)]
            dist.all_gather(parts, inputs["a"])
            want = torch.cat(parts).float() @ inputs["b"].float()
            torch.cuda.synchronize()
            worst = max(worst, float((out.float() - want).norm() / want.norm()))
    return {"error": worst, "program": runner.op("gemm-allgather").program,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


# -- tensor-parallel MLP from commweave.nn (tests/test_nn.py) ----------------------------------
HIDDEN, FFN, TOKENS = 16, 32, 8  # TOKENS per data-parallel replica


class TPMLP(torch.nn.Module):
    """A Megatron-style MLP block: column-parallel up projection, GELU, row-parallel down."""

    def __init__(self, group, device: torch.device):
        super().__init__()
        from commweave.nn import ColumnParallelLinear, RowParallelLinear

        self.up = ColumnParallelLinear(HIDDEN, FFN, group=group, device=device)
        self.down = RowParallelLinear(FFN, HIDDEN, group=group, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _mlp_data(replicas: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full weights w1 [FFN, HIDDEN], w2 [HIDDEN, FFN], inputs x and upstream gradients g
    [replicas, TOKENS, HIDDEN], all bf16 values (the same on every rank)."""
    gen = torch.Generator().manual_seed(1234)
    w1 = (torch.randn(FFN, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(HIDDEN, FFN, generator=gen) / FFN**0.5).bfloat16()
    x = torch.randn(replicas, TOKENS, HIDDEN, generator=gen).bfloat16()
    g = torch.randn(replicas, TOKENS, HIDDEN, generator=gen).bfloat16()
    return w1, w2, x, g


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def tp_mlp(ctx, tp: int, compiled: bool = False, compiler: str = "aot_eager") -> dict:
    """The TP MLP over tensor-parallel groups of `tp` consecutive ranks, data-parallel across them
    (a gradient all-reduce over each DP group, ranks with the same TP rank), against one plain
    float32 MLP over every replica's batch: errors of the output, the input gradient and both
    weight gradients (relative Frobenius), and the warnings raised. `compiled`: the block under
    torch.compile(fullgraph=True) with the `compiler` backend, its output and gradients also
    compared with eager's. On the worker's device (the reference on the CPU)."""
    world, rank = ctx.world_size, ctx.rank
    replicas = world // tp
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(replicas)]
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    tp_group, dp_group, replica, tp_rank = tp_groups[rank // tp], dp_groups[rank % tp], rank // tp, rank % tp
    w1, w2, x, g = _mlp_data(replicas)

    # the reference: one float32 MLP, every replica's batch, loss = sum of <y, g>
    rw1, rw2, rx = (t.float().requires_grad_() for t in (w1, w2, x))
    ry = torch.nn.functional.gelu(rx @ rw1.t()) @ rw2.t()
    (ry * g.float()).sum().backward()

    rows = slice(tp_rank * TOKENS // tp, (tp_rank + 1) * TOKENS // tp)
    want = {"y": ry[replica, rows], "x_grad": rx.grad[replica, rows],
            "up_grad": rw1.grad.chunk(tp, 0)[tp_rank], "down_grad": rw2.grad.chunk(tp, 1)[tp_rank]}

    def step(model) -> dict[str, torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        xs = x[replica, rows].to(ctx.device).requires_grad_()
        y = model(xs)
        (y.float() * g[replica, rows].to(ctx.device).float()).sum().backward()
        for p in model.parameters():  # data parallelism: sum the replicas' gradients
            dist.all_reduce(p.grad, group=dp_group)
        got = {"y": y.detach(), "x_grad": xs.grad, "up_grad": model.up.weight.grad, "down_grad": model.down.weight.grad}
        return {k: v.cpu() for k, v in got.items()}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = TPMLP(tp_group, ctx.device)
        model.up.load_full(w1)
        model.down.load_full(w2)
        eager = step(model)
        result = {"errors": {k: _rel(eager[k], want[k]) for k in want},
                  "shapes": {k: tuple(v.shape) for k, v in eager.items()}}
        if compiled:
            torch._dynamo.reset()
            graphs: list[list[str]] = []

            def backend(gm, example_inputs):  # records the commweave ops dynamo put in each graph
                graphs.append(sorted(str(n.target) for n in gm.graph.nodes if "commweave" in str(n.target)))
                return torch._dynamo.lookup_backend(compiler)(gm, example_inputs)

            fast = step(torch.compile(model, fullgraph=True, backend=backend))
            result["graphs"] = graphs
            result["compiled_errors"] = {k: _rel(fast[k], want[k]) for k in want}
            result["compiled_vs_eager"] = {k: _rel(fast[k], eager[k]) for k in want}
    result["warnings"] = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
    return result


def fake_shapes(ctx) -> dict:
    """Each op's output shape under FakeTensorMode over the default group (W = 2), nothing run;
    'mesh': gemm_allgather over a 1-D DeviceMesh of the same ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    with FakeTensorMode():
        a, b = torch.empty(6, 8, dtype=torch.bfloat16), torch.empty(8, 4, dtype=torch.bfloat16)
        q, k = torch.empty(8, 4, 16, dtype=torch.bfloat16), torch.empty(8, 2, 16, dtype=torch.bfloat16)
        moe = {"x": torch.empty(6, 16, dtype=torch.bfloat16), "topk_idx": torch.empty(6, 2, dtype=torch.int64),
               "topk_weights": torch.empty(6, 2), "w13": torch.empty(2, 16, 16, dtype=torch.bfloat16),
               "w2": torch.empty(2, 16, 8, dtype=torch.bfloat16)}
        shapes = {
            "gemm_allgather": ops.gemm_allgather(a, b), "gemm_reducescatter": ops.gemm_reducescatter(a, b),
            "context_parallel_attention": ops.context_parallel_attention(q, k, k), "moe_layer": ops.moe_layer(**moe),
            "call": ops.op("gemm-allgather")(a=a, b=b), "mesh": ops.gemm_allgather(a, b, group=mesh),
        }
    return {k: tuple(v.shape) for k, v in shapes.items()}


def gemm_in_captured_graph(ctx, shape_text: str, seed: int, replays: int = 3, subgroup: bool = False) -> dict:
    """GPU: gemm_allgather inside the caller's own CUDA graph. A capture of the shape's first call
    raises (its setup cannot be captured); after one eager call the capture records the program's
    call into the caller's graph, and `replays` replays on new values in the same buffers are
    compared with the reference. `subgroup`: over a group from new_group, not the default one."""
    wl = get_workload("gemm-allgather")
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    shape = wl.parse_shape(shape_text, world)
    group = dist.new_group(list(range(world))) if subgroup else None
    inputs = wl.make_inputs(shape, world, rank, seed, device)
    a, b = inputs["a"].clone(), inputs["b"].clone()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ops.gemm_allgather(a, b, group=group)
        first = "no error"
    except RuntimeError as exc:
        first = str(exc)
    ops.gemm_allgather(a, b, group=group)  # eager: setup and the program's first run
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.gemm_allgather(a, b, group=group)
    worst = 0.0
    for r in range(replays):
        fresh = wl.make_inputs(shape, world, rank, seed + 1 + r, device)
        a.copy_(fresh["a"])
        b.copy_(fresh["b"])
        graph.replay()
        torch.cuda.synchronize()
        want = wl.reference(shape, world, rank, seed + 1 + r, device)
        worst = max(worst, float((out.float() - want).norm() / want.norm()))
    return {"first_under_capture": first, "error": worst, "replays": replays,
            "program": runner.op("gemm-allgather").program}


def compiled_with_group_objects(ctx) -> dict:
    """torch.compile(fullgraph=True) of calls that pass the group as a ProcessGroup, a DeviceMesh
    and (mesh, dim name): the same results as eager."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
    group = dist.new_group(list(range(ctx.world_size)))

    def f(a, b):
        return (ops.gemm_allgather(a, b, group=group), ops.gemm_allgather(a, b, group=mesh),
                ops.gemm_reducescatter(a.t().contiguous() @ a, b, group=(mesh, "tp")))

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(ctx.rank)
    a, b = torch.randn(4, 8, generator=gen).bfloat16(), torch.randn(8, 6, generator=gen).bfloat16()
    eager = f(a, b)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(a, b)
    return {"equal": [bool(torch.equal(x, y)) for x, y in zip(eager, compiled)],
            "shapes": [tuple(x.shape) for x in compiled]}


def contexts_per_group(ctx) -> dict:
    """Calls over a pair group and over the default group make one context each, over exactly
    their ranks; `ops.close()` closes both, and the next call makes a fresh one."""
    from commweave.runtime.default import contexts

    pair = [dist.new_group([r, r + 1]) for r in range(0, ctx.world_size, 2)][ctx.rank // 2]
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(8, 2).bfloat16()
    ops.gemm_allgather(a, b, group=pair)
    ops.gemm_allgather(a, b)
    made = {("pair" if name == pair.group_name else "world"): (c.rank, c.world_size, c.group is pair)
            for name, c in contexts().items()}
    ops.close()
    after_close = len(contexts())
    ops.gemm_allgather(a, b, group=pair)
    return {"made": made, "after_close": after_close, "after_call": len(contexts())}
