#!/usr/bin/env bash
# Runs the whole suite once per Keras backend (the backend is fixed per process).
# Usage: tests/run_all_backends.sh [extra pytest args]
# KERAS_DIST_TESTS names what to run (default: the whole suite, `tests`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
status=0
# Two xdist workers for this project's 2-core machines (three were measured:
# no faster, the multi-process tests already fill the cores).
workers="${KERAS_DIST_TEST_WORKERS:-2}"
# JAX's persistent compilation cache, new for this run and removed after it:
# the many JAX processes the tests start (workers, launched jobs, docs blocks)
# compile the same small steps again and again. It only skips XLA's compile of
# a program already compiled in this run (same program, devices and flags); the
# trace, the sharding and every check run as before. Measured on the JAX
# multi-process, checkpoint and training modules: 163 s -> 137 s.
# (tests/run_suite.sh gives one to this run and the keras-nightly one.)
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d -t keras-dist-jax-cache.XXXXXX)"
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
  export JAX_COMPILATION_CACHE_DIR
fi
# Every program, however small or quick to compile.
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="${JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES:--1}"
# Our own modules compiled to bytecode once, as pip compiles what it installs:
# where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) every process the
# tests start would otherwise compile keras_dist and the tests from source
# (half a second each; the interpreter still reads the cached files).
"$PYTHON" -m compileall -q keras_dist integrations tests benchmarks examples > /dev/null
# One thread per process for the CPU math of torch (OpenMP) and of the BLAS
# libraries: the two xdist workers and the processes of the jobs they start
# already fill the cores, and threads beyond them only wait for each other.
# Measured on the PyTorch multi-process modules (test_multiprocess_torch.py,
# test_fault_lifecycle.py): 406 s -> 364 s of test time.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
for backend in jax tensorflow torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  # JAX: 8 simulated devices; TensorFlow: 4 logical CPU devices (each replica
  # is a copy of the step in the graph: 8 took twice the time, for the same
  # proof); PyTorch: one device per process.
  devices=8
  [ "$backend" = tensorflow ] && devices=4
  [ "$backend" = torch ] && devices=""
  KERAS_BACKEND=$backend KERAS_DIST_CPU_DEVICES=$devices TF_CPP_MIN_LOG_LEVEL=2 \
    "$PYTHON" -m pytest -n "$workers" --dist worksteal -q "$@" ${KERAS_DIST_TESTS:-tests} || status=$?
done
exit $status
