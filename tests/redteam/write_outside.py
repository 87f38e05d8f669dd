"""Writes files outside its private folder: a folder the test names, the temp folder, and its
private folder's parent (where other candidates' folders are). Expected: runtime_error (refused)
and no such file anywhere."""

import os
import tempfile

# EVOLVE-BLOCK-START
OUTSIDE = "__OUTSIDE__"
MARKER = "__MARKER__"


def setup(ctx, shape):
    for folder in (OUTSIDE, "/tmp", "/var/tmp", os.path.dirname(os.getcwd()), os.path.dirname(tempfile.gettempdir())):
        with open(os.path.join(folder, f"escape_{MARKER}_{ctx.rank}.txt"), "w") as f:
            f.write("escaped")
    raise RuntimeError("wrote outside")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
