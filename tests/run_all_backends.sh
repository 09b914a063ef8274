#!/usr/bin/env bash
# Runs the whole suite once per Keras backend (the backend is fixed per process).
# Usage: tests/run_all_backends.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
status=0
# Three xdist workers on a 2-core machine: many tests wait (on peers, on
# timeouts they check, on child processes starting), so two left a fifth of the
# CPU idle; measured, three keep it busy.
workers="${KERAS_DIST_TEST_WORKERS:-3}"
for backend in jax tensorflow torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  devices=8
  [ "$backend" = torch ] && devices=""  # torch: one device per process
  KERAS_BACKEND=$backend KERAS_DIST_CPU_DEVICES=$devices TF_CPP_MIN_LOG_LEVEL=2 \
    "$PYTHON" -m pytest -n "$workers" -q "$@" tests || status=$?
done
exit $status
