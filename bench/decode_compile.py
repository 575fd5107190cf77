"""The compiled-decode lever of issue 17, measured: one decode step of a grid cell's model,
eager with transformers' DynamicCache and StaticCache against `torch.compile` of the forward
(static shapes, StaticCache), greedy, batch and length fixed (B*G rows, T steps).

    python bench/decode_compile.py g-moe-32r-p8-t16      # any GRID cell of bench/trl_compare.py

Prints ms per step of each and the compile + first-run time. docs/benchmarks.md has the figures
and why the lever is not in the decode loop.
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_compare import GRID, build_model_dir  # noqa: E402
from transformers import AutoModelForCausalLM, StaticCache, DynamicCache
torch.set_num_threads(1)
cell = sys.argv[1] if len(sys.argv) > 1 else "g-dense-32r-p8-t16"
d = Path(tempfile.mkdtemp(prefix="decode-compile-")) / cell
build_model_dir(d, GRID[cell])
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
w = GRID[cell]; B = w["B"] * w["G"]; P = 8; T = w["T"]
V = m.config.vocab_size
ids = torch.randint(5, V, (B, P))

def run(step, make_cache, reps=3):
    best = 1e9
    for _ in range(reps):
        cache = make_cache()
        with torch.no_grad():
            out = m(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(P))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for t in range(T):
                pos = torch.tensor([P + t])
                logits = step(tok, cache, pos)
                tok = logits[:, -1].argmax(-1, keepdim=True)
            best = min(best, time.perf_counter() - t0)
    return best / T

def eager(tok, cache, pos):
    return m(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos).logits

compiled_fwd = torch.compile(m.forward, dynamic=False, fullgraph=False)
def comp(tok, cache, pos):
    return compiled_fwd(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos).logits

dyn = lambda: DynamicCache(config=m.config)
stat = lambda: StaticCache(config=m.config, max_cache_len=P + T + 1)
e_dyn = run(eager, dyn)
e_st = run(eager, stat)
t0 = time.perf_counter(); run(comp, stat, reps=1); tc = time.perf_counter() - t0
c_st = run(comp, stat)
print(f"{cell}: B={B} T={T}  eager dynamic {e_dyn*1e3:.2f} ms/step, eager static {e_st*1e3:.2f}, compiled static {c_st*1e3:.2f} (compile+first {tc:.1f} s)  speedup vs eager dynamic {e_dyn/c_st:.2f}x")
