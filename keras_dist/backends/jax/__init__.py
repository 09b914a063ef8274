"""The JAX backend: `jax.sharding` layouts, `jax.distributed` processes."""
