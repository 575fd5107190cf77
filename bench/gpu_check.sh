#!/usr/bin/env bash
# GPU check for the scale-out work (device tool, one H200, <= 8 min): GSPO on a random
# Qwen2.5-0.5B-shaped model under torchrun + FSDP2 in bf16 (tokens/s per phase, update MFU),
# then gspo's decode loop against transformers' generate (fp32, bf16), then the whole-model and
# LM-head memory benchmarks on CUDA. Usage: bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gspo-gpu}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # omegaconf for a GPU host without it
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# caps add up to 8 min: train + MFU 270 s, decode 90 s, memory 80 + 40 s
timeout 270 torchrun --standalone --nproc_per_node=1 bench/gpu_check.py --out /tmp/gspo-check 2>&1 | grep -v "^W" | tail -20 | tee "$OUT/gpu_check.txt"
cp /tmp/gspo-check/gpu_check.json "$OUT/" 2>/dev/null
timeout 90 python3 bench/gpu_decode.py --model-dir /tmp/gspo-check/model --json "$OUT/gpu_decode.json" 2>&1 | grep -v "it/s" | tail -6 | tee "$OUT/gpu_decode.txt"
timeout 80 python3 bench/model_memory.py --json "$OUT/model_memory.json" 2>&1 | tail -12 | tee "$OUT/model_memory.txt"
timeout 40 python3 bench/model_memory.py --dtype bfloat16 --json "$OUT/model_memory_bf16.json" 2>&1 | tail -12 | tee "$OUT/model_memory_bf16.txt"
