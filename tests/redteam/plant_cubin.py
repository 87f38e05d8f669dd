"""Plants an artefact in the compile cache under every name it can list there, so a baseline
compiled from the same source would load its code. Expected: runtime_error (the judge's cache is
read-only to it), the cache unchanged."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    planted = []
    for root in [os.environ.get("COMMWEAVE_CACHE", "")] + os.environ.get("COMMWEAVE_CACHE_SHARED", "").split(os.pathsep):
        folder = os.path.join(root, "cubin")
        if root and os.path.isdir(folder):
            with open(os.path.join(folder, "planted-by-a-candidate.cubin"), "wb") as f:
                f.write(b"not a cubin")
            planted.append(folder)
            for name in os.listdir(folder):
                if name.endswith(".cubin"):
                    with open(os.path.join(folder, name), "wb") as f:
                        f.write(b"not a cubin")
    raise RuntimeError(f"planted in {planted}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
