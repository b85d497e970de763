#!/bin/bash
# One lent GPU's checks for mpgraph, in order of value, each bounded by `timeout` so one part's
# failure or hang leaves the rest their time. Run from the repository root on the GPU machine
# (the package need not be installed: the image's python3 with torch, transformers, pytest):
#   OUT=gpu_out bash examples/bench/gpu_session.sh          # ~6 minutes on an H200
# Writes at most 8 files under $OUT: info, the GPU tests, gpu_check at 1x16 and at the
# throughput sizes, the GPU's calibration file, bench_generate, gpu_host_diag, and the whole
# suite (T_SUITE seconds; 1 by default: skipped). A session's device time is 15 minutes, start
# included: run this once, with no helper using the device beside it.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
[ -e mpgraph/passes ] || ln -s ../passes mpgraph/passes   # (the installed package maps it)
export PYTHONPATH=$PWD:$PWD/examples/bench PYTHONUNBUFFERED=1
PY=${PY:-python3}
stamp() { echo "== $(date +%T) $*"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  $PY -c "import torch, transformers, onnxruntime as ort; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'onnxruntime', ort.__version__, ort.get_available_providers())"
  lscpu | grep -E 'Model name|^CPU\(s\)'; } > "$OUT/info.txt" 2>&1
stamp "GPU tests"; timeout ${T_TESTS:-110} $PY -m pytest -o addopts= -p no:cacheprovider -p no:warnings -q -n 12 -rfE \
  tests/test_cuda_graph.py tests/test_generate.py tests/test_large_models.py tests/test_profiling.py \
  tests/passes/test_contiguous_attention_mask.py \
  > "$OUT/tests_gpu.txt" 2>&1; echo "rc=$?" >> "$OUT/tests_gpu.txt"; tail -3 "$OUT/tests_gpu.txt"
stamp "gpu_check 1x16"; timeout ${T_B1:-90} $PY examples/bench/gpu_check.py --models bert gpt2 llama \
  --batch 1 --compile-models none --train-models > "$OUT/gpu_check_b1.txt" 2>&1; echo "rc=$?" >> "$OUT/gpu_check_b1.txt"
cp ~/.cache/mpgraph/gpu-calibration/*.json "$OUT/" 2>/dev/null
stamp "gpu_check throughput"; timeout ${T_B8:-170} $PY examples/bench/gpu_check.py --models bert gpt2 resnet50 \
  --compile-models bert --train-models bert > "$OUT/gpu_check.txt" 2>&1; echo "rc=$?" >> "$OUT/gpu_check.txt"
stamp "bench_generate"; timeout ${T_GEN:-80} $PY examples/bench/bench_generate.py --batches 1 8 --reps 5 \
  > "$OUT/generate.txt" 2>&1; echo "rc=$?" >> "$OUT/generate.txt"
stamp "gpu_host_diag"; timeout ${T_DIAG:-80} $PY examples/bench/gpu_host_diag.py > "$OUT/diag.txt" 2>&1; echo "rc=$?" >> "$OUT/diag.txt"
stamp "suite"; timeout ${T_SUITE:-1} $PY -m pytest -o addopts= -p no:cacheprovider -p no:warnings -q -n 14 -rfE -x tests/ \
  > "$OUT/suite.txt" 2>&1; echo "rc=$?" >> "$OUT/suite.txt"
stamp done
for f in "$OUT"/*.txt; do echo "---- $f"; grep -E "passed|failed|rc=|estimated vs|\| (bert|gpt2|llama|resnet50) |Calibration|TTFT|error" "$f" | tail -40; done
