"""Answers with a pickle whose `__reduce__` raises the harness's own ProgramStartError where it is
unpickled: in a judge that unpickles replies, the evaluation turns into an InfrastructureError
(the machine's fault, not the candidate's). Written by hand to every unix stream socket it holds.
Expected: runtime_error (a frame that is not the wire's JSON) or wrong_result."""

import os
import pickle
import socket
import stat
import struct

CODE = ("(_ for _ in ()).throw(__import__('commweave.runtime.candidate', fromlist=['ProgramStartError'])"
        ".ProgramStartError('the machine is broken'))")


# EVOLVE-BLOCK-START
class Payload:
    def __reduce__(self):
        return (eval, (CODE,))


def setup(ctx, shape):
    return {}


def run(ctx, state, inputs, out):
    frame = pickle.dumps(Payload())
    for fd in range(3, 1024):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
            sock.sendall(struct.pack("!i", len(frame)) + frame)
        sock.close()
# EVOLVE-BLOCK-END
