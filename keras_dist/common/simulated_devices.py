"""Why `KERAS_DIST_CPU_DEVICES` could not be applied, in words a user can act on.

keras_dist applies the variable when it is imported (`runtime.device_simulation`),
before the backend's runtime starts. When the runtime had started already, the
fix depends on how the variable got there: set when the process started, it was
`import keras_dist` that came after the backend's first computation; set while
the program ran, the variable itself may have. The process' initial environment
(`/proc/self/environ`, Linux) tells the two apart; elsewhere the message names
both fixes.
"""

from __future__ import annotations

ENV_VAR = "KERAS_DIST_CPU_DEVICES"
_INITIAL_ENVIRONMENT = "/proc/self/environ"


def set_when_the_process_started(
    count: int, *, path: str = _INITIAL_ENVIRONMENT
) -> bool | None:
    """Whether the environment this process started with had
    `KERAS_DIST_CPU_DEVICES` asking for `count` devices; None when that
    environment cannot be read (not Linux)."""
    try:
        with open(path, "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{ENV_VAR}=".encode()
    for entry in entries:
        if entry.startswith(prefix):
            raw = entry[len(prefix) :].decode(errors="replace").strip()
            return raw.isdigit() and int(raw) == count
    return False


def too_late_message(
    *,
    backend: str,
    requested: int,
    present: int,
    first_work: str,
    examples: str,
    set_at_start: bool | None,
) -> str:
    """The error for `KERAS_DIST_CPU_DEVICES=requested` when the backend's
    runtime had started already, with `present` CPU devices.

    Args:
        backend: the backend's name in the message, e.g. "JAX".
        requested: the count asked for.
        present: the CPU devices the running backend has.
        first_work: what starts the backend's runtime, e.g. "JAX computation".
        examples: code that does it, e.g. "jax.numpy, a Keras op, jax.devices()".
        set_at_start: `set_when_the_process_started(requested)`.
    """
    head = (
        f"{ENV_VAR}={requested} came too late: {backend} had already started, "
        f"with {present} CPU device(s), when keras_dist applied it"
    )
    before = f"before the first {first_work} ({examples})"
    if set_at_start:
        return (
            f"{head}. The variable was set when this process started, but keras_dist "
            "applies it when it is imported, and it was imported after the first "
            f"{first_work}. Import keras_dist {before}; import keras may come "
            "before or after it."
        )
    if set_at_start is False:
        return (
            f"{head}. The variable was set while the program ran (this process "
            f"started without it), and a {first_work} had run before keras_dist "
            f"applied it. Set it, and import keras_dist, {before}: in the "
            "environment that starts Python, or at the top of the program."
        )
    return (
        f"{head} (at import keras_dist). Set the variable, and import keras_dist, "
        f"{before}."
    )
