#!/usr/bin/env bash
# One short GPU check (a few minutes on one GPU): what can only be measured on CUDA.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# OUT_DIR defaults to "$OUT/gpu_check" when $OUT is set (the device tool's folder that comes
# back), else runs/gpu_check-<UTC time>; a fresh folder each run, so a rerun after a partial
# failure never meets a half-written run. Steps, each with its own time limit and full log:
# 1. the gpu-marked tests (pinned host experts, copy stream + events, per-copy timing, lossless
#    offloaded decoding on CUDA) -> tests.log;
# 2. calibration.h2d on the real link: pinned and pageable H2D bandwidth against transfer size
#    -> h2d/ and h2d.log;
# 3. analysis.validate on CUDA with 3 repeats -> validate/ and validate.log: per-cycle cost-model
#    error and sim-vs-live throughput beside the GPU's own noise floor. On CUDA the link is the
#    real one: validate's --bandwidth value only labels the cells (bw64-...), it is not the link.
# Prints each step's figures; the last line is a JSON summary of the exit codes. Without a CUDA
# device it says so and exits 0.
set -uo pipefail
if [ -n "${1:-}" ]; then
    DIR="$1"
elif [ -n "${OUT:-}" ]; then
    DIR="$OUT/gpu_check"
else
    DIR="runs/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)"
fi
mkdir -p "$DIR"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    echo "no CUDA device here: nothing to check"
    echo '{"cuda": false}'
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv \
    | tee "$DIR/nvidia-smi.txt" || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

echo "== 1/3 gpu tests"
timeout 240 python -m pytest -q -m gpu tests > "$DIR/tests.log" 2>&1
tests_rc=$?
tail -15 "$DIR/tests.log"

echo "== 2/3 calibration.h2d (real link)"
timeout 120 python -m calibration.h2d --device cuda --sizes-mib 0.0625,0.25,1,4,16,64 \
    --out "$DIR/h2d" > "$DIR/h2d.log" 2>&1
h2d_rc=$?
tail -20 "$DIR/h2d.log"

echo "== 3/3 analysis.validate on CUDA (--bandwidth 64 is a label only)"
timeout 240 python -m analysis.validate --device cuda --bandwidth 64 --repeats 3 --num-prompts 4 \
    --max-new-tokens 32 --out "$DIR/validate" > "$DIR/validate.log" 2> "$DIR/validate.err"
validate_rc=$?
tail -22 "$DIR/validate.log"
[ "$validate_rc" -eq 0 ] || tail -20 "$DIR/validate.err"

echo "{\"cuda\": true, \"tests_rc\": $tests_rc, \"h2d_rc\": $h2d_rc, \"validate_rc\": $validate_rc, \"out\": \"$DIR\"}"
