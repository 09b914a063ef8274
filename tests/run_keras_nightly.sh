#!/usr/bin/env bash
# The Keras-facing tests on keras-nightly (the Keras 3.16 dev build pinned in
# constraints/keras-nightly.txt), in a virtual environment of their own
# (.venv-nightly): keras-nightly installs as the `keras` package, so it cannot
# share one with Keras 3.15. Which tests: tests/keras_nightly_tests.txt.
#
# Where the Keras 3.15 environment of the README's test command exists (.venv,
# or KERAS_NIGHTLY_BASE_VENV), the nightly one holds keras-nightly only and
# reads every other package from it (a .pth file adds its site-packages after
# its own, so its `keras` is the nightly): the same backends and test tools,
# installed once. Without it, or with KERAS_NIGHTLY_BASE_VENV=none, everything
# is installed into .venv-nightly.
# Usage: tests/run_keras_nightly.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KERAS_NIGHTLY_VENV:-.venv-nightly}"
base="${KERAS_NIGHTLY_BASE_VENV:-.venv}"
[ -x "$venv/bin/python" ] || "${PYTHON_FOR_VENV:-python3.11}" -m venv "$venv"
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
shared="$(site_of "$venv")/keras_dist_base_venv.pth"
if [ "$base" != none ] && [ -x "$base/bin/python" ]; then
  echo "import site; site.addsitedir('$(cd "$(site_of "$base")" && pwd)')" > "$shared"
else
  rm -f "$shared"
  # The three backends and the test tools: the listed tests need neither Ray,
  # KerasHub nor the docs packages.
  "$venv/bin/pip" install -q -c constraints/cpu.txt -e ".[jax,torch,tensorflow-cpu,test]"
  # The release Keras out (both are the `keras` package).
  "$venv/bin/pip" uninstall -q -y keras 2>/dev/null || true
fi
# The pinned nightly in (uninstalled first, so that a reused venv gets whole
# files); its dependencies that are already there are kept.
"$venv/bin/pip" uninstall -q -y keras-nightly 2>/dev/null || true
"$venv/bin/pip" install -q -c constraints/keras-nightly.txt keras-nightly
"$venv/bin/python" -c "import keras; print('keras', keras.__version__, 'from', keras.__path__[0])"
tests=$(grep -v '^#' tests/keras_nightly_tests.txt | tr '\n' ' ')
KERAS_DIST_TESTS="$tests" PYTHON="$venv/bin/python" tests/run_all_backends.sh "$@"
