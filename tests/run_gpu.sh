#!/usr/bin/env bash
# The GPU run, on one machine with an NVIDIA GPU (JAX with its CUDA plugin and
# a CUDA torch installed; Keras and the rest from the wheels of
# tests/gpu_wheels.sh in .whl-gpu/, when that folder is there): the GPU suite
# (tests/gpu/, JAX then PyTorch), the kd / plain speed ratios
# (benchmarks/gpu_speed.py), the Gemma-2B-shaped full fine-tune, kd and plain
# (benchmarks/gemma_full_finetune.py), and the Llama-3-8B-shaped fine-tune
# under an 80 GB cap (benchmarks/llama_8b_capped.py). Each step runs within
# what is left of the budget (KERAS_DIST_GPU_BUDGET_S, 540 s: 9 minutes), in
# that order; a step left without time is reported as not run. Two files in
# OUT_DIR: gpu_summary.json (every step's exit status, seconds, tests passed,
# failed and skipped, each benchmark's figures and the end of its log) and
# gpu_logs.tar.gz (every log). Exit status 1 when a step or a test failed.
# Usage: tests/run_gpu.sh [OUT_DIR]          (default: $OUT, else ./gpu-run)
#   KERAS_DIST_GPU_STEPS="suite_jax suite_torch speed_jax speed_torch
#     gemma_kd gemma_plain llama" picks steps (the 8B run needs most of 9
#     minutes by itself: KERAS_DIST_GPU_STEPS=llama in a second call, and
#     KERAS_DIST_GPU_LLAMA_LAYERS=N for a shallower decoder of the same width);
#   KERAS_DIST_GPU_TESTS_ON_CPU=1 with --smoke (the second argument) checks
#   this script on a machine without a GPU (tiny models; no GPU figures;
#   KERAS_DIST_GPU_CAP_SCALE=5 and KERAS_DIST_GPU_BUDGET_S=3000 give a slow
#   CPU the time).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-run}}"
smoke="${2:-}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# Each step's log, test report and figures go to a work folder; OUT_DIR gets
# two files: the summary and the work folder as gpu_logs.tar.gz (the device
# tool brings back at most 8 files).
work="$(mktemp -d -t keras-dist-gpu-run.XXXXXX)"
PYTHON="${PYTHON:-python3}"
budget="${KERAS_DIST_GPU_BUDGET_S:-540}"
began=$(date +%s)
steps="${KERAS_DIST_GPU_STEPS:-suite_jax suite_torch speed_jax speed_torch gemma_kd gemma_plain llama}"

