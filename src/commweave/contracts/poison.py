"""The output contract: the harness fills every output with a poison NaN before a run.

The poison is a specific NaN payload written through an integer view, so its exact bits are known:
an element still holding them afterwards was never written, and one holding another NaN was
computed as NaN. Workloads read it too (an element a correct program never writes keeps it).
"""

from __future__ import annotations

import torch

# A quiet NaN with a payload no arithmetic produces (PyTorch's own NaN is 0x7FC0 / 0x7FC00000).
_POISON: dict[int, tuple[torch.dtype, int]] = {
    1: (torch.int8, 0x7F),
    2: (torch.int16, 0x7FA5),
    4: (torch.int32, 0x7FA5A5A5),
    8: (torch.int64, 0x7FFA5A5A5A5A5A5A),  # float64: 11 exponent bits
}


def _int_view(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"outputs must be floating point to be poisoned, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("outputs must be contiguous to be poisoned")
    int_dtype, pattern = _POISON[tensor.element_size()]
    return tensor.view(int_dtype), pattern


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill `tensor` with the poison NaN bit pattern (in place, on its stream)."""
    ints, pattern = _int_view(tensor)
    ints.fill_(pattern)
    return tensor


def poisoned_mask(tensor: torch.Tensor) -> torch.Tensor:
    ints, pattern = _int_view(tensor)
    return ints == pattern
