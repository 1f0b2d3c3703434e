#!/usr/bin/env bash
# The one prepared GPU check: the CUDA tests, then the GPU benchmarks, on one CUDA GPU in under 8
# minutes (each step has its own time limit, together 445 s, so a hang in one cannot eat the whole
# device lease).
# It uses the machine's own torch / triton / transformers (versions printed first) and installs
# quantkit itself without dependencies. Logs and tables go to $OUT (the device tool's return
# folder) or ./gpu-check-out; at most 8 files.
#
#   bash scripts/gpu_check.sh                 # every step
#   bash scripts/gpu_check.sh tests graph     # some of them
#
# Steps: tests (tests/test_gpu.py, test_kernels.py, test_quant_linear.py and the engine's Triton
# tests on real CUDA tensors), kernels and graph (bench_kernels.py: Triton W4A16 / W8A8 against
# cuBLAS fp16 and PyTorch's int4 kernel, eager calls, then replayed from CUDA graphs so that launch
# overhead drops out), decode8b (bench_decode_8b.py: Llama-3-8B-shaped batch-1 decode, transformers
# fp16, then the engine fp16 and int4 each eagerly and with its decode step replayed from a CUDA graph
# (engine.static_step, issue #49), with the ratios graph/eager, int4/fp16 and achieved weight
# bandwidth), gptq (bench_gptq_gpu.py on the demo's shape: GPTQ wall time, cuda against the machine's
# cpu cores). Not run by default: gptq8b (the same on two Llama-3-8B-shaped layers, ~1-2 min).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
START=$(date +%s)

step() {  # step NAME LIMIT_S CMD...: runs CMD under a time limit, log to $OUT/NAME.log, one summary line
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 60 "$OUT/$name.log"
    echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
}

$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/env.txt" 2>&1
$PY -c "import quantkit" 2>/dev/null || { echo "editable install failed: using PYTHONPATH=$PWD" >> "$OUT/env.txt"; export PYTHONPATH=$PWD; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    echo "cpu cores: $(nproc)"
    $PY -c "import torch, triton, transformers, quantkit; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'quantkit from', quantkit.__file__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name(0))"
} 2>&1 | tee -a "$OUT/env.txt"

STEPS=${*:-tests kernels graph decode8b gptq}
want() { [[ " $STEPS " == *" $1 "* ]]; }

# the tests take one fixed config per kernel: autotuning every shape they use would cost minutes
want tests && QUANTKIT_TRITON_AUTOTUNE=0 step tests 120 $PY -m pytest -q -p no:cacheprovider \
    -o addopts="-ra --durations=10" -m "not slow" -k "test_gpu or test_kernels or triton or cuda or paged" \
    tests/test_gpu.py tests/test_kernels.py tests/test_quant_linear.py tests/test_engine.py
want kernels && step kernels 70 $PY scripts/bench_kernels.py --ms 1,16,1024 --warmup 10 --rep 50 --overhead
want graph && step graph 70 $PY scripts/bench_kernels.py --ms 1,16,1024 --warmup 10 --rep 50 --cuda-graph
want decode8b && step decode8b 140 $PY scripts/bench_decode_8b.py --device cuda --cuda-graph both \
    --json "$OUT/decode8b.json"
want gptq && step gptq 45 $PY scripts/bench_gptq_gpu.py --shapes smollm2-135m
want gptq8b && step gptq8b 130 $PY scripts/bench_gptq_gpu.py --shapes llama3-8b --devices cuda --big-layers 1

echo "=== all steps in $(( $(date +%s) - START ))s" | tee -a "$OUT/summary.txt"
cat "$OUT/summary.txt"
