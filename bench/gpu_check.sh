#!/usr/bin/env bash
# One prepared GPU check (issue 10) for a machine with one NVIDIA GPU (sized for an H200) and no
# network; finishes in under 8 minutes. Run from anywhere:
#
#   bash bench/gpu_check.sh            # OUT=./gpu-out by default; JSON lands there
#   bash bench/gpu_check.sh --dry-run  # CPU only: same steps, small sizes, installs nothing
#   bash bench/gpu_check.sh --stage    # on a machine WITH network: fill $WHEELS for the above
#
# Steps: (1) install what is missing from the wheels carried beside this script ($WHEELS,
# default bench/wheels: `--stage` downloads them with `pip download`, or copy them there by hand;
# carry that folder with the checkout) and build csrc/ in place if it is not built; (2) the
# GPU-marked tests (tests/engine/test_flashinfer_gpu.py: flashinfer token-identical to the torch backend
# in fp32, logits within 5% in bf16; tests/connector/native/test_gpu.py: loads into / offloads from a CUDA
# pool bit for bit, the GPU re-rotation within 1e-5 of the native host op) and the native-op
# tests against their fallbacks; (3) bench.gpu_load: host->GPU load bandwidth of the connector
# against a plain pinned torch copy, and TTFT cold vs warm from the daemon's cpu tier.
# Every step runs under what is left of one 460 s budget, so the whole check ends within 8 min.
# Results: $OUT/gpu_check.json (steps, exit codes, seconds), $OUT/gpu_load.json, $OUT/*.log.
# Env: PY (python, default: .venv/bin/python if present, else python3), OUT, WHEELS,
# TIERKV_GPU_CHECK_MODEL (model directory; default SmolLM2-135M).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
cd "$root"
mode=${1:-run}
case "$mode" in run | --dry-run | --stage) ;; *) echo "usage: $0 [--dry-run|--stage]" >&2; exit 2 ;; esac
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-./gpu-out}
WHEELS=${WHEELS:-$here/wheels}
MODEL=${TIERKV_GPU_CHECK_MODEL:-}
# import name:wheel name of what the GPU run needs beyond `make setup`
NEEDS=("flashinfer:flashinfer-python" "pytest_timeout:pytest-timeout")

if [ "$mode" = --stage ]; then
    mkdir -p "$WHEELS"
    exec "$PY" -m pip download --only-binary=:all: -d "$WHEELS" "${NEEDS[@]#*:}"
fi

mkdir -p "$OUT"
steps=()
BUDGET_S=${TIERKV_GPU_CHECK_BUDGET_S:-460}  # the whole check, every step included (< 8 min)
end=$(($(date +%s) + BUDGET_S))
record() { steps+=("$1 $2 $3 ${4:-}"); echo "gpu_check: $1 -> rc $2 in ${3}s ${4:-}" >&2; }
run_step() {  # name timeout_s command... (the timeout is cut to what is left of the budget)
    local name=$1 limit=$2 t0 rc left
    shift 2
    left=$((end - $(date +%s)))
    if ((left < 5)); then
        record "$name" 124 0 "out-of-budget"
        return 124
    fi
    ((limit > left)) && limit=$left
    t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    record "$name" "$rc" "$(($(date +%s) - t0))"
    return "$rc"
}

# (1) what is missing, installed from the carried wheels only
missing=()
for need in "${NEEDS[@]}"; do
    "$PY" -c "import ${need%%:*}" 2>/dev/null || missing+=("${need#*:}")
done
if ((${#missing[@]} == 0)); then
    record install 0 0 "nothing-missing"
elif [ "$mode" = --dry-run ]; then
    record install 0 0 "would-install:$(IFS=,; echo "${missing[*]}")"
elif [ -d "$WHEELS" ]; then
    run_step install 120 "$PY" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}"
else
    record install 1 0 "missing:$(IFS=,; echo "${missing[*]}"):no-wheels-in:$WHEELS"
fi
if "$PY" -c "import sys; from connector import native; sys.exit(native.status().impl != 'native')" 2>/dev/null; then
    record build 0 0 "native-already-built"
else
    run_step build 120 "$PY" setup.py build_ext --inplace
fi

# (2) tests: GPU-marked ones (only collected in a dry run) and the native ops against their fallbacks
if [ "$mode" = --dry-run ]; then
    run_step gpu_tests 120 "$PY" -m pytest -q -m gpu --collect-only tests/
else
    run_step gpu_tests 180 "$PY" -m pytest -q -ra -m gpu tests/
fi
# (a dry run collects them only: `make test` runs them already, and collecting checks the paths)
collect=()
[ "$mode" = --dry-run ] && collect=(--collect-only)
run_step native_tests 120 "$PY" -m pytest -q -x "${collect[@]}" tests/connector/native/test_ops.py tests/connector/native/test_kernels.py \
    tests/connector/native/test_batch.py tests/connector/native/test_rope.py tests/connector/native/test_staging.py tests/connector/test_loader_copy_verify.py \
    tests/kvstore/test_shm_arena.py

# (3) figures
if [ "$mode" = --dry-run ]; then
    args=(--device cpu --pages 4 --doc-tokens 64 --reps 1)
else
    args=(--device cuda --pages 512 --doc-tokens 2048 --reps 5)
fi
run_step gpu_load 240 "$PY" -m bench.gpu_load --out "$OUT/gpu_load.json" --model "$MODEL" "${args[@]}"

"$PY" - "$OUT/gpu_check.json" "$mode" "${steps[@]}" <<'EOF'
import json, os, sys
out, mode, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
steps = []
for r in rows:
    name, rc, secs, *note = r.split(" ", 3)
    steps.append({"step": name, "rc": int(rc), "seconds": int(secs), "note": (note[0] if note else "").strip()})
ok = all(s["rc"] == 0 for s in steps)
json.dump({"mode": mode, "ok": ok, "steps": steps, "load_avg": os.getloadavg()[0]}, open(out, "w"), indent=2)
print(json.dumps({"ok": ok, "failed": [s["step"] for s in steps if s["rc"]]}))
sys.exit(0 if ok else 1)
EOF
