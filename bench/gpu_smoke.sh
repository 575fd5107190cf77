#!/usr/bin/env bash
# GPU smoke check (device tool): the trainer on CUDA with device=auto, and the CPU-tier tests
# re-run where CUDA is present. Usage: bash bench/gpu_smoke.sh  (writes logs under $OUT if set)
set -uo pipefail
rm -rf /tmp/gpu-demo /tmp/gpu-runs
OUT=${OUT:-/tmp/gspo-gpu}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
/usr/bin/time -v python3 -m gspo demo --quick --out /tmp/gpu-demo 2>&1 | tail -40 | tee "$OUT/demo.txt"
python3 -c "import json; print(json.load(open('/tmp/gpu-demo/config.yaml'.replace('config.yaml','summary.json'))))"
time python3 -m gspo train tiny.hidden_size=512 tiny.num_layers=4 rollout.prompts_per_step=64 \
  rollout.max_new_tokens=16 schedule.rollouts=10 eval.num_prompts=64 logging.console=false \
  output.dir=/tmp/gpu-runs output.name=bigger 2>&1 | tail -5
python3 - <<'PY' | tee "$OUT/bigger.txt"
import json
recs=[json.loads(l) for l in open('/tmp/gpu-runs/bigger/metrics.jsonl')][1:]
last=recs[-4:]
for k in ['time/generate','time/old_logp','time/update','time/step','tokens_per_s','reward/mean']:
    print(k, sum(r[k] for r in last)/len(last))
PY
python3 -m pytest -q -x -p no:cacheprovider tests/test_algo.py tests/test_train.py tests/test_models.py \
  tests/test_rollout.py tests/test_resume.py 2>&1 | tail -15 | tee "$OUT/pytest.txt"
