#!/usr/bin/env bash
# The wheels tests/run_gpu.sh installs on a GPU machine that has Python 3.12,
# JAX with its CUDA plugin and a CUDA torch but not Keras: Keras, KerasHub,
# orbax-checkpoint (kd.Checkpoint on JAX) and pytest, with what they need
# beyond the machine's own packages, at the versions of this machine's
# `.venv` (the ones the suite tests), into `.whl-gpu/` (git-ignored; the
# device tool's `carry` takes it along).
# Usage: tests/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.12}"
venv_python="${PYTHON:-.venv/bin/python}"
directory=".whl-gpu"
mkdir -p "$directory"
packages=(
  keras namex optree packaging keras-hub
  pytest pluggy iniconfig
  orbax-checkpoint etils typing_extensions msgpack prometheus_client pyyaml
  tensorstore aiofiles protobuf humanize simplejson psutil uvloop fsspec
  importlib_resources zipp
)
pinned=()
for package in "${packages[@]}"; do
  version="$("$venv_python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package")"
  pinned+=("$package==$version")
done
PIP_CONFIG_FILE=/dev/null "$venv_python" -m pip download -q --no-deps \
  --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$directory" "${pinned[@]}"
du -sh "$directory"
