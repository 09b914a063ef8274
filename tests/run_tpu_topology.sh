#!/usr/bin/env bash
# The compiled plan on TPU topologies (tests/test_compiled_plan.py), in a
# virtual environment of its own (.venv-tpu) that adds libtpu, the version the
# installed JAX pairs with (its `tpu` extra), to the README's test environment
# (.venv, or KERAS_TPU_BASE_VENV): a .pth file reads every other package from
# there. libtpu stays out of .venv: JAX processes that start it before
# importing keras_dist print its errors about this host not being a TPU VM
# (keras_dist quiets them: tests/test_tpu_host.py).
# Usage: tests/run_tpu_topology.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KERAS_TPU_VENV:-.venv-tpu}"
base="${KERAS_TPU_BASE_VENV:-.venv}"
[ -x "$base/bin/python" ] || { echo "$base: run the README's test set-up first" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "${PYTHON_FOR_VENV:-python3.11}" -m venv "$venv"
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
echo "import site; site.addsitedir('$(cd "$(site_of "$base")" && pwd)')" \
  > "$(site_of "$venv")/keras_dist_base_venv.pth"
# The libtpu pin of the installed JAX's `tpu` extra (e.g. libtpu==0.0.42.*).
pin=$("$base/bin/python" -c 'import importlib.metadata as m; print(next(r.split(";")[0].strip() for r in m.requires("jax") if r.startswith("libtpu") and "tpu" in r.split(";")[1]))')
"$venv/bin/pip" install -q --no-deps "$pin"
export TPU_SKIP_MDS_QUERY=1 TF_CPP_MIN_LOG_LEVEL=2
# The tests that need libtpu (the rest of these files ran in the JAX run);
# test_tpu_host.py: with libtpu installed, a CPU run and a plan print nothing
# of libtpu's.
KERAS_BACKEND=jax KERAS_DIST_CPU_DEVICES=8 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  -k "tpu or slice or platform" "$@" tests/test_compiled_plan.py tests/test_plan_search.py \
  tests/test_tpu_host.py
