#!/usr/bin/env bash
# Keras' own trainer and callback tests, each `fit`/`evaluate`/`predict` under
# `kd.DistributeCallback(kd.DataParallel())` (tests/keras_own/plugin.py), and the
# same tests in plain Keras, on one backend; prints the tests that fail only
# under keras_dist. Not part of CI (about 10 minutes a backend on 2 cores).
# Usage: KERAS_BACKEND=tensorflow tests/keras_own/run.sh [more Keras test modules]
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
backend="${KERAS_BACKEND:?set KERAS_BACKEND to jax, tensorflow or torch}"
out="${KERAS_OWN_OUT:-keras-own-$backend}"
mkdir -p "$out"
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(keras.src.trainers.trainer_test keras.src.callbacks)
devices=8
[ "$backend" = torch ] && devices=""
run() {  # name, extra pytest args
  local name=$1; shift
  KERAS_DIST_CPU_DEVICES=$devices TF_CPP_MIN_LOG_LEVEL=2 "$PYTHON" -m pytest -q -n 2 \
    -p no:cacheprovider --junitxml="$out/$name.xml" "$@" --pyargs "${modules[@]}" \
    > "$out/$name.log" 2>&1
  tail -1 "$out/$name.log"
}
echo "plain Keras:"; run plain
echo "under keras_dist:"; run distributed -p tests.keras_own.plugin
"$PYTHON" - "$out" <<'PY'
import sys, xml.etree.ElementTree as ET
out = sys.argv[1]
def failed(name):
    root = ET.parse(f"{out}/{name}.xml").getroot()
    return {
        f"{case.get('classname')}::{case.get('name')}": (bad[0].get("message") or "")[:160]
        for case in root.iter("testcase")
        if (bad := case.findall("failure") + case.findall("error"))
    }
plain, distributed = failed("plain"), failed("distributed")
only = sorted(set(distributed) - set(plain))
print(f"fail only under keras_dist: {len(only)}")
for name in only:
    print(f"  {name}\n      {distributed[name]}")
PY
