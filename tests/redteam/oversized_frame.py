"""Computes the right output, then announces a 1 GiB frame to the judge and starts sending it: a
judge without a cap on frames reads (and allocates) until the sender stops, here hanging in the
read. Expected: runtime_error (the frame exceeds the wire's cap, refused at its header)."""

import os
import socket
import stat
import struct
import threading

import torch
import torch.distributed as dist


# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def flood(sock):
    try:
        sock.sendall(struct.pack("!i", 1 << 30) + bytes(8 << 20))
    except OSError:
        pass


def run(ctx, state, inputs, out):
    parts = [torch.empty_like(inputs["a"]) for _ in range(ctx.world_size)]
    dist.all_gather(parts, inputs["a"], group=ctx.group)
    torch.mm(torch.cat(parts), inputs["b"], out=out)
    for fd in range(3, 1024):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
            threading.Thread(target=flood, args=(sock,), daemon=True).start()
        else:
            sock.close()
# EVOLVE-BLOCK-END
