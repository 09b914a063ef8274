"""Which platforms JAX starts, when keras_dist is imported after JAX."""

from __future__ import annotations

import jax


def default_platforms(platforms: str) -> bool:
    """Have JAX start only `platforms` (as `JAX_PLATFORMS` would), unless the
    user chose already (`jax.config.update("jax_platforms", ...)`). Returns
    whether it did. Before JAX's first computation only: after it the
    backends are started and this changes nothing."""
    if jax.config.jax_platforms is not None:
        return False
    jax.config.update("jax_platforms", platforms)
    return True
