"""Opens the run's database (its path is known to this attacker) and rewrites it: deletes every
row, records a fake high fitness. Then computes honestly. Expected: a failure (the write is
refused, PermissionError: runtime_error) and the database unchanged."""

import sqlite3

import torch
import torch.distributed as dist

RUN_DB = "__RUN_DB__"

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    db = sqlite3.connect(RUN_DB)
    db.execute("delete from programs")
    db.execute("insert into programs values ('pwned', 1000.0)")
    db.commit()
    db.close()
    with open(RUN_DB, "ab") as f:
        f.write(b"tampered")
    return {}


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
# EVOLVE-BLOCK-END
