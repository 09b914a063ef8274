#!/usr/bin/env bash
# The Keras-facing tests on keras-nightly (the Keras 3.16 dev build pinned in
# constraints/keras-nightly.txt), in a virtual environment of their own
# (.venv-nightly): keras-nightly installs as the `keras` package, so it cannot
# share one with Keras 3.15. Which tests: tests/keras_nightly_tests.txt.
# Usage: tests/run_keras_nightly.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KERAS_NIGHTLY_VENV:-.venv-nightly}"
[ -x "$venv/bin/python" ] || "${PYTHON_FOR_VENV:-python3.11}" -m venv "$venv"
# The three backends and the test tools: the listed tests need neither Ray,
# KerasHub nor the docs packages.
"$venv/bin/pip" install -q -c constraints/cpu.txt -e ".[jax,torch,tensorflow-cpu,test]"
# The release Keras out, the pinned nightly in: both are the `keras` package
# (both uninstalled first, so that a reused venv gets whole files).
"$venv/bin/pip" uninstall -q -y keras keras-nightly 2>/dev/null || true
"$venv/bin/pip" install -q -c constraints/keras-nightly.txt keras-nightly
"$venv/bin/python" -c "import keras; print('keras', keras.__version__)"
tests=$(grep -v '^#' tests/keras_nightly_tests.txt | tr '\n' ' ')
KERAS_DIST_TESTS="$tests" PYTHON="$venv/bin/python" tests/run_all_backends.sh "$@"
