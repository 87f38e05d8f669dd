"""The LSE merges as Triton kernels (imported only on CUDA, or on CPU under TRITON_INTERPRET=1 in
the tests).

One program merges BLOCK_R (query, head) rows of D values: w_x = exp(lse_x - max), out =
(w_a o_a + w_b o_b) / (w_a + w_b), rows that saw no key in either partial get 0. `merge_two`
writes a fresh output from two partials; `merge_into_acc` folds one partial into float32
accumulators in place (out and lse), the ring's and the pull seed's per-block step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16


@triton.jit
def _weights(lse_a, lse_b):
    """Each side's normalized weight and the merged LSE for rows with LSEs lse_a, lse_b (0, 0 and
    -inf where neither saw a key)."""
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(lse_a - m)
    wb = tl.exp(lse_b - m)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    return wa * inv, wb * inv, m + tl.log(total)


@triton.jit
def _merge(out, out_lse, oa, la, ob, lb, rows, heads, d,
           so_s, so_h, sol_s, sol_h, sa_s, sa_h, sla_s, sla_h, sb_s, sb_h, slb_s, slb_h,
           WRITE_LSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out <- merge of (oa, la) and (ob, lb); out_lse <- the merged LSE when WRITE_LSE. out may be
    oa itself (and out_lse la): each element is read before the same program writes it."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    live = r < rows * heads
    s, h = r // heads, r % heads
    lse_a = tl.load(la + s * sla_s + h * sla_h, mask=live, other=float("-inf"))
    lse_b = tl.load(lb + s * slb_s + h * slb_h, mask=live, other=float("-inf"))
    wa, wb, merged_lse = _weights(lse_a, lse_b)
    cols = live[:, None] & (c[None, :] < d)
    xa = tl.load(oa + (s * sa_s + h * sa_h)[:, None] + c[None, :], mask=cols, other=0.0).to(tl.float32)
    xb = tl.load(ob + (s * sb_s + h * sb_h)[:, None] + c[None, :], mask=cols, other=0.0).to(tl.float32)
    y = xa * wa[:, None] + xb * wb[:, None]
    tl.store(out + (s * so_s + h * so_h)[:, None] + c[None, :], y.to(out.dtype.element_ty), mask=cols)
    if WRITE_LSE:
        tl.store(out_lse + s * sol_s + h * sol_h, merged_lse, mask=live)


def _launch(out: torch.Tensor, out_lse: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
            lse_b: torch.Tensor, write_lse: bool) -> None:
    rows, heads, d = out.shape
    grid = (triton.cdiv(rows * heads, BLOCK_R),)
    _merge[grid](out, out_lse, out_a, lse_a, out_b, lse_b, rows, heads, d,
                 out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
                 out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
                 out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
                 WRITE_LSE=write_lse, BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(d))


def merge_two_cuda(out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> None:
    """`attention.merge_two` on CUDA tensors [S, H, D] (last dim contiguous) and LSEs [S, H]."""
    _launch(out, lse_a, out_a, lse_a, out_b, lse_b, write_lse=False)


def merge_into_acc(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """`attention.merge_into` in one kernel: float32 accumulators [S, H, D] / [S, H] (last dim
    contiguous), a partial of any float dtype and its LSE."""
    _launch(acc_out, acc_lse, acc_out, acc_lse, out, lse, write_lse=True)
