"""The ranks' output under `keras-dist launch`: forwarded line by line, and,
once a rank has failed, held until the launcher has named the root cause.

Every line a rank prints goes to the launcher's stdout or stderr with the
prefix `[rank N] `, whole (one lock for both streams). When a rank fails, the
others soon fail too, and say so loudly: a torch rank that loses its peer in
the middle of a collective prints gloo's "Connection reset by peer ... bugs in
the application" or, from a C++ thread, "terminate called after throwing an
instance of 'gloo::EnforceNotMet' ... Is there a distributed collective
mismatch in your code?", blaming the user's code for the failure of another
process. So from the first failure on, lines are held; `release` prints them
after the launcher knows the root cause, under a line that labels the other
ranks' output as its consequence, and the launcher's summary comes last. A
rank that failed on its own (see `keras_dist.faults.own_failure`) is no
consequence: its lines are not labelled, and the summary names it and its
exception beside the first.

Lines are written a moment after they are read (`SETTLE_SECONDS`): a rank's
reaction to a lost peer can reach the launcher before the launcher sees the
peer's exit (the peer's sockets close just before its exit is reported), and a
line already written cannot be labelled any more.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Collection
from typing import BinaryIO, TextIO

#: How long a line waits before it is written (see the module docstring).
SETTLE_SECONDS = 0.05
# Lines held after a failure, at most; beyond, they are written as they come
# (a rank that prints without end must not fill the launcher's memory).
_MAX_HELD_LINES = 20_000

# What a collective library says when a peer is lost mid-collective: the
# launcher's summary quotes what it finds, and says it is a consequence.
COLLECTIVE_ERRORS = (
    "Is there a distributed collective mismatch in your code?",
    "Connection reset by peer",
    "Connection closed by peer",
    "bugs in the application",
    "NCCL error",
)


class RankOutput:
    """Where the ranks' lines go (see the module docstring).

    Args:
        stdout: the stream for the ranks' stdout lines.
        stderr: the stream for their stderr lines and the launcher's messages.
    """

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._lock = threading.Condition()
        # (time read, rank, stream name, line) not yet written, oldest first.
        self._pending: collections.deque[tuple[float, int, str, bytes]] = (
            collections.deque()
        )
        self._held: list[tuple[int, str, bytes]] = []
        self._failed_at: float | None = None
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_settled, name="keras-dist-output", daemon=True
        )
        self._writer.start()

    # -- the readers ---------------------------------------------------------------
    def forward(self, pipe: BinaryIO, rank: int, stream: str) -> None:
        """Read `pipe` (a rank's `stream`, "stdout" or "stderr") to its end,
        forwarding each line: the target of one reader thread per pipe."""
        prefix = f"[rank {rank}] ".encode()
        with pipe:
            # Bytes, not text: a rank's output need not be valid UTF-8.
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                line = prefix + line
                with self._lock:
                    if self._closed:  # the launcher is done: no more waiting
                        self._emit(stream, line)
                        continue
                    self._pending.append((time.monotonic(), rank, stream, line))
                    self._lock.notify()

    def message(self, text: str) -> None:
        """One launcher line, `keras-dist: text`, on stderr, after every rank
        line read before it."""
        self.flush()
        with self._lock:
            self._emit("stderr", f"keras-dist: {text}\n".encode())

    def flush(self) -> None:
        """Write every line read so far (held ones stay held)."""
        with self._lock:
            self._write_pending(until=None)

    # -- failures ------------------------------------------------------------------
    def hold_from(self, failed_at: float) -> None:
        """A rank failed at `failed_at` (`time.monotonic()`): from then on,
        lines are held until `release` (the first failure counts)."""
        with self._lock:
            if self._failed_at is None:
                self._failed_at = failed_at - SETTLE_SECONDS
                self._lock.notify()

    def release(
        self, causes: Collection[int] = (), header: str | None = None
    ) -> list[str]:
        """Stop holding and write what was held: the lines of the ranks in
        `causes` (those that failed in their own right, read late) as they
        are, then, if the other ranks printed anything, `keras-dist: header`
        and their lines.

        Returns:
            The phrases of `COLLECTIVE_ERRORS` the other ranks' held lines
            contain, in that order.
        """
        with self._lock:
            self._write_pending(until=None)
            held, self._held, self._failed_at = self._held, [], None
            own = [entry for entry in held if entry[0] in causes]
            others = [entry for entry in held if entry[0] not in causes]
            for _, stream, line in own:
                self._emit(stream, line)
            if others and header is not None:
                self._emit("stderr", f"keras-dist: {header}\n".encode())
            for _, stream, line in others:
                self._emit(stream, line)
        text = b"".join(line for _, _, line in others).decode(errors="replace")
        return [phrase for phrase in COLLECTIVE_ERRORS if phrase in text]

    def release_after_failure(
        self,
        root: int,
        failure: str,
        failed_after: list[int],
        stopped: int,
        *,
        own: dict[int, str] | None = None,
    ) -> str:
        """Write what was held since `root` failed, the other ranks' lines
        under a line that labels them its consequence, and return the
        launcher's summary (its last line).

        Two ranks that each fail on their own (the same bad batch on both)
        are two failures, not one failure and its consequence: the ranks in
        `own` are named with their exceptions beside the root cause, and their
        lines are written as the root's are, unlabelled.

        Args:
            root: the rank whose failure came first.
            failure: what happened to it, e.g. "rank 1 was killed by signal
                SIGKILL".
            failed_after: the other ranks that failed after it, as a
                consequence.
            stopped: how many ranks the launcher stopped.
            own: the other ranks that failed on their own (see
                `keras_dist.faults.own_failure`), with their exception, e.g.
                `{0: "ValueError: bad labels"}`.
        """
        own = own or {}
        causes = sorted({root, *own})
        with self._lock:
            self._write_pending(until=None)
            printed = sorted({rank for rank, _, _ in self._held if rank not in causes})
        header = None
        if printed:
            which = "that failure" if len(causes) == 1 else "those failures"
            header = (
                f"{_ranks(printed)} printed what follows after {_ranks(causes)} "
                f"failed: a consequence of {which}, which the last line names"
            )
        quoted = self.release(causes, header)
        end = f"stopped the other {stopped} process(es)"
        summary = failure
        for rank, cause in sorted(own.items()):
            summary += f"; rank {rank} also failed, on its own: {cause}"
        if not (failed_after or printed):
            return f"{summary}; {end}"
        if not own:
            summary += ": the root cause"
        if failed_after:
            after = "it" if len(causes) == 1 else "them"
            summary += (
                f"; {_ranks(failed_after)} failed after {after}, as a consequence"
            )
        if quoted:
            phrases = ", ".join(f'"{phrase}"' for phrase in quoted)
            summary += (
                f" (the collective errors above, {phrases}, come from losing "
                f"{_ranks(causes)} in the middle of a collective, not from a "
                "mismatch or a bug in your code)"
            )
        return f"{summary}; {end}"

    def close(self) -> None:
        """Release anything held (unlabelled) and stop the writer thread."""
        self.release()
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._writer.join(1.0)

    # -- writing -------------------------------------------------------------------
    def _write_settled(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                self._write_pending(until=now - SETTLE_SECONDS)
                if self._pending:
                    wait = self._pending[0][0] + SETTLE_SECONDS - now
                    self._lock.wait(max(wait, 0.001))
                else:
                    self._lock.wait()

    def _write_pending(self, until: float | None) -> None:
        """Write (or hold) the pending lines read before `until` (all: None);
        the caller holds the lock."""
        while self._pending and (until is None or self._pending[0][0] <= until):
            read_at, rank, stream, line = self._pending.popleft()
            failed_at = self._failed_at
            if (
                failed_at is not None
                and read_at >= failed_at
                and len(self._held) < _MAX_HELD_LINES
            ):
                self._held.append((rank, stream, line))
            else:
                self._emit(stream, line)

    def _emit(self, stream_name: str, data: bytes) -> None:
        stream = self._streams[stream_name]
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode(errors="replace"))
                stream.flush()
        except (OSError, ValueError):
            # A closed terminal or pipe must not stop the draining of the
            # ranks' pipes, or they would block on a full one.
            return


def _ranks(ranks: list[int]) -> str:
    """`"rank 0"`, `"ranks 0, 2"`."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
