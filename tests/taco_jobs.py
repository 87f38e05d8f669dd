"""Job functions for the TACO CPU tests (the pool's workers import them by name).

Every rank builds the same full tensors from a seed, so each rank can check its own result against
the uncompressed torch collective and against a single-process reference."""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist

from commweave.taco import collectives as cc
from commweave.taco.backend import resolve_group
from commweave.taco.quant import QuantConfig


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _inputs(seed: int, world: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * (1 + r) for r in range(world)]


def collectives_vs_torch(ctx, fmt: str, group_size: int, rows: int, cols: int, seed: int = 0,
                         hadamard: bool | str = True) -> dict:
    """Each compressed collective against its uncompressed torch result: relative errors, and the
    bound each one should meet (one quantization step, two for two-shot)."""
    world, rank = ctx.world_size, ctx.rank
    cfg = QuantConfig(group_size, fmt, hadamard=hadamard)
    xs = _inputs(seed + 1, world, (rows, cols))
    x = xs[rank]
    out = {}
    exact_gather = torch.cat(xs, dim=0)
    out["all_gather"] = _rel(cc.all_gather(x, cfg), exact_gather)
    out["all_gather_plain"] = _rel(cc.all_gather(x), exact_gather)
    exact_sum = sum(xs[1:], xs[0])
    exact_rs = exact_sum.chunk(world, dim=0)[rank]
    out["reduce_scatter"] = _rel(cc.reduce_scatter(x, cfg), exact_rs)
    out["reduce_scatter_plain"] = _rel(cc.reduce_scatter(x), exact_rs)
    one = cc.all_reduce(x, cfg, "one_shot")
    two = cc.all_reduce(x, cfg, "two_shot")
    out["all_reduce_one_shot"] = _rel(one, exact_sum)
    out["all_reduce_two_shot"] = _rel(two, exact_sum)
    out["all_reduce_plain"] = _rel(cc.all_reduce(x), exact_sum)
    # every rank must hold bit-identical all-reduce results
    for name, t in (("one", one), ("two", two)):
        ref = t.clone()
        dist.broadcast(ref, src=0)
        out[f"identical_{name}"] = bool(torch.equal(ref, t))
    out["x_untouched"] = bool(torch.equal(x, xs[rank]))
    return out


def odd_sizes(ctx) -> dict:
    """Sizes that are not multiples of G (padding) and an all-reduce whose numel is not a multiple of
    world * G; also bf16 inputs keep their dtype."""
    world, rank = ctx.world_size, ctx.rank
    cfg = QuantConfig(64, "e4m3")
    xs = _inputs(7, world, (world * 3, 37))
    x = xs[rank]
    exact_sum = sum(xs[1:], xs[0])
    res = {
        "all_gather": _rel(cc.all_gather(x, cfg), torch.cat(xs)),
        "reduce_scatter": _rel(cc.reduce_scatter(x, cfg), exact_sum.chunk(world)[rank]),
        "two_shot": _rel(cc.all_reduce(x, cfg, "two_shot"), exact_sum),
    }
    xb = x.bfloat16()
    yb = cc.all_reduce(xb, cfg, "one_shot")
    res["bf16_dtype"] = str(yb.dtype)
    res["bf16"] = _rel(yb, sum(t.bfloat16().float() for t in xs))
    return res


def compressed_all_reduce_auto(ctx, one_shot_max_bytes: int) -> list[float]:
    x = torch.ones(4, 256) * (ctx.rank + 1)
    cfg = QuantConfig(128, "e4m3")
    return cc.compressed_all_reduce(x, cfg, one_shot_max_bytes=one_shot_max_bytes).flatten()[:3].tolist()


