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
def _merge_two(out, oa, la, ob, lb, rows, heads, d,
               so_s, so_h, sa_s, sa_h, sla_s, sla_h, sb_s, sb_h, slb_s, slb_h,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    live = r < rows * heads
    s, h = r // heads, r % heads
    lse_a = tl.load(la + s * sla_s + h * sla_h, mask=live, other=float("-inf"))
    lse_b = tl.load(lb + s * slb_s + h * slb_h, mask=live, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(lse_a - m)
    wb = tl.exp(lse_b - m)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    wa, wb = wa * inv, wb * inv
    cols = live[:, None] & (c[None, :] < d)
    xa = tl.load(oa + (s * sa_s + h * sa_h)[:, None] + c[None, :], mask=cols, other=0.0).to(tl.float32)
    xb = tl.load(ob + (s * sb_s + h * sb_h)[:, None] + c[None, :], mask=cols, other=0.0).to(tl.float32)
    y = xa * wa[:, None] + xb * wb[:, None]
    tl.store(out + (s * so_s + h * so_h)[:, None] + c[None, :], y.to(out.dtype.element_ty), mask=cols)


def merge_two_cuda(out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> None:
    """`attention.merge_two` on CUDA tensors [S, H, D] (last dim contiguous) and LSEs [S, H]."""
    rows, heads, d = out.shape
    grid = (triton.cdiv(rows * heads, BLOCK_R),)
    _merge_two[grid](out, out_a, lse_a, out_b, lse_b, rows, heads, d,
                     out.stride(0), out.stride(1), out_a.stride(0), out_a.stride(1), lse_a.stride(0), lse_a.stride(1),
                     out_b.stride(0), out_b.stride(1), lse_b.stride(0), lse_b.stride(1),
                     BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(d))


@triton.jit
def _merge_acc(acc, acc_lse, o, lse, rows, heads, d,
               sa_s, sa_h, sal_s, sal_h, so_s, so_h, sl_s, sl_h,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    live = r < rows * heads
    s, h = r // heads, r % heads
    lse_a = tl.load(acc_lse + s * sal_s + h * sal_h, mask=live, other=float("-inf"))
    lse_b = tl.load(lse + s * sl_s + h * sl_h, mask=live, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(lse_a - m)
    wb = tl.exp(lse_b - m)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    cols = live[:, None] & (c[None, :] < d)
    at = acc + (s * sa_s + h * sa_h)[:, None] + c[None, :]
    xa = tl.load(at, mask=cols, other=0.0)
    xb = tl.load(o + (s * so_s + h * so_h)[:, None] + c[None, :], mask=cols, other=0.0).to(tl.float32)
    tl.store(at, xa * (wa * inv)[:, None] + xb * (wb * inv)[:, None], mask=cols)
    tl.store(acc_lse + s * sal_s + h * sal_h, m + tl.log(total), mask=live)


def merge_into_acc(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """`attention.merge_into` in one kernel: float32 accumulators [S, H, D] / [S, H] (last dim
    contiguous), a partial of any float dtype and its LSE."""
    rows, heads, d = acc_out.shape
    grid = (triton.cdiv(rows * heads, BLOCK_R),)
    _merge_acc[grid](acc_out, acc_lse, out, lse, rows, heads, d,
                     acc_out.stride(0), acc_out.stride(1), acc_lse.stride(0), acc_lse.stride(1),
                     out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                     BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(d))
