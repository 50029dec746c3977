#!/usr/bin/env bash
# Every GPU figure from one short run (issue 27): at most 8 minutes on one H200, one flat JSON per part in
# $OUT and all of them merged into $OUT/gpu_suite.json (benchmarks/gpu_suite_merge.py). Parts, each under
# its own `timeout` so one hang cannot eat the budget; a failed part is recorded and the next one runs:
#   rollout      engine (eager, compiled) vs diffusers, images/s, peak memory and the engine's overhead over
#                its forwards: random SD3 of SD3.5-Medium's depth and width (24 blocks x 1536), bf16, 512x512
#   recipes      grpo, nft, awm, dpo, draft: seconds per step (rollout, train) and peak memory with LoRA on
#                that model; GRPO's on-policy |ratio - 1| in bf16 (exactly 0: grpo_on_policy_exact)
#   sync_debug   the denoise loop under torch.cuda.set_sync_debug_mode("error"), eager and compiled
#   weight_sync  the weight transports for the transformer's bytes in bf16, into a receiver process
# The device image lacks diffusers: its wheel travels in .wheels (here, once:
#     pip download diffusers==0.42.1 --no-deps -d .wheels
# ) and is installed with --no-deps. With the device tool (docs/benchmarks.md, "GPU suite"):
#     run(command="bash benchmarks/gpu_suite.sh", carry=[".wheels"], timeout_s=540)
# On a CPU: `bash benchmarks/gpu_suite.sh --dry-run` runs every part with tiny sizes and few steps (OUT
# defaults to a temporary folder; it exits non-zero unless every part wrote its JSON). `--parts a,b` runs
# only those parts (rollout, recipes, sync_debug, weight_sync).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
only=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --parts) only=",$2,"; shift ;;
        *) echo "gpu_suite.sh: unknown argument $1 (valid: --dry-run, --parts rollout,recipes,sync_debug,weight_sync)" >&2
           exit 2 ;;
    esac
    shift
done
out="${OUT:-}"
if [[ -z "$out" ]]; then out="$(mktemp -d -t flywheel-gpu-suite-XXXXXX)"; fi
mkdir -p "$out"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
parts=()

# part NAME SECONDS COMMAND...: run COMMAND under `timeout SECONDS`, its output in $out/NAME.txt, its exit
# code and wall seconds in $out/NAME.status (the command writes $out/NAME.json itself).
part() {
    local name="$1" limit="$2"
    shift 2
    [[ -n "$only" && "$only" != *",$name,"* ]] && return 0
    parts+=("$name")
    echo "== $name (timeout ${limit}s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1
    local code=$?
    echo "$code $((SECONDS - start))" >"$out/$name.status"
    tail -n 12 "$out/$name.txt"
    echo "== $name: exit $code after $((SECONDS - start))s"
}

if [[ $dry == 0 ]]; then
    python -c "import diffusers" 2>/dev/null || python -m pip install --quiet --no-deps --no-index .wheels/*.whl
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
    part rollout 160 python benchmarks/rollout_vs_diffusers.py --device cuda --dtype bfloat16 --large --layers 24 \
        --batch 8 --steps 10 --rounds 3 --json "$out/rollout.json"
    part recipes 180 python benchmarks/recipe_steps.py --size medium --steps 2 --sampler-steps 10 --dtype bfloat16 \
        --timeout 50 --json "$out/recipes.json"
    part sync_debug 50 python benchmarks/sync_debug.py --device cuda --dtype bfloat16 --large \
        --json "$out/sync_debug.json"
    part weight_sync 60 python benchmarks/weight_sync.py --quick --large-mb 3850 --json "$out/weight_sync.json"
else  # about 1 CPU-minute in all (timeouts sized for a loaded shared machine)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    part rollout 300 python benchmarks/rollout_vs_diffusers.py --batch 2 --steps 2 --rounds 1 \
        --json "$out/rollout.json"
    part recipes 300 python benchmarks/recipe_steps.py --quick --in-process --json "$out/recipes.json"
    part sync_debug 300 python benchmarks/sync_debug.py --quick --json "$out/sync_debug.json"
    part weight_sync 200 python benchmarks/weight_sync.py --quick --large-mb 8 --batch 4 --json "$out/weight_sync.json"
fi
if [[ ${#parts[@]} == 0 ]]; then echo "gpu_suite.sh: --parts ${only//,/ } names no part" >&2; exit 2; fi
python benchmarks/gpu_suite_merge.py "$out" "${parts[@]}"
code=$?
echo "figures in $out (gpu_suite.json)"
exit $code
