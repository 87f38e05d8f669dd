"""Lists and reads other candidates' private folders (its own folder's siblings) and the temp
folder. Expected: runtime_error (refused), naming nothing it found."""

import os

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    found = {}
    for folder in (os.path.dirname(os.getcwd()), "/tmp"):
        for name in os.listdir(folder):
            found[os.path.join(folder, name)] = os.listdir(os.path.join(folder, name)) if os.path.isdir(os.path.join(folder, name)) else None
    raise RuntimeError(f"other candidates: {found!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
