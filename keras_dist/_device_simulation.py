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
    """Configure the devices `KERAS_DIST_CPU_DEVICES` asks for; without it,
    nothing is imported (neither Keras nor a backend)."""
    count = requested_cpu_devices()
    if count is not None:
        from keras_dist.backends import get_adapter  # noqa: PLC0415 (heavy)

        get_adapter().simulate_cpu_devices(count)
