"""Whether every process of a job was given the same checkpoint directory.

`kd.Checkpoint` is collective: process 0 commits each step that every process
wrote a part of, into one directory. Processes given different directories
(a path under each one's own temporary directory, as `keras-dist launch` gives
every rank its own `TMPDIR`) would each find a checkpoint that the others
never finish. `require_same_directory` compares, when `fit` starts, what each
process was given (its real path: links resolved) through the backend's
bounded `gather_numbers`, and raises naming the ranks and their directories.

The same string may still mean different places on different hosts (a local
disk mounted at the same path): that no process can see; what it catches is a
job whose processes were given different paths.
"""

from __future__ import annotations

import hashlib
import os

from keras_dist.backends import get_adapter

# Rank groups shown in the error; the rest are counted.
_SHOWN = 8


def require_same_directory(
    directory: str, *, what: str, timeout_seconds: float
) -> None:
    """Return when every process called this with the same real path of
    `directory` (every process calls it, at the same point); else raise a
    `ValueError`, on every process, naming each rank's directory. `what`
    names the caller in the message ("kd.Checkpoint")."""
    adapter = get_adapter()
    if adapter.num_processes() == 1:
        return
    encoded = os.path.realpath(directory).encode("utf-8", "surrogateescape")
    # 48 bits of the digest: exact as a float64, as `gather_numbers` carries.
    digest = int.from_bytes(hashlib.sha256(encoded).digest()[:6], "big")
    summaries = adapter.gather_numbers(
        [float(digest), float(len(encoded))], timeout_seconds=timeout_seconds
    )
    if all(summary == summaries[0] for summary in summaries):
        return
    # They differ: one more gather (on every process: all saw the same
    # summaries) brings each one's path, byte by byte, for the message.
    longest = int(max(length for _, length in summaries))
    codes = [float(byte) for byte in encoded] + [0.0] * (longest - len(encoded))
    everyone = adapter.gather_numbers(codes, timeout_seconds=timeout_seconds)
    paths = [
        bytes(int(code) for code in row[: int(length)]).decode(
            "utf-8", "surrogateescape"
        )
        for row, (_, length) in zip(everyone, summaries, strict=True)
    ]
    raise ValueError(_message(what, paths))


def _message(what: str, paths: list[str]) -> str:
    ranks_of: dict[str, list[int]] = {}
    for rank, path in enumerate(paths):
        ranks_of.setdefault(path, []).append(rank)
    groups = [
        f"{_ranks(ranks)}: {path!r}"
        for path, ranks in sorted(ranks_of.items(), key=lambda item: item[1][0])
    ]
    if len(groups) > _SHOWN:
        groups = [*groups[:_SHOWN], f"and {len(groups) - _SHOWN} more directories"]
    return (
        f"{what}: the {len(paths)} processes of this job were given "
        f"{len(ranks_of)} different checkpoint directories ({'; '.join(groups)}). "
        "A checkpoint is written by every process into one directory: pass one "
        "path that every process sees, on a file system every host mounts (NFS, "
        "a bucket mounted with gcsfuse...). A default under the temporary "
        "directory differs between processes: `keras-dist launch` gives each "
        "rank its own TMPDIR."
    )


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(rank) for rank in ranks[:5])
    more = f" and {len(ranks) - 5} more" if len(ranks) > 5 else ""
    return f"ranks {shown}{more}"
