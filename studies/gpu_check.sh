#!/usr/bin/env bash
# Run once on a machine with an NVIDIA GPU, after `./install.sh --test` with a CUDA
# build of torch: is the CUDA path right, and how fast is compiled decoding there.
# Each step has a time limit, about 10 minutes of GPU time in all; what a step
# writes lands in its study's folder under results/, and a step that fails or runs
# out of time is noted in results/gpu_check/gpu_check.txt and the next one runs anyway.
set -uo pipefail
# The studies run as modules from the repository root, one folder up.
cd "$(dirname "$0")/.."
mkdir -p results/gpu_check results/bench results/scaling
log=results/gpu_check/gpu_check.txt

step() {  # step SECONDS COMMAND...: run it under a time limit, note how it ended
    local limit=$1; shift
    echo "== $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local status=${PIPESTATUS[0]}
    if [ "$status" -eq 124 ]; then echo "!! stopped: over its ${limit} s" | tee -a "$log"
    elif [ "$status" -ne 0 ]; then echo "!! failed: exit $status" | tee -a "$log"; fi
}

python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA GPU \
visible to torch (is it a CUDA build?); this check needs one')" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$log"
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)" | tee -a "$log"

# 1. Correctness on the tiny test model: the golden output, CPU = GPU for both
#    caches, compiled decode = eager (also as a CUDA graph), bfloat16.
step 150 python -m pytest -q tests/test_cuda.py

# 2. Speed against transformers, SmolLM2-135M in bfloat16, prompt 512, batch 1
#    and 8, eager and compiled (compiling is timed apart), with the roofline.
step 210 python -m studies.bench --device cuda --dtype bfloat16 --batch 1 8 --runs 3 \
    --idle-wait 0 --out results/bench/bench_cuda.md

# 3. The compiled decode step replayed as a CUDA graph, batch 1.
step 90 python -m studies.bench --device cuda --dtype bfloat16 --batch 1 --compile only \
    --compile-mode reduce-overhead --runs 3 --idle-wait 0 --out results/bench/bench_cuda_graphs.md

# 4. Scaling, reduced to one run per cell and eager rows (compiling every cell
#    takes longer than this check allows): prompt 512 and 8k (cut to 8064 so that
#    128 new tokens fit), batch 1 and 16 at 2k.
step 150 python -m studies.scaling --device cuda --dtype bfloat16 --compile none \
    --lengths 512 8192 --batches 1 16 --profile-tokens 128 --runs 1 --idle-wait 0 \
    --out results/scaling/scaling_cuda

# The full sweep with compiled rows, when there is time (minutes per compiled cell):
#   python -m studies.scaling --device cuda --dtype bfloat16 --idle-wait 0 \
#       --out results/scaling/scaling_cuda_full
echo "done; results/gpu_check/gpu_check.txt, results/bench/bench_cuda*.md,"\
    "results/scaling/scaling_cuda.*" | tee -a "$log"
