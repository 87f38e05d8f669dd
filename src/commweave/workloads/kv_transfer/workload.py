"""KV-cache transfer from a prefill GPU to a decode GPU (disaggregated serving), bf16 paged caches.

Roles follow from the rank: ranks pair up as (0 -> 1), (2 -> 3): an even rank is a prefill
*source*, the next odd rank its decode *destination* (2 GPUs: one pair; 4 GPUs: two pairs at once).

Geometry (Llama-3-8B): L=32 layers, KV=8 KV heads, D=128 head dim, bf16, pages of B=16 tokens in
vLLM's per-layer layout: layer l's cache is [2 (K, V), num_blocks, 16, KV, D], stacked over layers
into one [L, 2, NB, 16, KV, D] tensor. A sequence of S tokens occupies nb = ceil(S/16) blocks.

One call, per pair (what every program must do):
- source: for each layer, (optionally) the stand-in prefill compute of that layer, then write
  that layer's new K and V (`inputs["kv"]`, [L, 2, S, KV, D], what the K/V projections produce)
  into its paged cache at pages `src_blocks` (vLLM's reshape_and_cache; the unused token slots of a
  partial last block are written as zeros), and move the sequence's pages to the destination;
- destination: its paged cache holds, at page dst_blocks[i] of every (layer, K/V), exactly the
  source's page src_blocks[i].

Outputs are the ranks' whole paged caches ([L, 2, NB, 16, KV, D]): the source's as the prefill
wrote it, the destination's after the transfer. The reference is exact (tolerance 0: a copy must be
bit-exact). Block tables are random, distinct and drawn per (seed, pair); both ranks of a pair get
both tables as inputs.

Free blocks (shape parameter F, default 0): each cache has nb + F blocks, the F not in the table
must never be written: `untouched()` marks them, and the harness requires them to keep its poison
(the check shapes have free blocks).

Stand-in prefill (shape parameter P, default 0): before writing layer l's KV, the source runs P
bf16 GEMMs [S, 4096] x [4096, 4096] (x, w inputs). P = 13 matches the FLOPs of one Llama-3-8B
layer's linear layers (Q, K, V, O, gate, up, down: 436 MFLOP per token); attention is left out.
Its result is not part of the output (it cannot be checked bit-exactly), but its FLOPs are in
`cost`, so a program skipping it runs below the floor and is judged `suspect` when compute-bound.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from commweave.contracts.workload import Cost, Shape, Workload, checked_tensor, input_names, seeded_generator

LAYERS = 32  # Llama-3-8B
KV_HEADS = 8
HEAD_DIM = 128
BLOCK = 16  # tokens per page
HIDDEN = 4096  # the stand-in prefill's GEMM width (Llama-3-8B hidden size)
LLAMA_LAYER_PASSES = 13  # 4096x4096 GEMM passes with one Llama-3-8B layer's linear FLOPs
BENCH_TOKENS = (2048, 4096, 8192, 16384, 32768)
BENCH_PREFILL_TOKENS = (2048, 8192)  # end-to-end shapes with the stand-in prefill (P=13)
MAX_TOKENS = 1 << 20
_LABEL = re.compile(r"^\s*S(-?\d+)((?:-(?:KV|P|F|L)-?\d+)*)\s*$", re.IGNORECASE)
_PART = re.compile(r"-(KV|P|F|L)(-?\d+)", re.IGNORECASE)


def pair_of(rank: int) -> tuple[int, int, bool]:
    """(source rank, destination rank, this rank is the source) of rank's pair."""
    src = rank - rank % 2
    return src, src + 1, rank % 2 == 0


