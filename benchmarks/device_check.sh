#!/usr/bin/env bash
# Issue 9's checks on a lent GPU machine in one call (the device tool: `bash benchmarks/device_check.sh`,
# timeout_s 600): the GPU test modules, the GPU benchmark on Qwen2.5-0.5B with its acceptance lines, and the
# A/B of the fused GEMVs (SUPERSLM_NORM_GEMV_ROWS=0). The timeouts below sum to 570 s. Logs go to $OUT.
#
# The machine lacks llguidance and gguf: carry them as wheels for its Python 3.12 (carry: [".whl"]), made here by
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl llguidance gguf
set -uo pipefail
OUT=${OUT:-/tmp/superslm-device}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# the kernels against their references, graphs, overlap, int4/int8 on the device, bf16 agreement, deterministic
# mode on the Triton path (SmolLM2's real weights need a download the machine cannot make: skipped)
timeout 270 python3 -m pytest -q -p no:cacheprovider --maxfail=5 -k "not smollm2" \
  tests/test_kernels_rotate_gemv.py tests/test_kernels_norm_gemv.py tests/test_kernels_prepare_attention.py \
  tests/test_kernels_attention_rotate.py tests/test_kernels_rotate.py tests/test_kernels_triton.py tests/test_kernels_fused.py \
  tests/test_kernels_triton_more.py tests/test_kernels_triton_sampling.py tests/test_graphs.py \
  tests/test_overlap.py tests/test_quant_device.py tests/test_gpu_agreement.py tests/test_kernels_triton_invariant.py \
  tests/test_kernels_triton_delta.py tests/test_expert_cache.py 2>&1 | tee "$OUT/tests.log" | tail -25

# the acceptance workloads on Qwen2.5-0.5B (bf16 and int4 batch 1, batches 64 and 256, nano-vllm), with transformers
timeout 210 python3 benchmarks/gpu.py --models qwen2.5-0.5b 2>&1 | tee "$OUT/bench.log"

# the same batch-1 decodes without the fused GEMVs (dense norm_linear and the int4 prologues), for the A/B
SUPERSLM_NORM_GEMV_ROWS=0 timeout 90 python3 benchmarks/gpu.py --models qwen2.5-0.5b --workloads decode1 --quick \
  --no-peer 2>&1 | tee "$OUT/bench_rows0.log"
