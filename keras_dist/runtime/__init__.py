"""Devices, processes and joining a multi-process job (`api`), and the
simulated CPU devices of `KERAS_DIST_CPU_DEVICES` (`device_simulation`)."""
