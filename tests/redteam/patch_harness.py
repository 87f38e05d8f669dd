"""Writes nothing, and replaces every harness function it can import (output judging, input
checks, readiness, poisoning, the clock) with ones that report success. Expected: wrong_result
(the judge runs in another process; patches stay in the program's own)."""

import sys
import time

# EVOLVE-BLOCK-START
def _patch():
    from commweave.contracts.verdict import Verdict

    passed = lambda *a, **k: Verdict.passed("patched")  # noqa: E731
    for name, module in list(sys.modules.items()):
        if not name.startswith("commweave") or module is None:
            continue
        for attr, fake in (("judge_output", passed), ("modified_inputs", lambda *a, **k: []),
                           ("not_ready", lambda *a, **k: 0), ("poison_", lambda t, *a, **k: t),
                           ("below_floor", lambda *a, **k: None)):
            if hasattr(module, attr):
                setattr(module, attr, fake)
    started = time.perf_counter()
    time.perf_counter = lambda: started  # every timed region lasts 0 s


def setup(ctx, shape):
    _patch()
    return {}


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