site=/tmp/keras-dist-gpu-site
# The carried wheels, where this Python has no Keras of its own.
if ! "$PYTHON" -c "import keras" 2> /dev/null && compgen -G ".whl-gpu/*.whl" > /dev/null; then
  PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --isolated -q --no-index \
    --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl-gpu/*.whl \
    || { echo "installing .whl-gpu failed" >&2; exit 2; }
fi
export PYTHONPATH="$PWD:$PWD/integrations/ray:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
# The GPU's memory as each step needs it, not 75 % of it at the start: the
# suite's subprocesses share the GPU with the pytest process.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"

"$PYTHON" - > "$work/versions.json" 2>&1 <<'EOF'
import importlib.metadata as m, json, platform
versions = {"python": platform.python_version()}
for name in ("jax", "jaxlib", "torch", "keras", "keras-hub", "numpy", "orbax-checkpoint"):
    try:
        versions[name] = m.version(name)
    except m.PackageNotFoundError:
        versions[name] = None
try:
    import torch
    versions["torch_cuda"] = torch.version.cuda
    versions["torch_gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as error:
    versions["torch_error"] = str(error)
print(json.dumps(versions))
EOF

left() { echo $(( budget - ($(date +%s) - began) )); }

# run_step NAME CAP_SECONDS COMMAND...: runs within min(CAP, what is left),
# writing $work/NAME.log and a line of $work/steps.jsonl.
run_step() {
  local name="$1" cap="$2"
  shift 2
  case " $steps " in *" $name "*) ;; *) return 0 ;; esac
  local limit
  # KERAS_DIST_GPU_CAP_SCALE stretches each step's cap (a CPU's --smoke run).
  cap=$(( cap * ${KERAS_DIST_GPU_CAP_SCALE:-1} ))
  limit=$(left)
  [ "$cap" -lt "$limit" ] && limit="$cap"
  if [ "$limit" -lt 20 ]; then
    echo "{\"step\": \"$name\", \"status\": \"not run: the time budget was spent\"}" >> "$work/steps.jsonl"
    return 0
  fi
  echo "=== $name (at most ${limit} s) ==="
  local start rc
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$work/$name.log" 2>&1
  rc=$?
  tail -n 5 "$work/$name.log"
  echo "{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - start )), \"limit\": $limit}" >> "$work/steps.jsonl"
}

: > "$work/steps.jsonl"
bench_flag=()
[ "$smoke" = "--smoke" ] && bench_flag=(--smoke)
pytest_args=(-q -p no:cacheprovider -p no:xdist -rs --durations=10)

KERAS_BACKEND=jax run_step suite_jax 170 "$PYTHON" -m pytest "${pytest_args[@]}" \
  --junitxml="$work/suite_jax.xml" tests/gpu/test_jax_gpu.py
KERAS_BACKEND=torch run_step suite_torch 170 "$PYTHON" -m pytest "${pytest_args[@]}" \
  --junitxml="$work/suite_torch.xml" tests/gpu/test_torch_gpu.py
KERAS_BACKEND=jax run_step speed_jax 60 "$PYTHON" benchmarks/gpu_speed.py \
  --repeats 3 --json "$work/speed_jax.json" "${bench_flag[@]}"
KERAS_BACKEND=torch run_step speed_torch 40 "$PYTHON" benchmarks/gpu_speed.py \
  --repeats 3 --json "$work/speed_torch.json" "${bench_flag[@]}"
gemma=(--offload none --dtype mixed_bfloat16 --batch 8 --sequence 1024 --steps 4)
[ "$smoke" = "--smoke" ] && gemma=(--offload none --dtype mixed_bfloat16 --batch 2 --sequence 16 --steps 2 --layers 1 --smoke)
KERAS_BACKEND=jax run_step gemma_kd 100 "$PYTHON" benchmarks/gemma_full_finetune.py \
  "${gemma[@]}" --json "$work/gemma_kd.json"
KERAS_BACKEND=jax run_step gemma_plain 100 "$PYTHON" benchmarks/gemma_full_finetune.py \
  "${gemma[@]}" --plain --json "$work/gemma_plain.json"
llama=(--batch 4 --sequence 1024 --steps 4 --search-budget 90)
# A shallower decoder of the same width where 32 layers do not fit the time.
[ -n "${KERAS_DIST_GPU_LLAMA_LAYERS:-}" ] && llama+=(--layers "$KERAS_DIST_GPU_LLAMA_LAYERS")
[ "$smoke" = "--smoke" ] && llama=(--batch 2 --sequence 16 --steps 2 --search-budget 30 --smoke)
XLA_PYTHON_CLIENT_MEM_FRACTION="${KERAS_DIST_GPU_CAP_FRACTION:-0.55}" \
  XLA_PYTHON_CLIENT_PREALLOCATE=true KERAS_BACKEND=jax \
  run_step llama 600 "$PYTHON" benchmarks/llama_8b_capped.py "${llama[@]}" \
  --phase-timeout 400 --json "$work/llama_8b.json"

"$PYTHON" - "$work" "$out" <<'EOF'
import json, pathlib, sys, xml.etree.ElementTree as ElementTree
out = pathlib.Path(sys.argv[1])
destination = pathlib.Path(sys.argv[2])
summary = {"versions": None, "steps": {}}
try:
    summary["versions"] = json.loads((out / "versions.json").read_text().splitlines()[-1])
except Exception as error:
    summary["versions"] = {"error": str(error)}
for line in (out / "steps.jsonl").read_text().splitlines():
    step = json.loads(line)
    name = step.pop("step")
    junit = out / f"{name}.xml"
    if junit.exists():
        cases = ElementTree.parse(junit).getroot().iter("testcase")
        tests = {"passed": [], "failed": [], "skipped": []}
        for case in cases:
            label = case.get("name")
            if case.find("failure") is not None or case.find("error") is not None:
                tests["failed"].append(label)
            elif case.find("skipped") is not None:
                reason = case.find("skipped").get("message", "")
                tests["skipped"].append(f"{label}: {reason}")
            else:
                tests["passed"].append(label)
        step["tests"] = tests
    for result in sorted(out.glob(f"{name}*.json")):
        try:
            step[result.stem] = json.loads(result.read_text())
        except json.JSONDecodeError:
            step[result.stem] = {"error": "unreadable JSON"}
    log = out / f"{name}.log"
    if log.exists():
        step["log_tail"] = log.read_text(errors="replace")[-3000:]
    summary["steps"][name] = step
(destination / "gpu_summary.json").write_text(
    json.dumps(summary, indent=1, default=str)
)
failed = [
    name
    for name, step in summary["steps"].items()
    if step.get("exit") not in (0, None) or (step.get("tests") or {}).get("failed")
]
print(f"gpu_summary.json: {len(summary['steps'])} steps; failed: {failed or 'none'}")
sys.exit(1 if failed else 0)
EOF
status=$?
tar -czf "$out/gpu_logs.tar.gz" -C "$work" . && rm -rf "$work"
exit $status