def tp_pairs() -> tuple[dist.ProcessGroup, Any]:
    """On 4 ranks, two TP pairs {0, 1} and {2, 3}: this rank's pair as a ProcessGroup, and the
    (dp, tp) DeviceMesh whose "tp" dimension is the same pairs (collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != 4:
        raise ValueError(f"two TP pairs need 4 ranks, got {dist.get_world_size()}")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs[dist.get_rank() // 2], init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def tp_mlp_vs_reference(ctx, compression: str | None, seq: int = 8, batch: int = 2, hidden: int = 64,
                        ffn: int = 128, seed: int = 0, grad_compression: str | None = "same",
                        pairs: bool = False) -> dict:
    """A column -> GELU -> row MLP with sequence parallelism against the same MLP on one process:
    output and every gradient (input, weights, biases). `pairs`: TP over two pairs of 4 ranks (the
    mesh's "tp" dimension), each pair with its own data."""
    from commweave.taco.tp import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads

    group: Any = None
    if pairs:
        _, mesh = tp_pairs()
        group, seed = (mesh, "tp"), seed + 10 * (ctx.rank // 2)
    tp_group = resolve_group(group)
    world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    cfg = None if compression is None else QuantConfig(64, compression)
    grad_cfg = cfg if grad_compression == "same" else (None if grad_compression is None else QuantConfig(64, grad_compression))
    gen = torch.Generator().manual_seed(seed)
    x_full = torch.randn(seq, batch, hidden, generator=gen)
    w1 = torch.randn(ffn, hidden, generator=gen) / hidden ** 0.5
    b1 = torch.randn(ffn, generator=gen) * 0.1
    w2 = torch.randn(hidden, ffn, generator=gen) / ffn ** 0.5
    b2 = torch.randn(hidden, generator=gen) * 0.1
    probe = torch.randn(seq, batch, hidden, generator=gen)

    # single-process reference
    xr = x_full.clone().requires_grad_()
    w1r, b1r, w2r, b2r = (t.clone().requires_grad_() for t in (w1, b1, w2, b2))
    yr = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(xr, w1r, b1r)), w2r, b2r)
    (yr * probe).sum().backward()

    col = ColumnParallelLinear(hidden, ffn, bias=True, compression=cfg, grad_compression=grad_cfg, group=group)
    row = RowParallelLinear(ffn, hidden, bias=True, compression=cfg, grad_compression=grad_cfg, group=group)
    col.load_full_weight(w1, b1)
    row.load_full_weight(w2, b2)
    s = seq // world
    x = x_full[rank * s:(rank + 1) * s].clone().requires_grad_()
    y = row(torch.nn.functional.gelu(col(x)))
    (y * probe[rank * s:(rank + 1) * s]).sum().backward()
    allreduce_sequence_parallel_grads([col, row], group)

    f = ffn // world
    return {
        "out": _rel(y.detach(), yr.detach()[rank * s:(rank + 1) * s]),
        "grad_x": _rel(x.grad, xr.grad[rank * s:(rank + 1) * s]),
        "grad_w1": _rel(col.weight.grad, w1r.grad[rank * f:(rank + 1) * f]),
        "grad_b1": _rel(col.bias.grad, b1r.grad[rank * f:(rank + 1) * f]),
        "grad_w2": _rel(row.weight.grad, w2r.grad[:, rank * f:(rank + 1) * f]),
        "grad_b2": _rel(row.bias.grad, b2r.grad),
        "out_shape": list(y.shape),
    }


# -- device backend (commweave.taco.device): an in-process node for CPU tests, GPU jobs ------------

import threading  # noqa: E402
from collections import defaultdict  # noqa: E402

from commweave.taco.cuda import FusedBarrier  # noqa: E402
from commweave.taco.device import DeviceCollectives  # noqa: E402
from commweave.taco.quant import Compressed, ReferenceCodec  # noqa: E402
from rank_threads import run_rank_threads  # noqa: E402

#: a case: (op, QuantConfig kwargs, shape, dtype name, seed); op in all_gather, reduce_scatter,
#: one_shot, two_shot. Plain tuples so they travel to the workers.
Case = tuple[str, dict, tuple[int, ...], str, int]


