"""JSON messages, one per line, over a socket: what the roll call and the
rendezvous say to each other. Every read is bounded by a deadline."""

from __future__ import annotations

import json
import socket
import time


def send(conn: socket.socket, message: object) -> None:
    """Send `message` as one line of JSON."""
    conn.sendall((json.dumps(message) + "\n").encode())


class LineReader:
    """JSON lines from a socket; keeps what arrived after a line (two
    messages may come in one packet)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.data = b""

    def next_line(self, deadline: float) -> bytes | None:
        """The next line's bytes, without its newline; None when the socket
        closed or `deadline` (a `time.monotonic()` value) passed first."""
        while b"\n" not in self.data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.conn.settimeout(remaining)
            chunk = self.conn.recv(4096)
            if not chunk:
                return None
            self.data += chunk
        line, self.data = self.data.split(b"\n", 1)
        return line

    def next(self, deadline: float) -> dict | None:
        """The next line as a JSON object; None when the socket closed, timed
        out or sent something else."""
        try:
            line = self.next_line(deadline)
            message = json.loads(line) if line is not None else None
        except (OSError, ValueError):
            return None
        return message if isinstance(message, dict) else None
