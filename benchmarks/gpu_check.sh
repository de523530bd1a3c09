#!/usr/bin/env bash
# One short GPU check (a few minutes on one GPU): what can only be measured on CUDA.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default OUT_DIR: runs/gpu_check)
#
# 1. the gpu-marked tests (pinned host experts, copy stream + events, per-copy timing, lossless
#    offloaded decoding on CUDA);
# 2. calibration.h2d on the real link: pinned and pageable H2D bandwidth against transfer size;
# 3. analysis.validate on CUDA (the real link; --bandwidth only labels the cells), 3 repeats, so
#    the per-cycle cost-model error and sim-vs-live throughput are shown beside the GPU's own
#    noise floor.
# Prints each step's figures; the last line is a JSON summary of the exit codes. Without a CUDA
# device it says so and exits 0. Each step has its own time limit so one hang cannot eat the slot.
set -uo pipefail
OUT="${1:-runs/gpu_check}"
mkdir -p "$OUT"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    echo "no CUDA device here: nothing to check"
    echo '{"cuda": false}'
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

timeout 240 python -m pytest -q -m gpu tests 2>&1 | tail -15
tests_rc=${PIPESTATUS[0]}

timeout 120 python -m calibration.h2d --device cuda --sizes-mib 0.0625,0.25,1,4,16,64 --out-dir "$OUT/h2d" 2>&1 | tail -20
h2d_rc=${PIPESTATUS[0]}

timeout 240 python -m analysis.validate --device cuda --bandwidth 64 --repeats 3 --num-prompts 4 \
    --max-new-tokens 32 --out "$OUT/validate" 2>/dev/null | tail -20
validate_rc=${PIPESTATUS[0]}

echo "{\"cuda\": true, \"tests_rc\": $tests_rc, \"h2d_rc\": $h2d_rc, \"validate_rc\": $validate_rc, \"out\": \"$OUT\"}"
