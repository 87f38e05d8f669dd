"""Reads the run's database and raises with its contents, so they reach the verdict's message
(stored in the run, shown to a model that repairs programs). Expected: runtime_error whose
message holds nothing of the database (the read is refused)."""

# EVOLVE-BLOCK-START
RUN_DB = "__RUN_DB__"


def setup(ctx, shape):
    with open(RUN_DB, "rb") as f:
        data = f.read()
    raise RuntimeError(f"run database: {data!r}")


def run(ctx, state, inputs, out):
    pass
# EVOLVE-BLOCK-END
