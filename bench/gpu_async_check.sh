#!/usr/bin/env bash
# GPU check for async mode (device tool, one H200, <= 8 min): the async tests on CUDA (model.device
# auto picks the GPU: a spawned generator shares it with the learner, weights staged over gloo;
# under torchrun with a GPU per rank the weights go over NCCL), then one async demo against the
# sync demo on the same seed. Usage: bash bench/gpu_async_check.sh   (figures under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/gspo-gpu-async}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # omegaconf for a GPU host without it
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,count --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda devices', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
# the torchrun tests start 3 ranks, one GPU each: on fewer GPUs they run on the CPU (CUDA_VISIBLE_DEVICES="")
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
K=""; [ "$NGPU" -lt 3 ] && K="not torchrun and not fsdp_learners"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_async.py -k "$K" 2>&1 | tail -15 | tee "$OUT/async_tests.txt"
[ -n "$K" ] && CUDA_VISIBLE_DEVICES="" timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_async.py \
  -k "torchrun or fsdp_learners" 2>&1 | tail -5 | tee -a "$OUT/async_tests.txt"
for mode in sync async; do
  extra=""; [ "$mode" = async ] && extra="rollout.mode=async rollout.max_staleness=1"
  timeout 150 python3 -m gspo demo --out /tmp/gspo-demo-$mode $extra 2>&1 | tail -14 | tee "$OUT/demo_$mode.txt"
  cp /tmp/gspo-demo-$mode/metrics.jsonl "$OUT/demo_${mode}_metrics.jsonl" 2>/dev/null
done