def case_input(case: Case, world: int, rank: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Rank `rank`'s input for `case` (shape with "W" in dim 0 scaled by the world: see cases)."""
    _, _, shape, dtype, seed = case
    shape = tuple(world * s if i == 0 and case[0] == "reduce_scatter" else s for i, s in enumerate(shape))
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])  # columns of 1e-3..1e2
    flat = x.view(-1)
    flat[rank :: 97] = 0.0
    flat[rank :: 131] *= -0.0  # some signed zeros: the sums must keep them as the reference does
    return x.to(getattr(torch, dtype)).to(device)


def run_case(call: Callable[[str, torch.Tensor, QuantConfig], torch.Tensor], case: Case, world: int, rank: int,
             device: str | torch.device = "cpu") -> torch.Tensor:
    return call(case[0], case_input(case, world, rank, device), QuantConfig(**case[1]))


def reference_call(op: str, x: torch.Tensor, cfg: QuantConfig | None, group: Any = None) -> torch.Tensor:
    """The reference backend over `group` (default: the default process group; gloo on CPU, NCCL on CUDA)."""
    if op in ("one_shot", "two_shot"):
        return cc.all_reduce(x, cfg, op, group=group, backend="reference")
    return getattr(cc, op)(x, cfg, group=group, backend="reference")


