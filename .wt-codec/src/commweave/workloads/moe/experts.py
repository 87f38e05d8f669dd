"""Weight-streaming expert GEMMs for decode, as Triton kernels (imported only on CUDA, or on CPU
under TRITON_INTERPRET=1 in the tests).

Why: at decode sizes (tens of rows per expert) the expert compute is bound by reading every local
expert's weights once (5.6 GB a rank on 4 GPUs: 1.2 ms at HBM rate), and `torch._grouped_mm`
reaches ~3.0 TB/s there (1.87 ms for the pair at T128, W4: bench/results/probe-moe-experts-*).
These kernels put the weights on the wide side of the tensor-core product ("swap AB": a program
computes W_tile[BLOCK_N, K] @ rows^T[K, BLOCK_M]), so a program streams one BLOCK_N slice of one
expert's weights once through a deep software pipeline while a handful of rows ride along.

The pool is expert-major: expert e's rows are [ends[e-1], ends[e]) (ends[-1] = 0, as
`torch._grouped_mm`'s `offs`); rows past ends[-1] are neither read nor written. A program owns
(expert e, output columns [n0, n0 + BLOCK_N)) and walks e's rows BLOCK_M at a time; an expert with
no rows costs nothing, and one with more than BLOCK_M rows re-reads its slice per row block (so
BLOCK_M should cover the usual rows per expert; prefill sizes belong to `torch._grouped_mm`).

- `gate_up_swiglu`: h[r] = SiLU(x[r] @ gate_e^T) * (x[r] @ up_e^T), both products accumulated in
  fp32 and the SiLU taken there (w13[e] = gate rows then up rows, as the workload stores it), h bf16.
- `down`: y[r] = h[r] @ w2_e^T, fp32 accumulation, y bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and pipeline depth of one kernel (the CONFIG knobs a sweep varies)."""

    block_m: int = 32  # rows per product (the tensor-core N side): cover the rows of one expert
    block_n: int = 64  # weight rows a program owns (the tensor-core M side)
    block_k: int = 128
    stages: int = 4
    warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tiles.{name} must be a power of two of at least 16 (a tensor-core tile side), not {value}")
        if self.stages < 1:
            raise ValueError(f"Tiles.stages must be at least 1, not {self.stages}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tiles.warps must be one of 1, 2, 4, 8, 16, not {self.warps}")


#: measured best tiles (bench/results/probe-moe-experts-1gpu-20261201T041232Z.json and
#: …T043903Z.json: the best gate/up tiles within 1 % of each other, down best at (32, 128, 64, 3) at
#: 8 and 16 rows), keyed by the largest balanced rows per local expert they serve: (gate_up, down)
STREAMED_TILES = {
    32: (Tiles(block_m=32, block_n=128, block_k=128, stages=3), Tiles(block_m=32, block_n=128, block_k=64, stages=3)),
    64: (Tiles(block_m=64, block_n=64, block_k=64, stages=3), Tiles(block_m=64, block_n=128, block_k=64, stages=3)),
}
#: beyond this many rows per expert `torch._grouped_mm` is faster (512 rows: 4.5 ms against 14.4)
STREAMED_MAX_ROWS = max(STREAMED_TILES)


def tiles_for(rows_per_expert: float) -> tuple[Tiles, Tiles]:
    """The measured tiles for experts that receive about this many rows each."""
    if rows_per_expert > STREAMED_MAX_ROWS:
        raise ValueError(f"the streamed experts serve up to {STREAMED_MAX_ROWS} rows per expert, not {rows_per_expert:g}: "
                         "use torch._grouped_mm")
    return STREAMED_TILES[min(m for m in STREAMED_TILES if rows_per_expert <= m)]


@triton.jit
def _expert_rows(ends, e):
    """Expert e's rows [start, end) in the expert-major pool."""
    prev = tl.load(ends + tl.maximum(e - 1, 0)).to(tl.int64)
    start = tl.where(e > 0, prev, 0)
    end = tl.load(ends + e).to(tl.int64)
    return start, end


@triton.jit
def _rows_tile(x, sx, rows, r_live, k, k_dim, EVEN_K: tl.constexpr):
    """Rows^T [BLOCK_K, BLOCK_M]: elements k of each live row (zeros elsewhere)."""
    mask = r_live[None, :] if EVEN_K else r_live[None, :] & (k < k_dim)[:, None]
    return tl.load(x + rows[None, :] * sx + k[:, None], mask=mask, other=0.0)


