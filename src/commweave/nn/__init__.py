"""Tensor-parallel layers over commweave's ops (Megatron-style, sequence-parallel layout).

    up = ColumnParallelLinear(hidden, ffn, group=tp)     # [T/W, hidden] -> [T, ffn/W]
    down = RowParallelLinear(ffn, hidden, group=tp)      # [T, ffn/W]    -> [T/W, hidden]
    y = down(F.gelu(up(x)))                              # an MLP block; backward included
"""

from commweave.nn.attention import ContextParallelAttention
from commweave.nn.linear import ColumnParallelLinear, RowParallelLinear
from commweave.nn.moe import ExpertParallelMoE  # expert-parallel MoE layer (nn/moe.py)

__all__ = ["ColumnParallelLinear", "ContextParallelAttention", "ExpertParallelMoE", "RowParallelLinear"]
