#!/usr/bin/env bash
# The GPU check issue 3 names (rollout_vs_diffusers on the large random SD3 in bf16), as one prepared
# script for the device tool. Its image has torch, accelerate, peft and transformers but not diffusers,
# so the wheel travels with the tree. Here, once:
#     pip download diffusers==0.42.1 --no-deps -d .wheels
# then, with the device tool:  run(command="bash benchmarks/gpu_check.sh", carry=[".wheels"], timeout_s=420)
# benchmarks/gpu_suite.sh runs this figure among every other GPU figure (prefer it).
# The figures come back in $OUT (rollout_vs_diffusers_gpu.json and .txt). If an import fails there,
# download that package's wheel into .wheels as well.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --no-deps --no-index .wheels/*.whl
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
out="${OUT:-.}"
export HF_HUB_OFFLINE=1
timeout 360 python benchmarks/rollout_vs_diffusers.py --device cuda --dtype bfloat16 --large --rounds 3 \
    --json "$out/rollout_vs_diffusers_gpu.json" 2>&1 | tee "$out/rollout_vs_diffusers_gpu.txt"
