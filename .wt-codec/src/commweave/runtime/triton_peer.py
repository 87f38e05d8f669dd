"""Triton on symmetric memory: a kernel that reads another rank's window through the address
`ctx.peer_ptrs` gives (NVLink loads, no NCCL call). Imported only where Triton is installed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_from_address(src_address, out_ptr, count, BLOCK: tl.constexpr):
    src = src_address.to(tl.pointer_type(tl.float32))
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    tl.store(out_ptr + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def copy_from_peer(address: int, out: torch.Tensor, block: int = 1024) -> None:
    """out[:] = the float32 values at `address` (a peer's window, mapped into this process)."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("copy_from_peer writes a contiguous float32 tensor")
    _copy_from_address[(triton.cdiv(out.numel(), block),)](address, out, out.numel(), BLOCK=block)
