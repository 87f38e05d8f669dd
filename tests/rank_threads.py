"""W simulated ranks as threads on one process, for tests that check a program's or a
collective's synchronisation logic without GPUs."""

from __future__ import annotations

import threading
from typing import Callable


def run_rank_threads(world: int, rank_main: Callable[[int], None], abort: Callable[[], None]) -> None:
    """Run rank_main(rank) for every rank in its own thread and wait for all. A rank that raises
    calls `abort` (which must break the barriers the others may wait at, so they fail too rather
    than hang); then the first error that is not such a broken barrier is raised."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            rank_main(rank)
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errors.append(e)
            abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
