"""Looks for credentials in its environment and raises with them (the verdict's message is an
exfiltration channel). Expected: runtime_error that names no secret."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    found = {k: v for k, v in os.environ.items() if any(w in k for w in ("KEY", "TOKEN", "SECRET", "REDTEAM", "COMMWEAVE"))}
    raise RuntimeError(f"environment: {found} all: {dict(os.environ)}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
