"""A context-parallel attention layer a model can drop in where it calls SDPA.

Each rank of the group holds its tokens of every sequence (context parallelism): q [B, S/W, Hq, D],
k and v [B, S/W, Hkv, D], sequence-major, in the layer's `layout`; the layer returns the
attention of those queries over the whole sequence, like q, with a backward (dq here, dk and dv
summed over every rank's queries). Over one rank it is SDPA on [B, H, S, D] views.
"""

from __future__ import annotations

import torch
from torch import nn

from commweave.ops.functions import layout_is_zigzag, local_attention, sharded_attention
from commweave.ops.groups import GroupLike, group_name, group_size


class ContextParallelAttention(nn.Module):
    """softmax(q k^T / sqrt(D) [+ causal mask]) v over the sequence sharded across `group`.

    causal: the causal mask by global position. layout: 'zigzag' (rank r holds chunks r and 2W-1-r
    of 2W: balanced causal work; the default when causal) or 'contiguous' (block r of W; the
    default otherwise). forward(q, k, v) -> out; shapes in the module's docstring.
    """

    def __init__(self, causal: bool = False, layout: str | None = None, group: GroupLike = None):
        super().__init__()
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, not {causal!r}")
        self.causal = causal
        self.zigzag = layout_is_zigzag(layout, causal)
        self.layout = "zigzag" if self.zigzag else "contiguous"
        self.group = group_name(group)
        self.world_size = group_size(self.group)  # read here: dynamo does not trace a group lookup

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return local_attention(q, k, v, self.causal)
        return sharded_attention(q, k, v, self.causal, self.zigzag, self.group)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, layout={self.layout!r}, group={self.group!r} (W={self.world_size})"
