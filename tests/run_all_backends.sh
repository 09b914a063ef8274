#!/usr/bin/env bash
# Runs the whole suite once per Keras backend (the backend is fixed per process).
# Usage: tests/run_all_backends.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
status=0
for backend in jax tensorflow torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  devices=8
  [ "$backend" = torch ] && devices=""  # torch: one device per process
  KERAS_BACKEND=$backend KERAS_DIST_CPU_DEVICES=$devices TF_CPP_MIN_LOG_LEVEL=2 \
    "$PYTHON" -m pytest -n 2 -q "$@" tests || status=$?
done
exit $status
