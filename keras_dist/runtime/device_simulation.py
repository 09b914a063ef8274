"""`KERAS_DIST_CPU_DEVICES=N`: N simulated CPU devices in this process."""

from __future__ import annotations

import os

ENV_VAR = "KERAS_DIST_CPU_DEVICES"


def requested_cpu_devices(environ: dict[str, str] | None = None) -> int | None:
    """The device count asked for in the environment, validated."""
    raw = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(
            f"{ENV_VAR} must be a positive integer such as 8. Received: "
            f"{ENV_VAR}={raw!r}"
        )
    return int(raw)


def apply_from_environment() -> None:
    """Simulate the devices `KERAS_DIST_CPU_DEVICES` asks for, if it is set:
    only then is the backend imported (this runs at `import keras_dist`)."""
    count = requested_cpu_devices()
    if count is not None:
        # Lazily: without the variable, `import keras_dist` stays light.
        from keras_dist.backends import get_adapter  # noqa: PLC0415

        get_adapter().simulate_cpu_devices(count)
