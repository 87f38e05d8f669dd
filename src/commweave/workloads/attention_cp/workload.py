"""Attention with context parallelism (forward, bf16, batch 1): the sequence sharded over W GPUs.

Rank r holds the queries, keys and values of its tokens, `inputs["q"]` [S/W, Hq, D] and
`inputs["k"]`, `inputs["v"]` [S/W, Hkv, D] (sequence-major), and must produce `out` [S/W, Hq, D]:
the attention of its queries over the keys and values of the *whole* sequence, so every rank
needs every other rank's K and V. Non-causal: rank r holds the contiguous block r. Causal: zigzag
load balancing (the sequence in 2W chunks, rank r holding chunks r and 2W-1-r, stored in that
order), so every rank attends to the same number of (query, key) pairs. At W = 1 one rank holds
the whole sequence and nothing is exchanged: the compute side alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from commweave.workloads.attention_cp.attention import chunked_attention, shard_positions, shard_ranges, visible_pairs
from commweave.contracts.workload import Cost, Shape, Workload, checked_tensor, input_names, seeded_generator

SEQ_LENGTHS = (16384, 32768, 65536, 131072)
HEADS = ((32, 8), (32, 32))  # (query heads, KV heads): Llama-style GQA, and plain multi-head
HEAD_DIMS = (128, 64)
CUCO_SEQ = (4096, 8192)  # CUCo's small settings, for comparison with the paper
CUCO_HEAD_DIMS = (32, 64)
CUCO_HEADS = (32, 32)  # the paper's head counts are not recorded here; 32/32 is an assumption
Q_SCALE = 2.0  # queries ~ N(0, 4): scores with std ~2, so the softmax is peaked and the max matters
#: shapes up to this many (query, key, head) scores are referenced in one exact tile
EXACT_LIMIT = 1 << 26
_LABEL = re.compile(r"^\s*s(\d+)-q(\d+)kv(\d+)-d(\d+)-(causal|full)\s*$")
_CUCO = re.compile(r"^\s*cuco-s(\d+)-d(\d+)-(causal|full)\s*$")


class AttentionCP(Workload):
    name = "attention-cp"
    op_inputs = ("q", "k", "v")  # what a caller passes to the op
    summary = "out[S/W, Hq, D] = attention(q_local, K, V of the whole sequence), bf16, causal zigzag or full"
    dtype = torch.bfloat16
    world_sizes = (1, 2, 4)
    baselines = ("host", "allgather", "torch_cp")
    #: the issue's "ideal": this rank's attention with all keys present, no communication, computed
    #: as the seed does (two blocks + merge) and as all-gather + SDPA does; the faster is the ideal
    yardsticks = {"ideal": ("seed", {"communicate": False}), "ideal_sdpa": ("allgather", {"communicate": False})}
    seed = "seed"

    # -- shapes ---------------------------------------------------------------------------------
    def make_shape(self, seq: int, heads: int, kv_heads: int, head_dim: int, causal: bool, world_size: int,
                   label: str | None = None) -> Shape:
        """A validated shape: total sequence `seq`, `heads` query heads, `kv_heads` KV heads."""
        self.check_world_size(world_size)
        for what, value in (("sequence length", seq), ("query heads", heads), ("KV heads", kv_heads), ("head dim", head_dim)):
            if value <= 0:
                raise ValueError(f"{what} must be positive, got {value}")
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads (grouped-query attention)")
        if head_dim % 8 or head_dim > 256:
            raise ValueError(f"head dim {head_dim} must be a multiple of 8 and at most 256 (flash attention; 16-byte rows)")
        shard_ranges(seq, world_size, 0, causal)  # raises for a sequence the sharding cannot split
        mode = "causal" if causal else "full"
        return Shape(label or f"s{seq}-q{heads}kv{kv_heads}-d{head_dim}-{mode}",
                     {"S": seq, "HQ": heads, "HKV": kv_heads, "D": head_dim, "CAUSAL": int(causal)})

    def bench_shapes(self, world_size: int) -> list[Shape]:
        shapes = [self.make_shape(s, hq, hkv, d, causal, world_size)
                  for causal in (False, True) for hq, hkv in HEADS for d in HEAD_DIMS for s in SEQ_LENGTHS]
        shapes += [self.make_shape(s, *CUCO_HEADS, d, causal, world_size, f"cuco-s{s}-d{d}-{'causal' if causal else 'full'}")
                   for causal in (False, True) for d in CUCO_HEAD_DIMS for s in CUCO_SEQ]
        return shapes

    def check_shapes(self, world_size: int) -> list[Shape]:
        # 2W*37 tokens: chunks of 37 (or 74) rows fit no tile; GQA 4 query heads per KV head; one
        # causal and one full shape, and a plain multi-head one with head dim 64.
        return [
            self.make_shape(74 * world_size, 8, 2, 40, True, world_size),
            self.make_shape(74 * world_size, 8, 2, 40, False, world_size),
            self.make_shape(64 * world_size, 4, 4, 64, True, world_size),
        ]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        """'s<S>-q<Hq>kv<Hkv>-d<D>-causal|full' (S total), or CUCo's 'cuco-s<S>-d<D>-causal|full'."""
        cuco = _CUCO.match(text)
        if cuco:
            seq, dim, mode = int(cuco.group(1)), int(cuco.group(2)), cuco.group(3)
            return self.make_shape(seq, *CUCO_HEADS, dim, mode == "causal", world_size, f"cuco-s{seq}-d{dim}-{mode}")
        m = _LABEL.match(text)
        if not m:
            raise ValueError(f"shape {text!r} is not 's<S>-q<Hq>kv<Hkv>-d<D>-causal|full' (e.g. s32768-q32kv8-d128-causal, "
                             "S total) or 'cuco-s<S>-d<D>-causal|full'")
        seq, hq, hkv, dim = (int(g) for g in m.groups()[:4])
        return self.make_shape(seq, hq, hkv, dim, m.group(5) == "causal", world_size)

    # -- data -----------------------------------------------------------------------------------
    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        gen = seeded_generator(device, seed, world_size, rank)
        local = shape["S"] // world_size
        q = torch.randn(local, shape["HQ"], shape["D"], generator=gen, device=device, dtype=torch.float32) * Q_SCALE
        k = torch.randn(local, shape["HKV"], shape["D"], generator=gen, device=device, dtype=torch.float32)
        v = torch.randn(local, shape["HKV"], shape["D"], generator=gen, device=device, dtype=torch.float32)
        return {"q": q.to(self.dtype), "k": k.to(self.dtype), "v": v.to(self.dtype)}

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(shape["S"] // world_size, shape["HQ"], shape["D"], dtype=self.dtype, device=device)

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        """Exact float32 attention over the whole sequence (positions from the sharding), in one
        tile for small shapes, in 2048 x 8192 tiles merged by LSE for large ones. On GPUs at 128k
        tokens this is ~2e15 float32 FLOPs per rank (tens of seconds)."""
        causal = bool(shape["CAUSAL"])
        shards = [self.make_inputs(shape, world_size, r, seed, device) for r in range(world_size)]
        k = torch.cat([s["k"] for s in shards])
        v = torch.cat([s["v"] for s in shards])
        k_pos = torch.cat([shard_positions(shape["S"], world_size, r, causal, device) for r in range(world_size)])
        q = shards[rank]["q"]
        q_pos = shard_positions(shape["S"], world_size, rank, causal, device)
        if q.shape[0] * k.shape[0] * shape["HQ"] <= EXACT_LIMIT:
            q_block, k_block = q.shape[0], k.shape[0]
        else:
            q_block, k_block = 2048, 8192
        return chunked_attention(q, k, v, q_pos, k_pos, causal, q_block=q_block, k_block=k_block)

    def tolerance(self) -> float:
        # bf16 inputs and output (2^-9 relative rounding), bf16 probabilities in flash kernels'
        # P @ V, and partial outputs rounded to bf16 before an LSE merge: measured errors are a
        # few 1e-3; 1e-2 leaves room without admitting a wrong block (one missing KV block of W
        # changes the output by tens of percent).
        return 1e-2

    def cost(self, shape: Shape, world_size: int) -> Cost:
        """Per rank: 4 * pairs * Hq * D FLOPs (QK^T and PV), where pairs are the (query, key)
        pairs the rank's queries see; receiving the other ranks' K and V; reading q, the whole K
        and V once and writing out. The floor is thus this rank's attention with all KV present
        at the matmul rate (flash kernels reach less: the 'ideal' of the issue is measured)."""
        causal = bool(shape["CAUSAL"])
        seq, hq, hkv, d = shape["S"], shape["HQ"], shape["HKV"], shape["D"]
        item = torch.empty((), dtype=self.dtype).element_size()
        pairs = max(visible_pairs(seq, world_size, r, causal) for r in range(world_size))
        local = seq // world_size
        return Cost(
            flops=4.0 * pairs * hq * d,
            comm_bytes=float((world_size - 1) * local * 2 * hkv * d * item),
            memory_bytes=float((2 * local * hq * d + 2 * seq * hkv * d) * item),
        )

    def template(self):
        from commweave.workloads.attention_cp.template import AttentionCPTemplate

        return AttentionCPTemplate(self)

    def ideal_flops(self, shape: Shape, world_size: int, rank: int) -> float:
        """FLOPs of `rank`'s attention with all KV present (equal on every rank when balanced)."""
        return 4.0 * visible_pairs(shape["S"], world_size, rank, bool(shape["CAUSAL"])) * shape["HQ"] * shape["D"]

    # -- calls on a user's tensors (commweave.ops) ---------------------------------------------
    def op_options(self, shape: Shape) -> dict[str, Any]:
        return {"causal": bool(shape["CAUSAL"])}

    def single_rank(self, inputs: Mapping[str, torch.Tensor | None], out: torch.Tensor | None = None,
                    **options: Any) -> torch.Tensor:
        """One rank holds the whole sequence: attention of q over k and v."""
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"q [S, Hq, D], k and v [S, Hkv, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
        # [1, H, S, D] views: 4-D, so SDPA's fused kernels run (3-D inputs fall back to its math kernel)
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        res = F.scaled_dot_product_attention(qh, kh, vh, is_causal=bool(options.get("causal", False)),
                                             enable_gqa=q.shape[1] != k.shape[1])
        return res[0].transpose(0, 1).contiguous()

    def shape_from_inputs(self, inputs: Mapping[str, torch.Tensor], world_size: int, rank: int,
                          out: torch.Tensor | None = None, causal: bool = False) -> Shape:
        """q [S/W, Hq, D], k and v [S/W, Hkv, D], bf16, one device, sequence-major: this rank's
        tokens (causal: zigzag chunks r and 2W-1-r, in that order; full: block r)."""
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be True or False, not {causal!r}")
        input_names(inputs, ("q", "k", "v"))
        q = checked_tensor("q", inputs["q"], 3, self.dtype)
        k = checked_tensor("k", inputs["k"], 3, self.dtype, q.device)
        v = checked_tensor("v", inputs["v"], 3, self.dtype, q.device)
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape [S/W, Hkv, D]")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"q holds {q.shape[0]} tokens but k and v {k.shape[0]}: a rank holds the queries, keys and "
                             "values of the same tokens")
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"q has head dim {q.shape[2]} but k and v {k.shape[2]}")
        return self.make_shape(q.shape[0] * world_size, q.shape[1], k.shape[1], q.shape[2], causal, world_size)
