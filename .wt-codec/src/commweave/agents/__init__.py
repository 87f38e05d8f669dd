"""Agents that write programs with an LLM: the fast path (host-driven -> device-initiated)."""

from commweave.agents.analysis import AnalysisError, Collective, ProgramAnalysis, Site, analyze_program, analyze_source
from commweave.agents.fast_path import (
    Attempt, FastPath, FastPathError, FastPathResult, attempt_log_path, conservative_directives, renderable_conservative,
)

__all__ = [
    "AnalysisError", "Attempt", "Collective", "FastPath", "FastPathError", "FastPathResult", "ProgramAnalysis", "Site",
    "analyze_program", "analyze_source", "attempt_log_path", "conservative_directives", "renderable_conservative",
]
