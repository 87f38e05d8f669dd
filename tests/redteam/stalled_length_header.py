"""Sends the judge a frame's 4-byte length header and then nothing, for ever: a judge whose read
has no deadline hangs in it until the pool kills it. Expected: timeout, reported by the judge
itself (its read gave up at the job's deadline; no judge process was restarted)."""

import os
import socket
import stat
import struct
import time


# EVOLVE-BLOCK-START
def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    for fd in range(3, 1024):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
            sock.sendall(struct.pack("!i", 4096))
        sock.close()
    time.sleep(3600)
# EVOLVE-BLOCK-END
