"""Step directories: how a checkpoint appears atomically and is found again.

```
<directory>/step-000000120/        a committed checkpoint
    keras_dist.json                its manifest, written last
    <the engine's files>           Orbax / torch DCP / tf.train.Checkpoint
<directory>/.tmp-step-000000120/   being written; never read, removed when stale
```

Process 0 creates the temporary directory, every process writes its part into
it (the engine), then process 0 lists every file with its size in the
manifest, writes the manifest and renames the directory: a process killed at
any moment leaves the previous checkpoint or the new one, never a half one
that a restore would pick. A step directory counts only when its manifest
parses and every file it lists is there with the listed size.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any

MANIFEST = "keras_dist.json"
FORMAT_VERSION = 1
_STEP = re.compile(r"^step-(\d+)$")
_TEMPORARY = re.compile(r"^\.tmp-step-(\d+)$")
# What every manifest holds (`commit` adds "format", "step" and "files").
_MANIFEST_KEYS = ("engine", "entries", "step")


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def local_directory(directory: str | os.PathLike, what: str) -> str:
    """`directory` as an absolute path of this machine's file system, which
    the manifest, the renames and the engines' files all need. A URL
    (`gs://bucket/run`) is refused rather than written under a local
    directory named after its scheme (`./gs:/bucket/run`)."""
    path = os.fspath(directory)
    url = _URL.match(path)
    if url is not None:
        raise ValueError(
            f"{what} reads and writes a directory of the file system, not a URL: "
            f"{path!r} would be a local directory named {url.group(1) + ':'!r}. "
            "Mount the bucket on every host (Cloud Storage FUSE: `gcsfuse "
            "--implicit-dirs BUCKET /mnt/BUCKET`, or an NFS share) and pass the "
            f"mounted path, e.g. '/mnt/BUCKET/run'. Received: directory={path!r}"
        )
    return os.path.abspath(path)


def directory_problem(directory: str) -> str | None:
    """Why `directory` cannot hold checkpoints, judged from what exists (no
    file is created): it is a file, or lies under one. None when it can."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        return (
            f"kd.Checkpoint: the checkpoint directory {directory!r} is a file, "
            "not a directory (or a link to none). Pass a directory (it is "
            "created if missing), or move the file away."
        )
    parent = os.path.dirname(directory)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        return (
            f"kd.Checkpoint: the checkpoint directory {directory!r} lies under "
            f"{parent!r}, which is a file, not a directory: it cannot be "
            "created. Pass a directory whose parents are directories, or move "
            "the file away."
        )
    return None


