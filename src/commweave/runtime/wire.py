"""The wire between a judge and its program process: length-prefixed JSON frames, never pickle.

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON whose top level is an
object. What a program process sends is data the judge parses under caps (`MAX_PROGRAM_FRAME`),
never code: unpickling would run whatever a candidate's `__reduce__` says in the judge. Reads are
exact (never past the current frame, so a file descriptor passed with SCM_RIGHTS after a frame is
never swallowed) and a partial frame is kept between calls, so a reader with a deadline returns on
time even when the peer sends a header and then nothing. Bytes travel as base64 strings.
"""

from __future__ import annotations

import base64
import json
import select
import socket
import struct
import time
from typing import Any

HEADER = struct.Struct("!I")
#: the largest frame a judge reads from a program process (replies are small; a traceback is cut
#: by the program side's harness well below this)
MAX_PROGRAM_FRAME = 1 << 20
#: the largest frame a program process reads from its judge (a program's text rides in one)
MAX_JUDGE_FRAME = 64 << 20
_FD_MARK = b"F"


class WireError(Exception):
    """A frame that breaks the wire's rules: too large, not JSON, or not a JSON object."""


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_bytes(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise WireError(f"not base64: {exc}") from None


class Channel:
    """One end of a unix stream socket carrying JSON frames (and file descriptors beside them)."""

    def __init__(self, sock: socket.socket, max_frame: int):
        self.sock = sock
        self.max_frame = max_frame
        self._header = b""
        self._body = bytearray()
        self._size: int | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any]) -> None:
        """One frame; raises OSError when the peer is gone."""
        body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def send_fd(self, fd: int) -> None:
        """A file descriptor, as a one-byte message of its own (after the frame that announces it)."""
        socket.send_fds(self.sock, [_FD_MARK], [fd])

    def receive_fd(self) -> int:
        """The descriptor `send_fd` sent (blocking: only a program process, from its judge, uses it)."""
        data, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        if data != _FD_MARK or len(fds) != 1:
            for fd in fds:
                socket.close(fd)
            raise WireError("expected one file descriptor")
        return fds[0]

    def receive(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message, or None when no whole frame came within `timeout` seconds (None:
        wait for ever); what arrived of a frame is kept for the next call. Raises EOFError when
        the peer closed, WireError for a frame that breaks the rules."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            wanted = HEADER.size - len(self._header) if self._size is None else self._size - len(self._body)
            if wanted == 0:
                return self._parse()
            if end is not None:
                remaining = end - time.monotonic()
                if remaining <= 0 or not _readable(self.sock, remaining):
                    return None
            chunk = self.sock.recv(min(wanted, 1 << 16))
            if not chunk:
                raise EOFError("the peer closed the channel")
            if self._size is None:
                self._header += chunk
                if len(self._header) == HEADER.size:
                    (self._size,) = HEADER.unpack(self._header)
                    if self._size > self.max_frame:
                        raise WireError(f"a frame of {self._size} bytes exceeds the cap of {self.max_frame}")
            else:
                self._body += chunk

    def _parse(self) -> dict[str, Any]:
        body = bytes(self._body)
        self._header, self._body, self._size = b"", bytearray(), None
        try:
            message = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise WireError(f"a frame is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
        if not isinstance(message, dict):
            raise WireError(f"a frame is a JSON {type(message).__name__}, not an object")
        return message

    def close(self) -> None:
        self.sock.close()


def _readable(sock: socket.socket, timeout: float) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(timeout * 1000))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