def device_call(coll: Any) -> Callable[[str, torch.Tensor, QuantConfig], torch.Tensor]:
    def call(op: str, x: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
        if op in ("one_shot", "two_shot"):
            return coll.all_reduce(x, cfg, op)
        return getattr(coll, op)(x, cfg)
    return call


def reference_results(ctx, cases: list[Case]) -> list[torch.Tensor]:
    """This rank's reference-backend result for each case (the expectation of the device backend)."""
    return [run_case(reference_call, case, ctx.world_size, ctx.rank) for case in cases]


class FakeNode:
    """W ranks in one process (one thread each): every rank's buffers in one dict, a threading
    barrier, and a log of who wrote / read whose buffer in which barrier epoch and call, from which
    `hazards()` finds missing barriers whatever the threads' timing. On a CUDA `device` the buffers are that GPU's memory and a barrier first
    waits for the GPU (every rank's queued writes done before any rank queues a read)."""

    def __init__(self, world: int, device: str | torch.device = "cpu"):
        self.world = world
        self.device = torch.device(device)
        self._barrier = threading.Barrier(world)
        self._lock = threading.Lock()
        self.buffers: dict[tuple[int, Hashable], torch.Tensor] = {}
        self.allocations: dict[int, list[tuple[Hashable, int]]] = defaultdict(list)
        # (kind, actor, owner, key, barrier epoch, call: the actor's use count of key)
        self.events: list[tuple[str, int, int, Hashable, int, int]] = []

    def owner_of(self, t: torch.Tensor) -> tuple[int, Hashable]:
        ptr = t.data_ptr()
        with self._lock:
            for (rank, key), buf in self.buffers.items():
                if buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel():
                    return rank, key
        raise AssertionError("not a node buffer")

    def log(self, kind: str, transport: FakeTransport, t: torch.Tensor) -> None:
        owner, key = self.owner_of(t)
        with self._lock:
            self.events.append((kind, transport.rank, owner, key, transport.epoch, transport.uses[key]))

    def hazards(self) -> list[str]:
        """A peer reading a buffer in the barrier epoch its owner writes it (for another call: a
        rewrite race; for the same call: no barrier between write and read), or before any write."""
        writes: dict[tuple[int, Hashable], set[tuple[int, int]]] = defaultdict(set)
        for kind, _, owner, key, epoch, call in self.events:
            if kind == "write":
                writes[(owner, key)].add((epoch, call))
        found = []
        for kind, actor, owner, key, epoch, call in self.events:
            if kind == "read" and actor != owner:
                for w_epoch, w_call in writes[(owner, key)]:
                    if w_epoch == epoch:
                        found.append(f"rank {actor} reads rank {owner}'s {key} in epoch {epoch} (call {call}), when it "
                                     f"is written for call {w_call}{' with no barrier between' if w_call == call else ''}")
                if not any(w_epoch < epoch for w_epoch, _ in writes[(owner, key)]):
                    found.append(f"rank {actor} reads rank {owner}'s {key} in epoch {epoch}, before any write")
        return sorted(set(found))


class FakeTransport:
    """One simulated rank's view of a FakeNode (the Transport protocol)."""

    def __init__(self, node: FakeNode, rank: int):
        self.node, self.rank, self.world_size, self.device = node, rank, node.world, node.device
        self.captured = False  # set by a test: this rank's calls count as captured into a CUDA graph
        self.epoch = 0
        self.uses: dict[Hashable, int] = defaultdict(int)  # calls that took each buffer so far
        self._keys: dict[int, Hashable] = {}

    def buffer(self, key: Hashable, nbytes: int) -> torch.Tensor:
        self.uses[key] += 1
        node = self.node
        with node._lock:
            node.allocations[self.rank].append((key, nbytes))
            new = (self.rank, key) not in node.buffers
            if new:  # garbage, not zeros: reading unwritten bytes shows
                node.buffers[(self.rank, key)] = torch.full((nbytes,), 0x7F, dtype=torch.uint8, device=node.device)
            buf = node.buffers[(self.rank, key)]
        if new:  # collective, as a symmetric allocation: every rank's buffer exists after it (not a
            node._barrier.wait(timeout=60)  # barrier epoch: the hazard log does not count on it)
        self._keys[buf.data_ptr()] = key
        return buf

    def peer(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        with self.node._lock:
            return self.node.buffers[(rank, self._keys[buf.data_ptr()])]

    def barrier(self) -> None:
        self.epoch += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.node._barrier.wait(timeout=60)

    def capturing(self) -> bool:
        return self.captured

    def fused_barrier(self, epoch: int) -> FusedBarrier:
        """A token: the TracingCodec that receives it runs `barrier()` right before its reads."""
        return FusedBarrier(signal=(), wait=(), epoch=epoch)


class TracingCodec:
    """A codec that logs its writes and reads of node buffers (for FakeNode.hazards). With
    `fuse_barriers`, its reading calls take the collectives' FusedBarrier token and run the
    transport's barrier right before reading, as the CUDA kernels do at their start."""

    def __init__(self, codec: Any, transport: FakeTransport, fuse_barriers: bool = False):
        self.codec, self.t, self.fuses_barriers = codec, transport, fuse_barriers

    def _reads(self, parts: list[Compressed | torch.Tensor], barrier: FusedBarrier | None,
               skip: int | None = None) -> None:
        if barrier is not None:
            assert self.fuses_barriers, "a fused barrier handed to a codec that does not fuse them"
            self.t.barrier()
        for p, c in enumerate(parts):
            if isinstance(c, Compressed) and p != skip:
                self.t.node.log("read", self.t, c.payload)

    def compress_into(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                      skip: int | None = None, own_out: torch.Tensor | None = None) -> None:
        self.t.node.log("write", self.t, buf)
        self.codec.compress_into(x, cfg, buf, segments, skip, own_out=own_out)

    def gather_into(self, cs: list[Compressed], out: torch.Tensor, barrier: FusedBarrier | None = None,
                    skip: int | None = None) -> None:
        self._reads(cs, barrier, skip)
        self.codec.gather_into(cs, out, skip=skip)

    def sum_into(self, parts: list[Compressed | torch.Tensor], out: torch.Tensor,
                 barrier: FusedBarrier | None = None) -> None:
        self._reads(parts, barrier)
        self.codec.sum_into(parts, out)

    def sum_compress_into(self, parts: list[Compressed | torch.Tensor], dtype: torch.dtype, cfg: QuantConfig,
                          buf: torch.Tensor, barrier: FusedBarrier | None = None,
                          own_out: torch.Tensor | None = None) -> None:
        self._reads(parts, barrier)
        self.t.node.log("write", self.t, buf)
        self.codec.sum_compress_into(parts, dtype, cfg, buf, own_out=own_out)


def simulate(world: int, body: Callable[[DeviceCollectives, int], Any], double_buffer: bool = False,
             codec: Any = None, fuse_barriers: bool = False, device: str | torch.device = "cpu",
             trace: bool = True) -> tuple[list[Any], FakeNode]:
    """Run body(collectives, rank) for W simulated ranks in threads; their results and the node
    (`fuse_barriers`: the read barriers handed to the codec, see TracingCodec; `trace=False`: the
    codec itself, without the hazard log, e.g. the CUDA codec whose launches are replayed only
    unwrapped). An exception on one rank breaks the barrier (the others fail too) and is re-raised."""
    node = FakeNode(world, device)
    results: list[Any] = [None] * world

    def rank_main(rank: int) -> None:
        t = FakeTransport(node, rank)
        used = TracingCodec(codec or ReferenceCodec(), t, fuse_barriers) if trace else codec
        results[rank] = body(DeviceCollectives(t, used, double_buffer), rank)

    run_rank_threads(world, rank_main, node._barrier.abort)
    return results, node


def simulated_ranks_on_one_gpu(cases: list[Case], world: int, double_buffer: bool, passes: int = 2) -> list[dict]:
    """The CUDA codec's collectives for W ranks simulated as threads on this one GPU (FakeNode on
    CUDA: peers' buffers are this GPU's memory, barriers wait for the GPU and the other threads):
    the real kernels and the replayed launches at W > 1 without W GPUs. Each rank runs the cases
    `passes` times (later passes replay what the first recorded). Returns, per rank, each pass's
    results (on CPU) and how many layouts were replayable."""
    from commweave.taco.codec import CudaCodec

    gpu = torch.device("cuda", torch.cuda.current_device())  # with its index, as tensors have

    def body(coll: DeviceCollectives, rank: int) -> dict:
        runs = [[run_case(device_call(coll), c, world, rank, gpu).cpu() for c in cases] for _ in range(passes)]
        return {"passes": runs, "replayable": coll.replays.replayable()}

    results, _ = simulate(world, body, double_buffer, CudaCodec(), device=gpu, trace=False)
    return results


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (-0.0 != +0.0, unlike torch.equal, for floating-point dtypes)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}.get(a.dtype)
    if view is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def gaussian(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian rows of very different magnitudes (1e-6..1e3), an outlier, a zero stretch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    rows = x.view(-1, shape[-1])
    rows *= torch.logspace(-6, 3, rows.shape[0])[:, None]
    flat = x.view(-1)
    flat[flat.numel() // 3] = 5e4
    flat[-70:-3] = 0.0
    return x


def edge_inputs() -> torch.Tensor:
    """Each piece 2048 long (whole groups at every G): zeros, a constant, FP32 subnormals, 1e-30
    noise, huge outliers, values near FP32 max, zero groups next to normal ones."""
    n = 2048
    gen = torch.Generator().manual_seed(11)
    sub = torch.full((n,), 3e-42) * torch.sign(torch.randn(n, generator=gen))
    sub[::7] = 0.0
    outliers = torch.randn(n, generator=gen)
    outliers[5], outliers[700], outliers[1500] = 1e30, -1e30, 1e6
    near_max = torch.randn(n, generator=gen)
    near_max[3], near_max[900] = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max / 2
    mixed = torch.randn(n, generator=gen)
    mixed[:512] = 0.0
    mixed[600] = -0.0
    return torch.cat([torch.zeros(n), torch.full((n,), -3.25), sub, torch.randn(n, generator=gen) * 1e-30, outliers,
                      near_max, mixed])


def device_vs_reference_gpu(ctx, cases: list[Case], double_buffer: bool = False, fuse_barriers: bool = False) -> dict:
    """On CUDA: the device backend (read barriers performed by the reading kernels with
    `fuse_barriers`) against the reference backend over NCCL (bit for bit), against the CPU
    simulation with the reference codec (bit for bit), and, where every rank gets the whole result
    (all-gather, all-reduce), identical across ranks."""
    from commweave.taco.device import DeviceBackend

    world, rank = ctx.world_size, ctx.rank
    backend = DeviceBackend(ctx, double_buffer=double_buffer, fuse_barriers=fuse_barriers)
    sim, _ = simulate(world, lambda coll, r: [run_case(device_call(coll), c, world, r) for c in cases])
    out: dict[str, Any] = {"mismatches": [], "cases": len(cases)}
    for i, case in enumerate(cases):
        dev = run_case(device_call(backend), case, world, rank, ctx.device)
        ref = run_case(reference_call, case, world, rank, ctx.device)
        torch.cuda.synchronize()
        first = dev.clone()
        dist.broadcast(first, src=0)
        replicated = case[0] != "reduce_scatter"  # a reduce-scatter leaves each rank its own shard
        for what, ok, other in (("reference over NCCL", same_bits(dev, ref), ref),
                                ("CPU simulation", same_bits(dev.cpu(), sim[rank][i]), sim[rank][i].to(dev.device)),
                                ("rank 0", same_bits(dev, first) or not replicated, first)):
            if not ok:
                diff = float((dev.float() - other.float()).abs().max()) if dev.shape == other.shape else float("nan")
                out["mismatches"].append(f"case {i} {case}: differs from {what} (max |diff| {diff:.3g})")
    backend.close()
    ctx.end_candidate()
    return out


def device_in_cuda_graph_gpu(ctx, cases: list[Case], fuse_barriers: bool = False) -> dict:
    """The device backend captured in a CUDA graph, as a model whose step is captured calls it (the
    shapes fixed, the inputs copied into static tensors): per case, eager calls first, then one
    capture on torch's capture stream, then replays with fresh inputs, each equal to the reference
    backend over NCCL bit for bit (with fused barriers, the captured calls queue barrier kernels)."""
    from commweave.taco.device import DeviceBackend

    world, rank = ctx.world_size, ctx.rank
    backend = DeviceBackend(ctx, fuse_barriers=fuse_barriers)
    call = device_call(backend)
    out: dict[str, Any] = {"mismatches": [], "replays": 0}
    for i, case in enumerate(cases):
        cfg = QuantConfig(**case[1])
        static = case_input(case, world, rank, ctx.device)
        for _ in range(3):  # eager first: buffers allocated, launches recorded, as a warm-up would
            call(case[0], static, cfg)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = call(case[0], static, cfg)
        for seed in range(3):  # new data each replay (every rank alike: a collective)
            fresh = (case[0], case[1], case[2], case[3], case[4] * 100 + seed + 1)
            static.copy_(case_input(fresh, world, rank, ctx.device))
            graph.replay()
            ref = run_case(reference_call, fresh, world, rank, ctx.device)
            torch.cuda.synchronize()
            out["replays"] += 1
            if not same_bits(result, ref):
                diff = float((result.float() - ref.float()).abs().max()) if result.shape == ref.shape else float("nan")
                out["mismatches"].append(f"case {i} {case} replay {seed}: differs from the reference (max |diff| {diff:.3g})")
        del graph
    fresh_layout = case_input(cases[0], world, rank, ctx.device)[:1]  # a shape no call has had
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            call(cases[0][0], fresh_layout, QuantConfig(**cases[0][1]))
        out["fresh_layout_refused"] = False
    except ValueError as e:
        out["fresh_layout_refused"] = "before capturing" in str(e)
    backend.close()
    ctx.end_candidate()
    return out


def tp_mlp_in_cuda_graph_gpu(ctx, seq: int = 64, batch: int = 2, hidden: int = 256, ffn: int = 512) -> dict:
    """A column -> GELU -> row MLP (sequence parallel, TACO on both collectives and their backward
    mirrors, device backend, bf16) whose forward and backward are captured in one CUDA graph after
    eager warm-up steps, as a captured training step would: each replay with fresh inputs gives the
    output and gradients an eager step gives on the same inputs (same kernels: bit for bit)."""
    from commweave.taco.device import DeviceBackend
    from commweave.taco.tp import ColumnParallelLinear, RowParallelLinear

    world, rank, dev = ctx.world_size, ctx.rank, ctx.device
    cc.register_backend("device", DeviceBackend(ctx=ctx))
    cfg = QuantConfig()
    torch.manual_seed(0)  # the same full weights on every rank
    col = ColumnParallelLinear(hidden, ffn, compression=cfg, backend="device", dtype=torch.bfloat16, device=dev)
    row = RowParallelLinear(ffn, hidden, compression=cfg, backend="device", dtype=torch.bfloat16, device=dev)
    params = [*col.parameters(), *row.parameters()]

    def step(x: torch.Tensor, probe: torch.Tensor) -> list[torch.Tensor]:
        y = row(torch.nn.functional.gelu(col(x)))
        return [y.detach(), *torch.autograd.grad((y.float() * probe).sum(), [x, *params])]

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * world + rank)
        x = torch.randn(seq // world, batch, hidden, generator=gen).to(dev, torch.bfloat16)
        return x, torch.randn(seq // world, batch, hidden, generator=gen).to(dev)

    static_x, static_probe = inputs(0)
    static_x.requires_grad_()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # eager warm-up, on a side stream as torch's capture recipe does
        for _ in range(3):
            step(static_x, static_probe)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static_x, static_probe)
    out: dict[str, Any] = {"mismatches": [], "replays": 0}
    for seed in range(1, 4):
        x, probe = inputs(seed)
        with torch.no_grad():
            static_x.copy_(x)
            static_probe.copy_(probe)
        graph.replay()
        eager = step(x.requires_grad_(), probe)
        torch.cuda.synchronize(dev)
        out["replays"] += 1
        for name, got, want in zip(["out", "grad_x", *[f"param{i}" for i in range(len(params))]], captured, eager):
            if not same_bits(got, want):
                out["mismatches"].append(f"replay {seed}: {name} differs (max |diff| "
                                         f"{float((got.float() - want.float()).abs().max()):.3g})")
    del graph
    cc._backend("device").close()
    ctx.end_candidate()
    return out


class SerializedCodec:
    """A codec whose calls run one at a time across the simulated ranks' threads (Triton's
    interpreter patches triton.language while it runs a kernel: not thread-safe)."""

    _lock = threading.Lock()
    fuses_barriers = False

    def __init__(self, codec: Any):
        self.codec = codec

    def compress_into(self, x: torch.Tensor, cfg: QuantConfig, buf: torch.Tensor, segments: int = 1,
                      skip: int | None = None, own_out: torch.Tensor | None = None) -> None:
        with self._lock:
            self.codec.compress_into(x, cfg, buf, segments, skip, own_out=own_out)

    def gather_into(self, cs: list[Compressed], out: torch.Tensor, barrier: None = None, skip: int | None = None) -> None:
        with self._lock:
            self.codec.gather_into(cs, out, barrier, skip)

    def sum_into(self, parts: list[Compressed | torch.Tensor], out: torch.Tensor, barrier: None = None) -> None:
        with self._lock:
            self.codec.sum_into(parts, out, barrier)

    def sum_compress_into(self, parts: list[Compressed | torch.Tensor], dtype: torch.dtype, cfg: QuantConfig,
                          buf: torch.Tensor, barrier: None = None, own_out: torch.Tensor | None = None) -> None:
        with self._lock:
            self.codec.sum_compress_into(parts, dtype, cfg, buf, barrier, own_out)


def kernel_codec_vs_reference_codec(world: int, cases: list[Case]) -> list[str]:
    """In a process whose Triton interprets (TRITON_INTERPRET=1): the algorithms with the Triton
    kernels (TritonCodec, interpreted) against the same with the reference codec; mismatches."""
    from commweave.taco.codec import TritonCodec

    def body(coll, r):
        return [run_case(device_call(coll), c, world, r) for c in cases]

    kernel, _ = simulate(world, body, codec=SerializedCodec(TritonCodec()))
    ref, _ = simulate(world, body)
    return [f"rank {r} case {i} {c}" for r in range(world) for i, c in enumerate(cases)
            if not same_bits(kernel[r][i], ref[r][i])]


def selecting_backend_vs_direct(ctx) -> dict:
    """Backend "auto" over gloo (the host reference as its compressed backend): each call equals the
    compressed reference result where the selector chose compression (and the algorithm it chose),
    the plain torch result elsewhere."""
    from commweave.taco.selector import Selector, use_measurements

    world, rank = ctx.world_size, ctx.rank
    mib = 1 << 20
    rows = [{"op": "all_gather", "mib": 0.004, "world": world, "cuda_speedup": 1.3},
            {"op": "reduce_scatter", "mib": 0.004, "world": world, "cuda_speedup": 0.8},
            {"op": "all_reduce_one_shot", "mib": 0.004, "world": world, "cuda_speedup": 1.2},
            {"op": "all_reduce_two_shot", "mib": 0.004, "world": world, "cuda_speedup": 1.1},
            {"op": "all_reduce_one_shot", "mib": 0.01, "world": world, "cuda_speedup": 1.1},
            {"op": "all_reduce_two_shot", "mib": 0.01, "world": world, "cuda_speedup": 1.4}]
    use_measurements(Selector.from_rows(rows), compressed="reference")
    cfg = QuantConfig()
    out = {}
    small = _inputs(5, world, (1, 128))[rank]  # 512 B of FP32 per rank: below every measured size
    x = _inputs(6, world, (8, 512))[rank]  # 16 KiB: all-reduce two-shot, all-gather compressed
    assert x.numel() * 4 >= 0.01 * mib and small.numel() * 4 * world < 0.004 * mib
    out["ag"] = torch.equal(cc.all_gather(x, cfg, backend="auto"), cc.all_gather(x, cfg, backend="reference"))
    out["ag_compressed"] = not torch.equal(cc.all_gather(x, cfg, backend="auto"), cc.all_gather(x))
    out["ag_small_plain"] = torch.equal(cc.all_gather(small, cfg, backend="auto"), cc.all_gather(small))
    out["rs_plain"] = torch.equal(cc.reduce_scatter(x, cfg, backend="auto"), cc.reduce_scatter(x))
    out["ar_two_shot"] = torch.equal(cc.all_reduce(x, cfg, "one_shot", backend="auto"),
                                     cc.all_reduce(x, cfg, "two_shot", backend="reference"))
    out["ar_small_plain"] = torch.equal(cc.all_reduce(small, cfg, backend="auto"), cc.all_reduce(small))
    return out


def subgroups_vs_pair_simulation(ctx, cases: list[Case]) -> list[str]:
    """On 4 ranks, each case over this rank's TP pair, named as a ProcessGroup, as (mesh, "tp") and
    as the mesh's one-dimensional "tp" submesh: bit for bit what 2 simulated ranks compute for the
    pair's inputs (the device algorithms with the reference codec, which equal the reference backend
    on 2 ranks); the plain collectives over the pair alike. Each pair has its own inputs. Mismatches."""
    import functools

    pair_group, mesh = tp_pairs()
    pair, r = ctx.rank // 2, ctx.rank % 2
    mine = [(op, kw, shape, dtype, seed + 100 * pair) for op, kw, shape, dtype, seed in cases]
    sim, _ = simulate(2, lambda coll, rr: [run_case(device_call(coll), c, 2, rr) for c in mine])
    found = []
    for name, group in (("ProcessGroup", pair_group), ("(mesh, 'tp')", (mesh, "tp")), ("mesh['tp']", mesh["tp"])):
        call = functools.partial(reference_call, group=group)
        for i, c in enumerate(mine):
            if not same_bits(run_case(call, c, 2, r), sim[r][i]):
                found.append(f"{name}: case {i} {c}")
        xs = [case_input(mine[0], 2, p) for p in range(2)]
        if not torch.equal(cc.all_gather(xs[r], None, group), torch.cat(xs)):
            found.append(f"{name}: plain all_gather")
        if not torch.equal(cc.all_reduce(xs[r], None, group=group), xs[0] + xs[1]):
            found.append(f"{name}: plain all_reduce")
    return found
