"""Evaluation: compile -> correctness on fresh, poisoned runs -> side-by-side timing -> fitness.

Verdicts must be trustworthy: generated kernels cheat and break in known ways, and every such way
ends in fitness 0 with a failure class and a message (see ARCHITECTURE.md, "Evaluation").
"""

from commweave.evaluate.evaluator import CANDIDATE, Evaluator
from commweave.evaluate.floor import FLOOR_MARGIN, MachineRates, calibrate, floor_s
from commweave.contracts.result import BenchResult, EvalResult, ProgramTiming
from commweave.contracts.verdict import EvaluationError, FailureClass, Verdict

__all__ = [
    "CANDIDATE", "FLOOR_MARGIN", "BenchResult", "EvalResult", "EvaluationError", "Evaluator", "FailureClass",
    "MachineRates", "ProgramTiming", "Verdict", "calibrate", "floor_s",
]
