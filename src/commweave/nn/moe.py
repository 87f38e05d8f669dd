"""An expert-parallel MoE layer a model can drop in: this rank's routed experts as parameters,
tokens dispatched to their experts' ranks and combined back by `commweave.ops.moe_layer`.

    moe = ExpertParallelMoE(hidden=7168, inter=2048, experts=256, group=ep)   # E/W experts here
    out = moe(x, topk_idx, topk_weights)                                      # [T, H]; backward included

The router stays the model's: routers differ from model to model (DeepSeek-V3's group-limited
sigmoid gate with a bias, Mixtral's softmax top-2, capacity or auxiliary-loss variants), their
weights are replicated rather than expert-parallel, and topk_weights carries the router's gradient
back to it. So the layer takes the routing as inputs: topk_idx [T, k] int64 global expert ids,
topk_weights [T, k] float32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from commweave.ops.groups import GroupLike, group_name, group_rank, group_size
from commweave.ops.library import moe_forward
from commweave.ops.runner import ProgramSpec


class ExpertParallelMoE(nn.Module):
    """Routed SwiGLU experts, expert parallel over `group`: rank r holds experts r*E/W ... (r+1)*E/W - 1,
    w13 [E/W, 2I, H] (gate rows, then up rows) and w2 [E/W, H, I]. forward(x [T, H], topk_idx,
    topk_weights) -> [T, H], collective over the group (T equal on every rank). With inputs that
    need a gradient (training) it runs the host all-to-all exchange and has a backward; under
    torch.no_grad() it runs `program` (None: the workload's seed, its host baseline on CPU)."""

    def __init__(self, hidden: int, inter: int, experts: int, group: GroupLike = None, program: ProgramSpec = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.group = group_name(group)
        self.world_size, self.rank = group_size(self.group), group_rank(self.group)
        for name, value in (("hidden", hidden), ("inter", inter), ("experts", experts)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        if experts % self.world_size:
            raise ValueError(f"experts={experts} is not divisible by the group's {self.world_size} ranks")
        self.hidden, self.inter, self.experts = hidden, inter, experts
        self.program = None if program is None else str(program)
        local = experts // self.world_size
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter, device=device, dtype=dtype))
        for weight, fan_in in ((self.w13, hidden), (self.w2, inter)):  # nn.Linear's default bound
            nn.init.uniform_(weight, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts."""
        per_rank = self.experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @torch.no_grad()
    def load_full(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Copy this rank's experts out of every expert's weights: w13 [E, 2I, H], w2 [E, H, I]."""
        want = ((self.experts, 2 * self.inter, self.hidden), (self.experts, self.hidden, self.inter))
        if (tuple(w13.shape), tuple(w2.shape)) != want:
            raise ValueError(f"full weights are w13 {list(want[0])} and w2 {list(want[1])}, got {list(w13.shape)} "
                             f"and {list(w2.shape)}")
        mine = slice(self.local_experts.start, self.local_experts.stop)
        self.w13.copy_(w13[mine])
        self.w2.copy_(w2[mine])

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return moe_forward(x, topk_idx, topk_weights, self.w13, self.w2, self.group, self.program)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, inter={self.inter}, experts={self.experts}, group={self.group!r} "
                f"(rank {self.rank} of {self.world_size}: experts {self.local_experts.start}..{self.local_experts.stop - 1})")
