"""What LLM calls cost and how they failed: one `CallRecord` per HTTP attempt, a run-wide `Ledger`
that sums the spend and enforces the budget cap, and the errors a call can end with.

Every attempt is recorded, failures included, so a run's database shows why a proposal was lost
(a 429 storm, a timeout, an empty answer) and where the money went.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

#: the outcomes of one attempt; every LLMError's `kind` is one of them (all but "ok")
OUTCOMES = ("ok", "rate_limited", "server_error", "timeout", "bad_response", "budget")


class LLMError(Exception):
    """A call that produced no usable completion; `kind` says why (a CallRecord outcome)."""

    kind = "bad_response"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RateLimited(LLMError):
    """HTTP 429; `retry_after_s` is the server's Retry-After, if it sent one."""

    kind = "rate_limited"

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerError(LLMError):
    """HTTP 5xx or a failed connection: worth retrying."""

    kind = "server_error"


class LLMTimeout(LLMError):
    """No answer within the model's `timeout_s`."""

    kind = "timeout"


class BadResponse(LLMError):
    """A 4xx other than 429 (retrying cannot help) or an answer without usable text."""

    kind = "bad_response"


class BudgetExceeded(LLMError):
    """The run's LLM budget is spent; raised before sending, so nothing more is billed."""

    kind = "budget"


@dataclass(frozen=True)
class CallRecord:
    """One HTTP attempt (or one refused for the budget), successful or not."""

    model: str  # ModelConfig.name
    purpose: str  # caller's label: "propose", "meta", "fast_path", "judge", ...
    outcome: str  # one of OUTCOMES
    input_tokens: int
    output_tokens: int
    cost_usd: float
    latency_s: float
    message: str  # error text, "" when ok

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"CallRecord outcome {self.outcome!r} is not one of {OUTCOMES}")


class Ledger:
    """Spend across all models of a run; `on_call` gets every CallRecord (the search writes them
    to its database). `budget_usd=None`: no cap. `spent_usd` carries a resumed run's spend over.

    The cap is checked before each call: a call's cost is known only once it returns, so the last
    call may take the spend past the budget by at most its own cost.
    """

    def __init__(self, budget_usd: float | None = None, on_call: Callable[[CallRecord], None] | None = None,
                 spent_usd: float = 0.0):
        if budget_usd is not None and budget_usd < 0:
            raise ValueError(f"LLM budget must be >= 0 dollars, got {budget_usd}")
        if spent_usd < 0:
            raise ValueError(f"spent_usd must be >= 0, got {spent_usd}")
        self.budget_usd = budget_usd
        self.on_call = on_call
        self.spent_usd = spent_usd
        self._lock = threading.Lock()  # proposals may run in threads

    def remaining(self) -> float | None:
        """Dollars left, never negative; None without a cap."""
        if self.budget_usd is None:
            return None
        return max(0.0, self.budget_usd - self.spent_usd)

    @property
    def exhausted(self) -> bool:
        return self.budget_usd is not None and self.spent_usd >= self.budget_usd

    def record(self, rec: CallRecord) -> None:
        with self._lock:
            self.spent_usd += rec.cost_usd
        if self.on_call is not None:
            self.on_call(rec)

    def check(self) -> None:
        """Raise BudgetExceeded once the budget is spent (call before sending a request)."""
        if self.exhausted:
            raise BudgetExceeded(f"LLM budget of ${self.budget_usd:.4f} is spent (${self.spent_usd:.4f} so far)")