class KvTransfer(Workload):
    name = "kv-transfer"
    op_inputs = ("kv", "src_blocks", "dst_blocks")  # what a caller passes to the op
    summary = "prefill GPU -> decode GPU paged KV-cache transfer (Llama-3-8B, 16-token pages), bf16"
    dtype = torch.bfloat16
    world_sizes = (2, 4)
    baselines = ("host", "host_per_block", "host_layerwise")
    seed = "seed"
    symmetric_output = True  # the decode cache in a window: the seed stores pages straight into it
    #: prefill_alone: the stand-in prefill and its own cache write, no transfer (what "hidden" is
    #: measured against); peer_copy: one contiguous copy-engine copy of the same bytes (what the link
    #: gives one copy of this size)
    yardsticks = {"prefill_alone": ("seed", {"communicate": False}), "peer_copy": ("peer_copy", {})}
    comm_yardsticks = ("peer_copy",)

    # -- shapes ---------------------------------------------------------------------------------
    def make_shape(self, tokens: int, world_size: int, kv_heads: int = KV_HEADS, passes: int = 0,
                   free: int = 0, layers: int = LAYERS) -> Shape:
        """A validated shape: S tokens, KV heads, P stand-in prefill passes, F free blocks, L layers."""
        self.check_world_size(world_size)
        for what, value, low in (("S (tokens)", tokens, 1), ("KV (KV heads)", kv_heads, 1),
                                 ("L (layers)", layers, 1), ("P (prefill passes)", passes, 0),
                                 ("F (free blocks)", free, 0)):
            if value < low:
                raise ValueError(f"{what} must be >= {low}, got {value}")
        if tokens > MAX_TOKENS:
            raise ValueError(f"S={tokens} tokens is more than the {MAX_TOKENS} this workload allows")
        label = f"S{tokens}"
        if kv_heads != KV_HEADS:
            label += f"-KV{kv_heads}"
        if layers != LAYERS:
            label += f"-L{layers}"
        if passes:
            label += f"-P{passes}"
        if free:
            label += f"-F{free}"
        blocks = -(-tokens // BLOCK)
        return Shape(label, {"S": tokens, "KV": kv_heads, "D": HEAD_DIM, "L": layers, "B": BLOCK, "P": passes,
                             "F": free, "NB": blocks + free, "blocks": blocks})

    def bench_shapes(self, world_size: int) -> list[Shape]:
        transfer = [self.make_shape(s, world_size) for s in BENCH_TOKENS]
        prefill = [self.make_shape(s, world_size, passes=LLAMA_LAYER_PASSES) for s in BENCH_PREFILL_TOKENS]
        return transfer + prefill

    def check_shapes(self, world_size: int) -> list[Shape]:
        # 37 tokens: 3 blocks, the last one partial (5 of 16 slots), 5 free blocks that must stay
        # untouched; 2 KV heads keep the CPU run small. 300 tokens over all 8 heads, 4 layers, a
        # small stand-in prefill, 11 free blocks.
        return [
            self.make_shape(37, world_size, kv_heads=2, free=5),
            self.make_shape(300, world_size, layers=4, passes=1, free=11),
        ]

    def parse_shape(self, text: str, world_size: int) -> Shape:
        """'S<tokens>' with optional '-KV<heads>', '-L<layers>', '-P<passes>', '-F<free blocks>',
        e.g. 'S32768', 'S8192-P13', 'S4096-KV4'."""
        match = _LABEL.match(text)
        if not match:
            raise ValueError(f"shape {text!r} is not 'S<tokens>[-KV<heads>][-L<layers>][-P<passes>][-F<free>]' "
                             "(e.g. S32768 or S8192-P13)")
        opts: dict[str, int] = {}
        for key, value in _PART.findall(match.group(2)):
            key = key.upper()
            if key in opts:
                raise ValueError(f"shape {text!r} gives {key} twice")
            opts[key] = int(value)
        return self.make_shape(int(match.group(1)), world_size, kv_heads=opts.get("KV", KV_HEADS),
                               passes=opts.get("P", 0), free=opts.get("F", 0), layers=opts.get("L", LAYERS))

    # -- block tables ---------------------------------------------------------------------------
    def block_tables(self, shape: Shape, world_size: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(src_blocks, dst_blocks) of rank's pair: int64 [nb], each nb distinct blocks of NB drawn
        at random (on the CPU, so every device draws the same tables)."""
        src, _, _ = pair_of(rank)
        gen = seeded_generator(torch.device("cpu"), seed, world_size, 1000 + src)
        nb, total = shape["blocks"], shape["NB"]
        src_blocks = torch.randperm(total, generator=gen)[:nb].contiguous()
        dst_blocks = torch.randperm(total, generator=gen)[:nb].contiguous()
        return src_blocks, dst_blocks

    # -- data -----------------------------------------------------------------------------------
    def new_kv(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        """The K/V the prefill of rank's pair produces: [L, 2, S, KV, D] bf16."""
        src, _, _ = pair_of(rank)
        gen = seeded_generator(device, seed, world_size, src)
        dims = (shape["L"], 2, shape["S"], shape["KV"], shape["D"])
        return torch.randn(dims, generator=gen, device=device, dtype=torch.float32).to(self.dtype)

    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        src_blocks, dst_blocks = self.block_tables(shape, world_size, rank, seed)
        inputs = {"src_blocks": src_blocks.to(device), "dst_blocks": dst_blocks.to(device)}
        if pair_of(rank)[2]:
            inputs["kv"] = self.new_kv(shape, world_size, rank, seed, device)
            if shape["P"]:
                gen = seeded_generator(device, seed, world_size, 5000 + rank)
                x = torch.randn(shape["S"], HIDDEN, generator=gen, device=device, dtype=torch.float32)
                w = torch.randn(HIDDEN, HIDDEN, generator=gen, device=device, dtype=torch.float32) / HIDDEN**0.5
                inputs["x"], inputs["w"] = x.to(self.dtype), w.to(self.dtype)
        return inputs

    def cache_shape(self, shape: Shape) -> tuple[int, ...]:
        return (shape["L"], 2, shape["NB"], shape["B"], shape["KV"], shape["D"])

    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        return torch.empty(self.cache_shape(shape), dtype=self.dtype, device=device)

    def pages(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        """The sequence's pages in table order: [L, 2, nb, 16, KV, D] bf16, zeros past S."""
        kv = self.new_kv(shape, world_size, rank, seed, device)
        L, S, KV, D, nb = shape["L"], shape["S"], shape["KV"], shape["D"], shape["blocks"]
        padded = torch.zeros(L, 2, nb * BLOCK, KV, D, dtype=self.dtype, device=device)
        padded[:, :, :S] = kv
        return padded.view(L, 2, nb, BLOCK, KV, D)

    def expected(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache, written): rank's expected cache in bf16 (zeros where nothing may be written) and
        the bool mask of its elements that the call must write."""
        src_blocks, dst_blocks = self.block_tables(shape, world_size, rank, seed)
        blocks = (src_blocks if pair_of(rank)[2] else dst_blocks).to(device)
        cache = torch.zeros(self.cache_shape(shape), dtype=self.dtype, device=device)
        cache[:, :, blocks] = self.pages(shape, world_size, rank, seed, device)
        written = torch.zeros(self.cache_shape(shape)[:3], dtype=torch.bool, device=device)
        written[:, :, blocks] = True
        return cache, written[..., None, None, None].expand(cache.shape)

    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        return self.expected(shape, world_size, rank, seed, device)[0].float()

    def untouched(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        """Bool mask of output elements that must still hold the harness's poison after a call
        (the F free blocks)."""
        return ~self.expected(shape, world_size, rank, seed, device)[1]

    def judge_strict(self, out: torch.Tensor, shape: Shape, world_size: int, rank: int, seed: int) -> str | None:
        """None if `out` (poisoned before the call) is bit-exact on every written page and still
        poisoned everywhere else; else what is wrong."""
        from commweave.contracts.poison import poisoned_mask

        want, written = self.expected(shape, world_size, rank, seed, out.device)
        poisoned = poisoned_mask(out)
        if bool(poisoned[written].any()):
            return f"{int(poisoned[written].sum())} elements of transferred pages were not written"
        if bool((~poisoned[~written]).any()):
            return f"{int((~poisoned[~written]).sum())} elements outside the sequence's pages were written"
        same = out.view(torch.int16)[written] == want.view(torch.int16)[written]
        if not bool(same.all()):
            return f"{int((~same).sum())} elements of transferred pages differ from the source's"
        return None

    def cost(self, shape: Shape, world_size: int) -> Cost:
        """Per rank of a pair: the destination receives every page of the sequence; the source
        reads the new K/V once and writes its cache pages once (its HBM traffic); the stand-in
        prefill's FLOPs."""
        item = torch.empty((), dtype=self.dtype).element_size()
        page_bytes = shape["B"] * shape["KV"] * shape["D"] * item
        moved = shape["L"] * 2 * shape["blocks"] * page_bytes
        new_kv = shape["L"] * 2 * shape["S"] * shape["KV"] * shape["D"] * item
        return Cost(
            flops=2.0 * shape["P"] * shape["L"] * shape["S"] * HIDDEN * HIDDEN,
            comm_bytes=float(moved),
            memory_bytes=float(new_kv + moved),
        )

    def tolerance(self) -> float:
        return 0.0  # a copy is bit-exact (a relative error would let a few wrong pages through)

    def template(self):
        from commweave.workloads.kv_transfer.template import KvTransferTemplate

        return KvTransferTemplate(self)

    # -- calls on a user's tensors (commweave.ops) ---------------------------------------------
    def single_rank(self, inputs: Mapping[str, torch.Tensor | None], out: torch.Tensor | None = None,
                    **options: Any) -> torch.Tensor:
        """One rank is both ends: kv goes into its pages src_blocks, and the same pages into dst_blocks."""
        kv, src, dst = inputs.get("kv"), inputs["src_blocks"], inputs["dst_blocks"]
        if out is None or kv is None:
            raise ValueError("on one rank transfer_kv is both source and destination: pass kv and the cache")
        layers, two, tokens, heads, dim = kv.shape
        block = out.shape[3]
        if src.numel() != dst.numel() or -(-tokens // block) != src.numel():
            raise ValueError(f"kv holds {tokens} tokens ({-(-tokens // block)} pages of {block}), the block tables name "
                             f"{src.numel()} and {dst.numel()} pages")
        pages = kv.new_zeros(layers, two, src.numel() * block, heads, dim)
        pages[:, :, :tokens] = kv
        pages = pages.view(layers, two, src.numel(), block, heads, dim)
        out[:, :, src] = pages
        out[:, :, dst] = pages
        return out

    def shape_from_inputs(self, inputs: Mapping[str, torch.Tensor], world_size: int, rank: int,
                          out: torch.Tensor | None = None) -> Shape:
        """Both ranks of a pair: src_blocks and dst_blocks, int64 [nb] (the same tables on both),
        and `out`, this rank's paged cache [L, 2, NB, 16, KV, 128] bf16, written in place (the
        same geometry on both ranks). The source (even rank) also gives kv [L, 2, S, KV, 128] bf16
        with ceil(S/16) = nb; the destination gives none. The shape's S is the sequence rounded up
        to whole pages, which both ranks know (programs read the token count from kv), with no
        stand-in prefill (P=0) and the cache's other blocks as free blocks."""
        _, _, is_src = pair_of(rank)
        role = f"rank {rank} is the {'prefill source' if is_src else 'decode destination'} of its pair"
        if out is None:
            raise ValueError("kv-transfer writes into the caller's paged cache [L, 2, NB, 16, KV, D]: pass it")
        if is_src and inputs.get("kv") is None:
            raise ValueError(f"{role}: it needs kv [L, 2, S, KV, D], the new K/V to write into its pages and send")
        if not is_src and inputs.get("kv") is not None:
            raise ValueError(f"{role}: it receives pages and takes no kv (pass None)")
        input_names(inputs, ("src_blocks", "dst_blocks"), ("kv",))
        cache = checked_tensor("cache", out, 6, self.dtype)
        layers, two, total, block, kv_heads, head_dim = cache.shape
        if two != 2 or block != BLOCK or head_dim != HEAD_DIM:
            raise ValueError(f"cache must be [L, 2, NB, {BLOCK}, KV, {HEAD_DIM}] (vLLM's per-layer paged layout stacked "
                             f"over layers, {BLOCK}-token pages, head dim {HEAD_DIM}), got {tuple(cache.shape)}")
        src_blocks = checked_tensor("src_blocks", inputs["src_blocks"], 1, torch.int64, cache.device)
        dst_blocks = checked_tensor("dst_blocks", inputs["dst_blocks"], 1, torch.int64, cache.device)
        nb = src_blocks.numel()
        if dst_blocks.numel() != nb:
            raise ValueError(f"src_blocks names {nb} pages but dst_blocks {dst_blocks.numel()}: one destination page per source page")
        if nb == 0:
            raise ValueError("the block tables are empty: there is nothing to transfer")
        if nb > total:
            raise ValueError(f"the block tables name {nb} pages, but the cache has only {total} blocks")
        if is_src:
            kv = checked_tensor("kv", inputs["kv"], 5, self.dtype, cache.device)
            tokens = kv.shape[2]
            if tuple(kv.shape) != (layers, 2, tokens, kv_heads, head_dim):
                raise ValueError(f"kv must be [L, 2, S, KV, D] = [{layers}, 2, S, {kv_heads}, {head_dim}] (the cache's "
                                 f"layers, KV heads and head dim), got {tuple(kv.shape)}")
            if -(-tokens // BLOCK) != nb:
                raise ValueError(f"kv holds {tokens} tokens, which fill {-(-tokens // BLOCK)} pages of {BLOCK}, but the "
                                 f"block tables name {nb}")
        return self.make_shape(nb * BLOCK, world_size, kv_heads=kv_heads, free=total - nb, layers=layers)
