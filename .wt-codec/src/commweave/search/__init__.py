"""The slow path: program database, offline proposer, evolution over islands."""

from commweave.search.db import ProgramDB, ProgramRecord, code_hash
from commweave.search.evolve import Budget, CompileAhead, Evolution, SearchConfig
from commweave.search.proposer import Memory, OfflineProposer, Proposal

__all__ = ["Budget", "CompileAhead", "Evolution", "Memory", "OfflineProposer", "ProgramDB", "ProgramRecord",
           "Proposal", "SearchConfig", "code_hash"]
