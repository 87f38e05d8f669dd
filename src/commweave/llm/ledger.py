"""What LLM calls cost and how they failed: one `CallRecord` per HTTP attempt, a run-wide `Ledger`
that sums the spend and enforces the budget cap, and the errors a call can end with.

Every attempt is recorded, failures included, so a run's database shows why a proposal was lost
(a 429 storm, a timeout, an unusable reply) and where the money went. Each attempt reserves its
worst-case cost before it is sent and settles it once with what it cost, so calls in flight on
several threads can never take the spend past the cap.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable

#: the outcomes of one attempt; every LLMError's `kind` is one of them (all but "ok")
OUTCOMES = ("ok", "rate_limited", "server_error", "timeout", "bad_response", "budget", "abandoned",
            "prompt_too_large")


class LLMError(Exception):
    """A call that produced no usable completion; `kind` says why (a CallRecord outcome)."""

    kind = "bad_response"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
        #: every attempt of the call that ended with this error, set by `LLMClient.complete`
        self.records: tuple[CallRecord, ...] = ()

    @property
    def cost_usd(self) -> float:
        """What the call's attempts cost, though none gave a usable completion."""
        return sum(r.cost_usd for r in self.records)


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
    """No complete answer within the model's `timeout_s` (connect and every read together)."""

    kind = "timeout"


class BadResponse(LLMError):
    """A 4xx other than 429 (retrying cannot help), or a reply that cannot be used: a body that is
    not the protocol's JSON (truncated, HTML, ...), too large, without text, or with bad usage."""

    kind = "bad_response"


class BudgetExceeded(LLMError):
    """The run's LLM budget is spent; raised before sending, so nothing more is billed."""

    kind = "budget"


class Abandoned(LLMError):
    """The call was given up because its run ended (`Ledger.close`) while it was in flight."""

    kind = "abandoned"


class PromptTooLarge(LLMError):
    """The conversation is over the model's `max_prompt_bytes`; refused before sending."""

    kind = "prompt_too_large"


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


class Reservation:
    """One attempt's hold on the budget: `usd` (its worst case) is counted as spent until the
    ledger settles it; it settles at most once, however many threads try."""

    _ids = itertools.count(1)

    def __init__(self, usd: float):
        self.id = next(self._ids)
        self.usd = usd
        self.settled = False
        self.abandoned = threading.Event()  # set by Ledger.close: the attempt must give up


class Ledger:
    """Spend across all models of a run; `on_call` gets every CallRecord (the search writes them
    to its database). `budget_usd=None`: no cap. `spent_usd` carries a resumed run's spend over.

    Each attempt `reserve`s its worst case before it is sent (refused with BudgetExceeded when the
    budget minus what is spent and reserved cannot hold it) and `settle`s with its record, which
    books the real cost once. Spend and reservations together never pass the cap, so neither
    does the spend, whatever the number of calls in flight. `close` abandons the calls in flight
    and refuses new ones until `reopen` (a search ends its run this way).
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
        self._lock = threading.Lock()  # proposals run in threads
        self._in_flight: dict[int, Reservation] = {}
        self._refused_usd: float | None = None  # the last reservation refused, until one fits again
        self._closed: str | None = None
        self._wake = threading.Event()  # set while closed: interrupts backoff sleeps

    @property
    def reserved_usd(self) -> float:
        with self._lock:
            return sum(r.usd for r in self._in_flight.values())

    def remaining(self) -> float | None:
        """Dollars neither spent nor reserved, never negative; None without a cap."""
        if self.budget_usd is None:
            return None
        return max(0.0, self.budget_usd - self.spent_usd - self.reserved_usd)

    @property
    def exhausted(self) -> bool:
        """The budget is spent, or the last refused call's worst case still does not fit in what
        is left (it may fit again once calls in flight settle below their worst case)."""
        if self.budget_usd is None:
            return False
        if self.spent_usd >= self.budget_usd:
            return True
        left = self.remaining()
        return self._refused_usd is not None and left is not None and left < self._refused_usd

    def reserve(self, usd: float) -> Reservation:
        """Hold `usd` (an attempt's worst case) before sending; BudgetExceeded if it does not fit,
        Abandoned once the ledger is closed."""
        if usd < 0:
            raise ValueError(f"a reservation must be >= 0 dollars, got {usd}")
        with self._lock:
            if self._closed is not None:
                raise Abandoned(f"not sent: {self._closed}")
            if self.budget_usd is not None:
                reserved = sum(r.usd for r in self._in_flight.values())
                left = self.budget_usd - self.spent_usd - reserved
                if usd > left + 1e-12 or self.spent_usd >= self.budget_usd:
                    self._refused_usd = usd
                    raise BudgetExceeded(f"LLM budget of ${self.budget_usd:.4f} cannot hold this call's worst case of "
                                         f"${usd:.4f} (${self.spent_usd:.4f} spent, ${reserved:.4f} held by calls in "
                                         "flight)")
            reservation = Reservation(usd)
            self._in_flight[reservation.id] = reservation
            self._refused_usd = None
            return reservation

    def settle(self, reservation: Reservation, rec: CallRecord) -> bool:
        """Release `reservation` and book `rec`; False (nothing booked) if it was settled before."""
        with self._lock:
            if reservation.settled:
                return False
            reservation.settled = True
            self._in_flight.pop(reservation.id, None)
            self.spent_usd += rec.cost_usd
        if self.on_call is not None:
            self.on_call(rec)
        return True

    def record(self, rec: CallRecord) -> None:
        """Book a record that held no reservation (a call refused before sending)."""
        with self._lock:
            self.spent_usd += rec.cost_usd
        if self.on_call is not None:
            self.on_call(rec)

    def check(self) -> None:
        """Raise BudgetExceeded once the budget is spent (or cannot hold the last refused call)."""
        if self.exhausted:
            raise BudgetExceeded(f"LLM budget of ${self.budget_usd:.4f} is spent (${self.spent_usd:.4f} so far)")

    # -- ending a run ---------------------------------------------------------------------------
    def close(self, reason: str) -> int:
        """Abandon every call in flight (each ends at once, booked by its own thread) and refuse
        new ones with Abandoned(`reason`) until `reopen`; the number of calls abandoned."""
        if not reason:
            raise ValueError("Ledger.close needs a reason (it ends the calls in flight)")
        with self._lock:
            self._closed = reason
            in_flight = list(self._in_flight.values())
        self._wake.set()
        for reservation in in_flight:
            reservation.abandoned.set()
        return len(in_flight)

    def reopen(self) -> None:
        with self._lock:
            self._closed = None
        self._wake.clear()

    @property
    def closed(self) -> str | None:
        """Why the ledger is closed, or None while calls may be made."""
        return self._closed

    def sleep(self, seconds: float) -> None:
        """Wait `seconds` (a retry's backoff), or less if the ledger is closed meanwhile."""
        self._wake.wait(max(0.0, seconds))
