"""Anti-cheat checks on one run's output: poison, NaN, mutated inputs, relative error.

Outputs are filled with a specific NaN payload (the *poison*) before every run, written through an
integer view so the exact bits are known: an element still holding those bits afterwards was never
written, and one holding another NaN was computed as NaN. The error is a relative Frobenius norm,
against a reference checked to be non-trivial, so an all-zero output cannot pass a loose tolerance.
"""

from __future__ import annotations

import math

import torch

from commweave.contracts.poison import poisoned_mask
from commweave.contracts.verdict import FailureClass, Verdict

#: a reference whose RMS is below this is trivially satisfied by zeros: a workload bug
MIN_REFERENCE_RMS = 1e-6


def not_ready(tensor: torch.Tensor, untouched: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-dim bool tensor (on the tensor's device, no sync): any poison or non-finite element
    among those the program must write (all, unless `untouched` marks some to leave alone)."""
    bad = poisoned_mask(tensor) | ~torch.isfinite(tensor)
    return (bad & ~untouched).any() if untouched is not None else bad.any()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def modified_inputs(inputs: dict[str, torch.Tensor], pristine: dict[str, torch.Tensor]) -> list[str]:
    """Names of inputs whose bits differ from their pristine copies."""
    return [name for name, tensor in inputs.items() if not _same_bits(tensor, pristine[name])]


def judge_output(out: torch.Tensor, reference: torch.Tensor, tolerance: float,
                 untouched: torch.Tensor | None = None) -> Verdict:
    """Poison left over -> wrong_result; other NaN/Inf -> nan; relative Frobenius error above
    `tolerance` -> wrong_result. `untouched` (a bool mask, from `Workload.untouched`) marks
    elements the program must leave alone: a write there is a wrong_result, and they are left out
    of the other checks. Raises ValueError for a reference no output should be judged by."""
    if out.shape != reference.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(reference.shape)}")
    if untouched is not None:
        if untouched.shape != out.shape:
            raise ValueError(f"untouched mask shape {tuple(untouched.shape)} differs from the output's {tuple(out.shape)}")
        stray = int((~poisoned_mask(out) & untouched).sum())
        if stray:
            return Verdict.failed(FailureClass.WRONG_RESULT, f"wrote {stray} elements it must leave untouched")
        keep = ~untouched
        out, reference = out[keep], reference[keep]
    ref = reference.float()
    ref_norm = float(torch.linalg.vector_norm(ref))
    if not math.isfinite(ref_norm) or ref_norm < MIN_REFERENCE_RMS * math.sqrt(max(1, ref.numel())):
        raise ValueError(f"the reference's norm {ref_norm:.3g} is trivial or not finite: zeros would pass")
    unwritten = int(poisoned_mask(out).sum())
    if unwritten:
        return Verdict.failed(FailureClass.WRONG_RESULT, f"output not written: {unwritten} of {out.numel()} elements")
    non_finite = int((~torch.isfinite(out)).sum())
    if non_finite:
        return Verdict.failed(FailureClass.NAN, f"output has {non_finite} NaN/Inf of {out.numel()} elements")
    error = float(torch.linalg.vector_norm(out.float() - ref)) / ref_norm
    if not error <= tolerance:
        return Verdict.failed(FailureClass.WRONG_RESULT, f"relative error {error:.3g} exceeds tolerance {tolerance:.3g}")
    return Verdict.passed(f"relative error {error:.3g}")
