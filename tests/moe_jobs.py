"""Jobs for tests/test_moe_training.py, run inside WorkerPool workers (imported by name): the MoE
layer trained over the worker's default process group, as a user's program does it."""

from __future__ import annotations

import torch

TOKENS, HIDDEN, INTER, TOP_K = 10, 32, 16, 3


def moe_data(world: int, experts: int) -> dict[str, torch.Tensor]:
    """Every rank's tokens, routing and output gradients [W, T, ...] and every expert's weights,
    the same on every rank. The last expert is never chosen (an empty group on its rank)."""
    gen = torch.Generator().manual_seed(4321)
    idx = torch.stack([torch.randperm(experts - 1, generator=gen)[:TOP_K] for _ in range(world * TOKENS)])
    return {
        "x": torch.randn(world, TOKENS, HIDDEN, generator=gen).bfloat16(),
        "topk_idx": idx.view(world, TOKENS, TOP_K),
        "topk_weights": torch.rand(world, TOKENS, TOP_K, generator=gen),
        "w13": (torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).bfloat16(),
        "w2": (torch.randn(experts, HIDDEN, INTER, generator=gen) / INTER**0.5).bfloat16(),
        "grad": torch.randn(world, TOKENS, HIDDEN, generator=gen).bfloat16(),
    }


def reference(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One float32 autograd computation over every rank's tokens, one (token, expert) at a time:
    the output [W, T, H] and the gradients of loss = sum(out * grad)."""
    x, w, w13, w2 = (data[n].to(torch.float32, copy=True).requires_grad_() for n in ("x", "topk_weights", "w13", "w2"))
    idx = data["topk_idx"]
    rows = []
    for r in range(x.shape[0]):
        for t in range(x.shape[1]):
            row = 0
            for k in range(idx.shape[2]):
                e = int(idx[r, t, k])
                gate_up = w13[e] @ x[r, t]
                row = row + w[r, t, k] * (w2[e] @ (torch.nn.functional.silu(gate_up[:INTER]) * gate_up[INTER:]))
            rows.append(row)
    out = torch.stack(rows).view(x.shape)
    (out * data["grad"].float()).sum().backward()
    return {"out": out.detach(), "x": x.grad, "topk_weights": w.grad, "w13": w13.grad, "w2": w2.grad}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def moe_training(ctx, experts: int, compiled: bool = False, compiler: str = "aot_eager", steps: int = 2) -> dict:
    """`steps` training steps of ExpertParallelMoE over the default group (the same data each
    step, gradients reset), eager or under torch.compile(fullgraph=True): the last step's errors of
    the output and the four gradients (this rank's tokens and experts) against `reference`, and,
    compiled, the commweave ops in dynamo's graph and the differences from an eager step."""
    from commweave.nn import ExpertParallelMoE

    world, rank = ctx.world_size, ctx.rank
    data = moe_data(world, experts)
    want = reference(data)
    layer = ExpertParallelMoE(HIDDEN, INTER, experts)
    layer.load_full(data["w13"], data["w2"])
    mine = slice(layer.local_experts.start, layer.local_experts.stop)
    want = {"out": want["out"][rank], "x": want["x"][rank], "topk_weights": want["topk_weights"][rank],
            "w13": want["w13"][mine], "w2": want["w2"][mine]}

    def step(model) -> dict[str, torch.Tensor]:
        layer.w13.grad = layer.w2.grad = None
        x = data["x"][rank].clone().requires_grad_()
        w = data["topk_weights"][rank].clone().requires_grad_()
        out = model(x, data["topk_idx"][rank], w)
        (out.float() * data["grad"][rank].float()).sum().backward()
        return {"out": out.detach(), "x": x.grad, "topk_weights": w.grad, "w13": layer.w13.grad, "w2": layer.w2.grad}

    for _ in range(steps):
        eager = step(layer)
    result = {"errors": {k: _rel(eager[k], want[k]) for k in want},
              "dtypes": {k: str(v.dtype) for k, v in eager.items()}}
    if compiled:
        graphs: list[list[str]] = []

        def backend(gm, example_inputs):
            graphs.append(sorted(str(n.target) for n in gm.graph.nodes if "commweave" in str(n.target)))
            return torch._dynamo.lookup_backend(compiler)(gm, example_inputs)

        fast_model = torch.compile(layer, fullgraph=True, backend=backend)
        for _ in range(steps):
            fast = step(fast_model)
        result["graphs"] = graphs
        result["compiled_errors"] = {k: _rel(fast[k], want[k]) for k in want}
        result["compiled_vs_eager"] = {k: _rel(fast[k], eager[k]) for k in want}
    return result


def train_yardstick(ctx, seed: int = 3) -> dict:
    """The moe workload's `train_host` yardstick (the host program's training step) run as the
    bench runs a program, on the first check shape: its output's error against the reference."""
    from commweave.contracts.program import load_program
    from commweave.workloads import get_workload

    wl = get_workload("moe")
    shape = wl.check_shapes(ctx.world_size)[0]
    inputs = wl.make_inputs(shape, ctx.world_size, ctx.rank, seed, ctx.device)
    module = load_program(wl.yardstick_text("train_host"), "train_host")
    out = wl.make_output(shape, ctx.world_size, ctx.rank, ctx.device)
    module.run(ctx, module.setup(ctx, shape), inputs, out)
    return {"error": _rel(out, wl.reference(shape, ctx.world_size, ctx.rank, seed, ctx.device))}
