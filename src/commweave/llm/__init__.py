"""LLM access for the agents and the search: provider clients (any OpenAI-compatible server,
Anthropic), model configuration, cost accounting with a budget cap, a bandit over several models,
and the application of a model's patches to a program.

Imports nothing else of commweave's. The SDKs are the optional extra `commweave[llm]`, imported
only when a client is made.
"""

from commweave.llm.client import AnthropicClient, Completion, LLMClient, Message, OpenAIChatClient, client_for
from commweave.llm.config import ModelConfig, load_models, resolve_model
from commweave.llm.ledger import (Abandoned, BadResponse, BudgetExceeded, CallRecord, Ledger, LLMError, LLMTimeout,
                                  PromptTooLarge, RateLimited, Reservation, ServerError)
from commweave.llm.patch import PatchError, apply_diff, apply_rewrite, evolve_blocks, extract_code, extract_json_block
from commweave.llm.pool import ModelPool

__all__ = [
    "Message", "Completion", "CallRecord", "Ledger", "ModelConfig", "LLMClient", "ModelPool",
    "LLMError", "RateLimited", "ServerError", "LLMTimeout", "BadResponse", "BudgetExceeded", "Abandoned",
    "PromptTooLarge", "Reservation",
    "load_models", "resolve_model", "client_for",
    "PatchError", "evolve_blocks", "apply_diff", "apply_rewrite", "extract_code", "extract_json_block",
    "OpenAIChatClient", "AnthropicClient",
]
