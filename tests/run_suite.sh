#!/usr/bin/env bash
# The whole suite, as the README's test command and CI run it: every test on the
# three backends on Keras 3.15 (tests/run_all_backends.sh), the Keras-facing
# tests on keras-nightly (tests/run_keras_nightly.sh), the plans compiled for
# TPU topologies (tests/run_tpu_topology.sh).
#
# The Keras 3.15 and keras-nightly runs share one JAX persistent compilation
# cache, new for this run and removed after it: Keras 3.16 traces most of the
# same steps to the same programs, and XLA's compile of a program already
# compiled in this run is skipped (the trace, the sharding and every check run
# as before). Measured on the nightly JAX tests: 134 s -> 70 s.
# Usage: tests/run_suite.sh [extra pytest args, for every run]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON="${PYTHON:-.venv/bin/python}"
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d -t keras-dist-jax-cache.XXXXXX)"
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
  export JAX_COMPILATION_CACHE_DIR
fi
tests/run_all_backends.sh "$@"
tests/run_keras_nightly.sh "$@"
# The TPU compiles without it: the plans are XLA's own compiles for a topology.
env -u JAX_COMPILATION_CACHE_DIR tests/run_tpu_topology.sh "$@"
