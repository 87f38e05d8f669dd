"""DeepSeek-V3 MoE layer with expert parallelism: dispatch, routed experts, combine (bf16).

Each of W ranks holds T tokens x [T, H] and the routed experts [r*E/W, (r+1)*E/W) (SwiGLU:
y = (silu(x @ w1^T) * (x @ w3^T)) @ w2^T). Every token goes to its top-k experts wherever they
live, and comes back as out[t] = sum_k weight[t, k] * expert_{idx[t, k]}(x[t]). The routing
(`topk_idx`, `topk_weights`) is part of the inputs, computed in `make_inputs` by
`routing.gate_route` (DeepSeek-V3's group-limited gate on the random hidden states) or, for a
skewed shape, by `routing.skewed_route`, so every program is timed on identical routings and a
skewed load can be imposed. Shared experts and the gate GEMM are not part of the timed layer.

Shapes: 'dsv3-T<tokens per rank>[-skew<ratio>]' (DeepSeek-V3: H 7168, I 2048, 256 experts,
top-8, 8 groups, top-4 groups) or 'T<t>-H<h>-I<i>-E<e>-k<k>-g<g>-tg<tg>[-skew<ratio>]'. CPU checks
use the same routing structure (top-8, 8 groups, top-4 groups) with H, I and E scaled down.

At W = 1 every expert is local and nothing is exchanged: the compute side alone. DeepSeek-V3's
256 experts with every program's buffers do not fit one H200, so one GPU's bench shape holds the
experts one GPU holds on 4 (`ONE_GPU_EXPERTS`, E 64) at the decode size (T 128; T 4096 ran out of
memory there too).

Expert weights are drawn per (seed, expert id) from their own generator, so any rank can
regenerate any expert: the reference loops over experts and never holds more than one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from commweave.contracts.workload import (LOSSY_TOLERANCE, Cost, Shape, Workload, checked_tensor, input_names,
                                      seeded_generator)
from commweave.workloads.moe import routing, training

DSV3 = dict(H=7168, I=2048, E=256, K=8, G=8, TG=4)
DSV3_TOKENS = (128, 4096)  # decode, prefill (tokens per rank)
ONE_GPU_EXPERTS = DSV3["E"] // 4  # W = 1: the experts one GPU holds on 4 (all 256 do not fit one H200)
SKEW_RATIOS = (2, 3, 4, 5)
_DSV3 = re.compile(r"^\s*dsv3-T(-?\d+)(?:-skew(-?\d+))?\s*$")
_GENERIC = re.compile(r"^\s*T(-?\d+)-H(-?\d+)-I(-?\d+)-E(-?\d+)-k(-?\d+)-g(-?\d+)-tg(-?\d+)(?:-skew(-?\d+))?\s*$")


class MoELayer(Workload):
    name = "moe"
    op_inputs = ("x", "topk_idx", "topk_weights", "w13", "w2")  # what a caller passes to the op
    summary = "DeepSeek-V3 MoE layer, expert parallel: dispatch, SwiGLU experts, combine (bf16)"
    dtype = torch.bfloat16
    world_sizes = (1, 2, 4)
    baselines = ("host", "host_padded")
    seed = "seed"
    #: the seed's dispatch and combine alone (no expert computation; not a correct program): with
    #: `cost().comm_bytes` it gives the exchange's bandwidth, which the issue compares with a peer copy;
    #: `train_host`: the host program's training step, timed beside the forward
    yardsticks = {"exchange": ("seed", {"experts": "none"}),
                  # a training step (forward + backward) of commweave.ops.moe_layer's training path
                  "train_host": ("host", {"train": True})}
    comm_yardsticks = ("exchange",)

    # -- shapes ---------------------------------------------------------------------------------
    def make_shape(self, world_size: int, T: int, H: int, I: int, E: int, K: int, G: int, TG: int,
                   skew: int = 0, label: str | None = None) -> Shape:
        """A validated shape; skew 0 means routing by the gate, >= 2 an imposed imbalance ratio."""
        self.check_world_size(world_size)
        for dim, value in (("T", T), ("H", H), ("I", I), ("E", E), ("k", K), ("g", G), ("tg", TG)):
            if value <= 0:
                raise ValueError(f"{dim} must be positive, got {value}")
        if H % 8 or I % 8:
            raise ValueError(f"H={H} and I={I} must be multiples of 8 (rows of 16 bytes for the copies and grouped GEMMs)")
        if E % world_size:
            raise ValueError(f"E={E} experts cannot be split evenly over {world_size} ranks")
        routing.check_routing_params(E, K, G, TG)
        if skew == 1 or skew < 0:
            raise ValueError(f"skew must be 0 (gate routing) or an imbalance ratio >= 2, got {skew}")
        if skew and E // world_size < K:
            raise ValueError(f"skewed routing needs at least top-k ({K}) experts per rank, E/W = {E // world_size}")
        if label is None:
            label = f"T{T}-H{H}-I{I}-E{E}-k{K}-g{G}-tg{TG}" + (f"-skew{skew}" if skew else "")
        return Shape(label, {"T": T, "H": H, "I": I, "E": E, "K": K, "G": G, "TG": TG, "skew": skew})

    def dsv3_shape(self, tokens: int, world_size: int, skew: int = 0) -> Shape:
        label = f"dsv3-T{tokens}" + (f"-skew{skew}" if skew else "")
        return self.make_shape(world_size, tokens, **DSV3, skew=skew, label=label)

    def bench_shapes(self, world_size: int) -> list[Shape]:
        if world_size == 1:
            return [self.make_shape(1, DSV3_TOKENS[0], **{**DSV3, "E": ONE_GPU_EXPERTS})]
        shapes = [self.dsv3_shape(t, world_size) for t in DSV3_TOKENS]
        return shapes + [self.dsv3_shape(4096, world_size, r) for r in SKEW_RATIOS]

    def check_shapes(self, world_size: int) -> list[Shape]:
        # Scaled down: same routing structure (top-8 of 8 groups, top-4 groups); H 7168 -> 136,
        # I 2048 -> 40, E 256 -> 32 (8 experts per rank on 4 GPUs). T=67, H=136, I=40 fit no
        # 16-row or 16-column tile; the third shape imposes a 3:1 imbalance.
        return [
            self.make_shape(world_size, 67, 136, 40, 32, 8, 8, 4),
            self.make_shape(world_size, 128, 256, 64, 64, 8, 8, 4),
            self.make_shape(world_size, 64, 128, 48, 32, 8, 8, 4, skew=3),
        ]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        m = _DSV3.match(text)
        if m:
            return self.dsv3_shape(int(m.group(1)), world_size, int(m.group(2) or 0))
        m = _GENERIC.match(text)
        if not m:
            raise ValueError(f"shape {text!r} is not 'dsv3-T<tokens>[-skew<r>]' or "
                             "'T<t>-H<h>-I<i>-E<e>-k<k>-g<g>-tg<tg>[-skew<r>]'")
        t, h, i, e, k, g, tg = (int(x) for x in m.groups()[:7])
        return self.make_shape(world_size, t, h, i, e, k, g, tg, skew=int(m.group(8) or 0))

    # -- data -----------------------------------------------------------------------------------
    def gate(self, shape: Shape, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's weights [E, H] (fp32) and score-correction bias [E], shared by all ranks."""
        gen = seeded_generator(device, seed, 1)
        gate_w = torch.randn(shape["E"], shape["H"], generator=gen, device=device) / math.sqrt(shape["H"])
        bias = 0.01 * torch.randn(shape["E"], generator=gen, device=device)
        return gate_w, bias

    def expert_weights(self, shape: Shape, seed: int, expert: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s w13 [2I, H] (gate rows then up rows) and w2 [H, I], bf16."""
        gen = seeded_generator(device, seed, 2, expert)
        h, i = shape["H"], shape["I"]
        w13 = torch.randn(2 * i, h, generator=gen, device=device) / math.sqrt(h)
        w2 = torch.randn(h, i, generator=gen, device=device) / math.sqrt(i)
        return w13.to(self.dtype), w2.to(self.dtype)

    def tokens_and_routing(self, shape: Shape, world_size: int, rank: int, seed: int,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = seeded_generator(device, seed, 3, world_size, rank)
        x = torch.randn(shape["T"], shape["H"], generator=gen, device=device).to(self.dtype)
        if shape["skew"]:
            idx, w = routing.skewed_route(shape["T"], shape["E"], shape["K"], world_size, shape["skew"], gen, device)
        else:
            gate_w, bias = self.gate(shape, seed, device)
            idx, w = routing.gate_route(x, gate_w, bias, shape["K"], shape["G"], shape["TG"])
        return x, idx, w

    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        x, idx, w = self.tokens_and_routing(shape, world_size, rank, seed, device)
        per_rank = shape["E"] // world_size
        weights = [self.expert_weights(shape, seed, rank * per_rank + e, device) for e in range(per_rank)]
        return {
            "x": x,
            "topk_idx": idx,  # [T, K] int64, global expert ids
            "topk_weights": w,  # [T, K] float32
            "w13": torch.stack([a for a, _ in weights]),  # [E/W, 2I, H] bf16
            "w2": torch.stack([b for _, b in weights]),  # [E/W, H, I] bf16
        }

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(shape["T"], shape["H"], dtype=self.dtype, device=device)

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        """Every token's weighted sum over its experts, in fp32, one expert at a time."""
        x, idx, w = self.tokens_and_routing(shape, world_size, rank, seed, device)
        xf = x.float()
        out = torch.zeros(shape["T"], shape["H"], dtype=torch.float32, device=device)
        for e in torch.unique(idx).tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            w13, w2 = (t.float() for t in self.expert_weights(shape, seed, e, device))
            gate_up = xf[tok] @ w13.t()
            h = F.silu(gate_up[:, :shape["I"]]) * gate_up[:, shape["I"]:]
            out.index_add_(0, tok, (h @ w2.t()) * w[tok, slot].unsqueeze(1))
        return out

    # -- cost -----------------------------------------------------------------------------------
    def cost(self, shape: Shape, world_size: int) -> Cost:
        """Per-rank lower bounds, each the largest over ranks (an iteration lasts as long as its
        slowest rank): expert FLOPs and weight reads of the most loaded rank, bytes it receives
        (dispatched rows from peers + its tokens' results from peers)."""
        t, h, i, e, k, w = shape["T"], shape["H"], shape["I"], shape["E"], shape["K"], world_size
        item = torch.empty((), dtype=self.dtype).element_size()
        shares = routing.rank_shares(w, shape["skew"] or 1)
        pairs_in = [w * t * k * s for s in shares]  # rows each rank's experts process
        flops = max(2.0 * p * 3 * h * i for p in pairs_in)
        # dispatch: rows from the W-1 other sources; combine: this rank's rows computed elsewhere
        comm = max(p * (w - 1) / w * h * item + t * k * (1 - s) * h * item for p, s in zip(pairs_in, shares))
        per_rank = e // w
        used = [min(per_rank, p) for p in pairs_in]  # experts that can be used at most
        memory = max(u * 3 * h * i * item + 4 * p * h * item + 2 * t * h * item for u, p in zip(used, pairs_in))
        return Cost(flops=flops, comm_bytes=comm, memory_bytes=memory, wire_ratio=self.wire_ratio(h, item))

    def template(self):
        from commweave.workloads.moe.template import MoETemplate

        return MoETemplate(self)

    # -- calls on a user's tensors (commweave.ops) ---------------------------------------------
    def single_rank(self, inputs: Mapping[str, torch.Tensor | None], out: torch.Tensor | None = None,
                    **options: Any) -> torch.Tensor:
        """Every expert is local: rows sorted by expert, two grouped GEMMs (no host synchronization,
        so a caller's CUDA graph can hold it), the weighted sum back per token."""
        self.check_local_inputs(inputs)
        x, idx, weights, w13, w2 = (inputs[n] for n in ("x", "topk_idx", "topk_weights", "w13", "w2"))
        tokens, top_k = idx.shape
        experts, inter = w13.shape[0], w13.shape[1] // 2
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        ends = counts.cumsum(0).to(torch.int32)
        rows = x.index_select(0, order // top_k)
        gate_up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=ends)
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        results = torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends)
        per_pair = torch.empty_like(results).index_copy_(0, order, results)
        summed = (per_pair.view(tokens, top_k, -1).float() * weights.unsqueeze(-1)).sum(1)
        return summed.to(x.dtype)

    # -- training (commweave.ops.moe_layer where a gradient is needed): workloads/moe/training.py --
    def train_forward(self, inputs: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(out, saved) over `group` (None: one rank), inputs as `shape_from_inputs` checks them."""
        if group is None:
            self.check_local_inputs(inputs)
        else:
            self.shape_from_inputs(inputs, group.size(), dist.get_rank(group))
        out, saved = training.forward(*(inputs[n] for n in self.op_inputs), group)
        return out, saved.as_tuple()

    def train_backward(self, grad: torch.Tensor, inputs: Mapping[str, torch.Tensor], saved: tuple[torch.Tensor, ...],
                       group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
        """(grad_x, grad_topk_weights, grad_w13, grad_w2) from the output's gradient and `saved`."""
        return training.backward(grad, inputs["topk_idx"], inputs["topk_weights"], inputs["w13"], inputs["w2"],
                                 training.Saved(*saved), group)

    @staticmethod
    def check_local_inputs(inputs: Mapping[str, torch.Tensor | None]) -> None:
        """A ValueError unless the tensors fit one rank holding every expert (any float dtype)."""
        x, idx, weights, w13, w2 = (inputs[n] for n in ("x", "topk_idx", "topk_weights", "w13", "w2"))
        if idx.dim() != 2 or w13.dim() != 3:
            raise ValueError(f"topk_idx [T, k] and w13 [E, 2I, H] expected, got {tuple(idx.shape)}, {tuple(w13.shape)}")
        tokens, top_k = idx.shape
        experts, inter = w13.shape[0], w13.shape[1] // 2
        if x.dim() != 2 or w13.shape[2] != x.shape[1] or tuple(w2.shape) != (experts, x.shape[1], inter):
            raise ValueError(f"x [T, H], w13 [E, 2I, H] and w2 [E, H, I] expected, got {tuple(x.shape)}, "
                             f"{tuple(w13.shape)}, {tuple(w2.shape)}")
        if tuple(weights.shape) != (tokens, top_k) or x.shape[0] != tokens:
            raise ValueError(f"topk_idx {tuple(idx.shape)} and topk_weights {tuple(weights.shape)} must both be [T, k] "
                             f"with T = {x.shape[0]}")

    def shape_from_inputs(self, inputs: Mapping[str, torch.Tensor], world_size: int, rank: int,
                          out: torch.Tensor | None = None) -> Shape:
        """x [T, H] bf16, topk_idx [T, k] int64 (global expert ids), topk_weights [T, k] float32,
        w13 [E/W, 2I, H] and w2 [E/W, H, I] bf16 (this rank's experts), one device; T equal on
        every rank. The routing is given, so the shape claims no group limit (g1, tg1)."""
        input_names(inputs, ("x", "topk_idx", "topk_weights", "w13", "w2"))
        x = checked_tensor("x", inputs["x"], 2, self.dtype)
        idx = checked_tensor("topk_idx", inputs["topk_idx"], 2, torch.int64, x.device)
        weights = checked_tensor("topk_weights", inputs["topk_weights"], 2, torch.float32, x.device)
        w13 = checked_tensor("w13", inputs["w13"], 3, self.dtype, x.device)
        w2 = checked_tensor("w2", inputs["w2"], 3, self.dtype, x.device)
        tokens, hidden = x.shape
        if idx.shape[0] != tokens or weights.shape != idx.shape:
            raise ValueError(f"topk_idx {tuple(idx.shape)} and topk_weights {tuple(weights.shape)} must both be "
                             f"[T, k] with T = {tokens} (x's rows)")
        per_rank, two_i, w13_hidden = w13.shape
        if two_i % 2 or w13_hidden != hidden:
            raise ValueError(f"w13 must be [E/W, 2I, H] (gate rows, then up rows) with H = {hidden}, got {tuple(w13.shape)}")
        if tuple(w2.shape) != (per_rank, hidden, two_i // 2):
            raise ValueError(f"w2 must be [E/W, H, I] = {(per_rank, hidden, two_i // 2)} (from w13 and x), got {tuple(w2.shape)}")
        return self.make_shape(world_size, tokens, hidden, two_i // 2, per_rank * world_size, idx.shape[1], 1, 1)


class MoELayerLossy(MoELayer):
    """The same layer for a caller who accepts FP8 dispatch (DeepSeek-V3 and DeepEP dispatch FP8
    tokens with one scale per 128 values): a declared tolerance of 4 % relative error, so the design
    space admits E4M3 compression of the dispatched rows (the seed's CONFIG `compression`). Every
    program of moe runs unchanged; the search may now pick the compressed dispatch."""

    name = "moe-lossy"
    summary = "moe accepting 4% relative error: FP8 E4M3 dispatch of the tokens admitted"

    def tolerance(self) -> float:
        return LOSSY_TOLERANCE
