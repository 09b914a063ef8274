#!/usr/bin/env bash
# The whole PyTorch suite on another torch release than CI's pinned CPU build
# (constraints/cpu.txt), by hand: PyPI's wheel of that release (a CUDA build,
# several GB, which runs on the CPU too) in a virtual environment of its own,
# `.venv-torch<VERSION>`, that reads every other package from the README's
# `.venv` (a .pth file adds its site-packages after its own, so its `torch` is
# the release asked for).
# Usage: tests/run_torch_release.sh VERSION [extra pytest args]
#   e.g. tests/run_torch_release.sh 2.15.0
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: tests/run_torch_release.sh VERSION [pytest args]}"
shift
venv=".venv-torch${version}"
base="${KERAS_DIST_BASE_VENV:-.venv}"
[ -x "$base/bin/python" ] || { echo "needs the README's $base first" >&2; exit 2; }
[ -x "$venv/bin/python" ] || "${PYTHON_FOR_VENV:-python3.11}" -m venv "$venv"
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
echo "import site; site.addsitedir('$(cd "$(site_of "$base")" && pwd)')" \
  > "$(site_of "$venv")/keras_dist_base_venv.pth"
# Without the machine's pip configuration: it may cap torch (a constraints file).
PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q "torch==${version}"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'from', torch.__path__[0])"
KERAS_BACKEND=torch "$venv/bin/python" -m pytest -n "${KERAS_DIST_TEST_WORKERS:-2}" \
  --dist worksteal -q "$@" tests
