#!/usr/bin/env bash
# One pass on a lent CUDA machine (never CI): the bench table in bf16 against TRL, then the suite's
# fast directories on CUDA (their `device = "auto"` picks the GPU). Run from the repository root with a
# python3 that has a CUDA torch; the other packages come from wheels in .whl/ when that folder exists
# (`bash benchmarks/gpu_wheels.sh` fetches them). Logs go to $OUT (or local/gpu-bench);
# each step has its own time limit, so one failure leaves the others' figures.
# With BASE=<a checkout's src folder> (e.g. `.base/src` from `git archive HEAD src`, carried too),
# the engine's decode rate is also timed under both trees, alternately (engine_timing.py).
# STEPS picks and orders the steps (default: all, the suite first); a preflight runs before them.
# TORCH_CUDNN_SDPA_DEPRIORITIZED=1 (torch's own switch) keeps cuDNN attention, which builds a plan for
# every new shape, last in SDPA's order: the A/B that results/2026-12-04-h200.md asks for.
#
#     bash benchmarks/gpu.sh            # ~8 minutes on one H100/H200
set -u
out=${OUT:-local/gpu-bench}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# transformers 5.25 fetches hub kernels on CUDA by default: off for TRL too (rollout passes use_kernels=False)
export USE_HUB_KERNELS=0
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    site=/tmp/site:
else
    site=
fi
export PYTHONPATH=$site$PWD/src
# the tests start `rollout` from python's bin folder: without an install there, a wrapper
py_exe=$(python3 -c 'import sys; print(sys.executable)')
if [ ! -e "$(dirname "$py_exe")/rollout" ]; then
    printf '#!/bin/sh\nexec "%s" -m rollout.cli.main "$@"\n' "$py_exe" > "$(dirname "$py_exe")/rollout" \
        && chmod +x "$(dirname "$py_exe")/rollout"
fi
started=$(date +%s)

step() {  # step NAME LIMIT_S COMMAND...: run, keep the whole log under $out, print its tail
    local name=$1 limit=$2 t0 rc
    shift 2
    echo "== $name (limit ${limit}s, $(( $(date +%s) - started ))s in)"
    t0=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "   exit $rc after $(( $(date +%s) - t0 ))s"
    tail -n "${TAIL:-18}" "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import sys, torch, transformers, trl; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__, 'trl', trl.__version__, torch.cuda.get_device_name())"

# preflight (~20 s): the imports and one model load and generation on the GPU, both libraries' way,
# before any step spends device time (a missing or mismatched wheel fails every step alike)
if ! timeout 120 python3 - <<'PY'
import tempfile
from pathlib import Path

import datasets  # noqa: F401
import torch
import trl  # noqa: F401
from transformers import AutoModelForCausalLM

from rollout.inference import SamplingParams
from rollout.inference.hf_engine import load_hf_engine
from rollout.models.tiny import init_tiny_model

model_dir = init_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
engine = load_hf_engine(model_dir, dtype="bfloat16", device="cuda")
[[completion]] = engine.generate(["2+2="], SamplingParams(max_tokens=4, ignore_eos=True, seed=0))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
print("preflight ok:", completion.completion_tokens, "tokens generated;", sum(p.numel() for p in model.parameters()), "params")
PY
then
    echo "preflight failed: nothing else run (bash benchmarks/gpu_wheels.sh carries the venv's packages)"
    exit 1
fi

common=(--device cuda --dtype bfloat16 --threads 4)
for name in ${STEPS:-pytest-cuda grpo engine-ab generation sft dpo}; do
    case $name in
    pytest-cuda)
        TAIL=30 step pytest-cuda "${PYTEST_S:-140}" python3 -m pytest -q -n 8 -p no:cacheprovider --timeout 100 \
            --tb=short -rf ${PYTEST_ARGS:-tests/inference tests/rl tests/unit tests/test_snapshots.py} ;;
    grpo)  # the training pass in each layout (auto picks one of them) against TRL, interleaved
        step grpo "${GRPO_S:-170}" python3 benchmarks/grpo_step.py --model large --prompts 8 --generations 8 \
            --max-tokens 32 --steps 14 --warmup-steps 4 --repeats "${GRPO_REPEATS:-1}" --runs "${GRPO_RUNS:-rollout-cache,rollout-packed,trl}" \
            --reward-window 4 "${common[@]}" ;;
    engine-ab)
        if [ -n "${BASE:-}" ]; then  # one process per run, alternating trees (site: the carried wheels)
            step engine-ab "${AB_S:-100}" bash -c 'for i in $(seq "$4"); do for tree in "$1" "$2"; do
                PYTHONPATH=$3$tree python3 benchmarks/engine_timing.py --model mid --prompts 32 --max-tokens 64 \
                    --repeats "$5" --work-dir /tmp/gpu-bench-models "${@:6}" || exit; done; done' \
                _ "$BASE" "$PWD/src" "$site" "${AB_PAIRS:-3}" "${AB_REPEATS:-3}" "${common[@]}"
        fi ;;
    generation)  # the 48M model at batch 16 (issue 14's figure); the large model's naive loop ran past 80 s
        step generation "${GEN_S:-80}" python3 benchmarks/generation.py --models mid --mid-prompts 16 \
            --mid-max-tokens 64 --no-server --work-dir /tmp/gpu-bench-models "${common[@]}" ;;
    sft)
        step sft "${SFT_S:-170}" python3 benchmarks/sft_throughput.py --model large --data mixed --batch-size 32 \
            --steps 40 --warmup-steps 10 --repeats "${SFT_REPEATS:-2}" "${common[@]}" ;;
    dpo)  # arithmetic pairs (short rows: launch-bound on a GPU), a frozen reference scored every step
        step dpo "${DPO_S:-120}" python3 benchmarks/dpo_throughput.py --model large --batch-size 32 \
            --steps 40 --warmup-steps 10 --repeats "${DPO_REPEATS:-2}" "${common[@]}" ;;
    esac
done
echo "total $(( $(date +%s) - started ))s"
