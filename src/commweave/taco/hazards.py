"""When a rank may rewrite a buffer its peers read: lazy rewrite barriers, and the CUDA-graph rule.

A rank may overwrite its buffer only after a barrier that every rank passed behind its reads of the
previous contents. Rather than a trailing barrier in every call, each buffer remembers the barrier
count at its last read, and a write barriers first only if no barrier has happened since: the next
phase's or the next call's barrier covers the reads for free.

Under CUDA graph capture a call is replayed later, any number of times, with no host bookkeeping,
so the lazy rule cannot know what ran since: a captured write always barriers first, and a buffer
a captured call read stays "read at any time" (every later write barriers first, eager or not).
"""

from __future__ import annotations

from typing import Hashable

ANY_TIME = -1  # the read mark of a buffer a captured call read: a graph replay may read it at any time


class RewriteBarriers:
    """The barrier count (identical on every rank: calls are collective) and each buffer's last read."""

    def __init__(self) -> None:
        self.barriers = 0
        self._read_at: dict[Hashable, int] = {}

    def counted(self) -> int:
        """Record a barrier (queued, or performed by a reading kernel); its number."""
        self.barriers += 1
        return self.barriers

    def before_write(self, key: Hashable, capturing: bool) -> bool:
        """Whether a write of `key`'s buffer needs a barrier first (peers may still read it)."""
        return capturing or self._read_at.get(key) in (self.barriers, ANY_TIME)

    def read(self, key: Hashable, capturing: bool) -> None:
        """Peers have read `key`'s buffer up to now."""
        if capturing or self._read_at.get(key) == ANY_TIME:
            self._read_at[key] = ANY_TIME
        else:
            self._read_at[key] = self.barriers

    def pending(self) -> bool:
        """Peers may still be reading some buffer (a barrier is needed before releasing them)."""
        return any(at in (self.barriers, ANY_TIME) for at in self._read_at.values())