def ensure_writable(directory: str, rank: int) -> None:
    """Create `directory` if missing and write (and remove) a probe file in it,
    as this process will write its shards there: a `ValueError` (a file in the
    way) or `PermissionError` naming the directory and the fix, rather than
    the first save's bare `OSError`."""
    problem = directory_problem(directory)
    if problem is not None:
        raise ValueError(problem)
    probe = os.path.join(directory, f".keras_dist-write-test-{rank}-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(descriptor)
        os.remove(probe)
    except (FileExistsError, NotADirectoryError) as error:
        # Made a file since the check above (another process, a race).
        raise ValueError(
            directory_problem(directory)
            or f"kd.Checkpoint: cannot create the checkpoint directory "
            f"{directory!r}: {error}"
        ) from error
    except OSError as error:
        raise PermissionError(
            f"kd.Checkpoint: process {rank} cannot write into the checkpoint "
            f"directory {directory!r} ({type(error).__name__}: {error}). Every "
            "process writes its shards there: pass a directory every process "
            "can write, or give this user write permission (`chmod u+w`)."
        ) from error


def step_directory(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{int(step):09d}")


def temporary_directory(directory: str, step: int) -> str:
    return os.path.join(directory, f".tmp-step-{int(step):09d}")


def prepare(directory: str, step: int) -> str:
    """Process 0, before every process writes step `step`: an empty temporary
    directory for it (one a killed save left is removed first)."""
    os.makedirs(directory, exist_ok=True)
    temporary = temporary_directory(directory, step)
    if os.path.lexists(temporary):
        shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    return temporary


def commit(directory: str, step: int, manifest: dict[str, Any]) -> str:
    """Process 0, once every process wrote its part of step `step`: list the
    files, write the manifest and rename the temporary directory to
    `step-<N>`. Returns the committed directory."""
    temporary = temporary_directory(directory, step)
    files = {}
    for root, _, names in os.walk(temporary):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, temporary)] = os.path.getsize(path)
    manifest = {**manifest, "format": FORMAT_VERSION, "step": int(step), "files": files}
    _write_durably(os.path.join(temporary, MANIFEST), json.dumps(manifest, indent=1))
    final = step_directory(directory, step)
    if os.path.lexists(final):  # the same step saved again (a resumed run)
        old = final + ".replaced"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(temporary, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(temporary, final)
    _sync_directory(directory)
    return final


def read_manifest(step_path: str) -> dict[str, Any]:
    """The manifest of a committed step directory; `ValueError` naming the
    file and what is wrong with it when the checkpoint is not complete."""
    path = os.path.join(step_path, MANIFEST)
    try:
        with open(path, encoding="utf-8") as file:
            manifest = json.load(file)
    except FileNotFoundError:
        raise ValueError(
            f"{step_path} is not a complete keras_dist checkpoint: it has no "
            f"{MANIFEST} (the save that wrote it did not finish)."
        ) from None
    except (OSError, ValueError) as error:  # JSON and UTF-8 errors included
        raise ValueError(
            f"{step_path} is not a complete keras_dist checkpoint: its manifest "
            f"{path} cannot be read ({type(error).__name__}: {error})."
        ) from error
    if not isinstance(manifest, dict):
        raise ValueError(
            f"{step_path} is not a complete keras_dist checkpoint: its manifest "
            f"{path} holds a {type(manifest).__name__}, not a JSON object."
        )
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{step_path} has checkpoint format {manifest.get('format')!r}; this "
            f"keras_dist reads format {FORMAT_VERSION}. Upgrade keras_dist."
        )
    missing = [key for key in _MANIFEST_KEYS if key not in manifest]
    files = manifest.get("files")
    if missing or not isinstance(files, dict):
        raise ValueError(
            f"{step_path} is not a complete keras_dist checkpoint: its manifest "
            f"{path} lacks {missing or ['files']}."
        )
    for name, size in files.items():
        file_path = os.path.join(step_path, name)
        have = os.path.getsize(file_path) if os.path.isfile(file_path) else None
        if have != size:
            state = "missing" if have is None else f"{have} bytes long"
            raise ValueError(
                f"{step_path} is not a complete keras_dist checkpoint: its file "
                f"{file_path} is {state}, its manifest lists {size} bytes (cut "
                "short or altered since the save)."
            )
    return manifest


def scan(directory: str) -> tuple[list[int], dict[int, str]]:
    """The steps of `directory` whose checkpoint is complete, in order, and
    the others (`step-<N>` directories that are not): step -> what is wrong."""
    steps, damaged = [], {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(directory):
            match = _STEP.match(name)
            if match is None:
                continue
            step = int(match.group(1))
            try:
                read_manifest(os.path.join(directory, name))
            except ValueError as error:
                damaged[step] = str(error)
            else:
                steps.append(step)
    return sorted(steps), damaged


def complete_steps(directory: str) -> list[int]:
    """The steps of `directory` whose checkpoint is complete, in order."""
    return scan(directory)[0]


def latest_step(directory: str) -> int | None:
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def prune(directory: str, keep: int, *, protect: int | None = None) -> list[int]:
    """Remove all but the newest `keep` complete checkpoints (never
    `protect`), and temporary directories of steps older than the newest
    complete one (saves killed outright). Returns the removed steps."""
    steps = complete_steps(directory)
    removed = [step for step in steps[: max(len(steps) - keep, 0)] if step != protect]
    for step in removed:
        # Renamed first: a process killed while removing it leaves a temporary
        # directory (removed by the next prune), never a torn `step-<N>`.
        doomed = temporary_directory(directory, step)
        shutil.rmtree(doomed, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.replace(step_directory(directory, step), doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    newest = steps[-1] if steps else None
    if newest is None:
        return removed
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            # Left by processes killed outright: unfinished saves, torn
            # removals, a replaced step of a commit cut short.
            replaced = name.endswith(".replaced")
            match = _TEMPORARY.match(name) or _STEP.match(name)
            older = match is not None and int(match.group(1)) < newest
            unfinished = name.startswith(".") or (
                match is not None and int(match.group(1)) not in steps
            )
            if replaced or (older and unfinished):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return removed


def _write_durably(path: str, text: str) -> None:
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _sync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