@triton.jit
def _weights_tile(w, n_live, k, k_dim, EVEN_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] of the weight rows at w (pointers per row), elements k."""
    mask = n_live[:, None] if EVEN_K else n_live[:, None] & (k < k_dim)[None, :]
    return tl.load(w + k[None, :], mask=mask, other=0.0)


@triton.jit
def _streamed_kernel(x, w, out, ends, n_out, k_dim, sx, sw_e, sw_n, so,
                     GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, EVEN_K: tl.constexpr):
    """out[r, n] for expert e = program_id(0) and n in this program's BLOCK_N columns: x[r] @ w_e[n]
    (down), or with GATED SiLU(x[r] @ w_e[n]) * (x[r] @ w_e[n + n_out]) (gate rows, then up rows)."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = n < n_out
    start, end = _expert_rows(ends, e)
    w_first = w + e.to(tl.int64) * sw_e + n[:, None].to(tl.int64) * sw_n
    w_second = w_first + n_out * sw_n  # up rows (GATED only)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        r_live = rows < end
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(0, k_dim, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            xt = _rows_tile(x, sx, rows, r_live, k, k_dim, EVEN_K)
            acc = tl.dot(_weights_tile(w_first, n_live, k, k_dim, EVEN_K), xt, acc)
            if GATED:
                acc_up = tl.dot(_weights_tile(w_second, n_live, k, k_dim, EVEN_K), xt, acc_up)
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        tl.store(out + rows[None, :] * so + n[:, None], acc.to(out.dtype.element_ty), mask=r_live[None, :] & n_live[:, None])


def _check(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor, k_dim: int, name: str) -> None:
    if rows.dim() != 2 or weights.dim() != 3:
        raise ValueError(f"{name}: rows must be 2-D and weights [experts, out, in], not {tuple(rows.shape)} and {tuple(weights.shape)}")
    if rows.shape[1] != k_dim or weights.shape[2] != k_dim:
        raise ValueError(f"{name}: rows {tuple(rows.shape)} and weights {tuple(weights.shape)} disagree on the inner size {k_dim}")
    if rows.stride(1) != 1 or weights.stride(2) != 1:
        raise ValueError(f"{name}: rows and weights must be contiguous along the inner dimension")
    if ends.shape != (weights.shape[0],) or ends.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: ends must be int32/int64 with one entry per expert ({weights.shape[0]}), "
                         f"not {ends.dtype} {tuple(ends.shape)}")


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ends: torch.Tensor, n_out: int, tiles: Tiles,
            gated: bool) -> None:
    k_dim = x.shape[1]
    grid = (w.shape[0], triton.cdiv(n_out, tiles.block_n))
    _streamed_kernel[grid](x, w, out, ends, n_out, k_dim, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                           GATED=gated, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                           STAGES=tiles.stages, EVEN_K=k_dim % tiles.block_k == 0, num_warps=tiles.warps)


def gate_up_swiglu(x: torch.Tensor, w13: torch.Tensor, ends: torch.Tensor, tiles: Tiles = Tiles(),
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """h [rows, I] = SiLU(x @ gate^T) * (x @ up^T) per expert over the expert-major rows of x
    (w13 [E, 2I, H]); rows past ends[-1] of the result are left as they were (unwritten)."""
    _check(x, w13, ends, x.shape[1], "gate_up_swiglu")
    if w13.shape[1] % 2:
        raise ValueError(f"gate_up_swiglu: w13 holds gate rows then up rows, an even count, not {w13.shape[1]}")
    inter = w13.shape[1] // 2
    h = out if out is not None else x.new_empty(x.shape[0], inter)
    if h.shape != (x.shape[0], inter) or h.stride(1) != 1:
        raise ValueError(f"gate_up_swiglu: out must be [{x.shape[0]}, {inter}] and contiguous by row, not {tuple(h.shape)}")
    _launch(x, w13, h, ends, inter, tiles, gated=True)
    return h


def down(h: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor, tiles: Tiles = Tiles(),
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y [rows, H] = h @ w2_e^T per expert over the expert-major rows of h (w2 [E, H, I]); rows
    past ends[-1] of the result are left unwritten."""
    _check(h, w2, ends, h.shape[1], "down")
    hidden = w2.shape[1]
    y = out if out is not None else h.new_empty(h.shape[0], hidden)
    if y.shape != (h.shape[0], hidden) or y.stride(1) != 1:
        raise ValueError(f"down: out must be [{h.shape[0]}, {hidden}] and contiguous by row, not {tuple(y.shape)}")
    _launch(h, w2, y, ends, hidden, tiles, gated=False)
    return y
