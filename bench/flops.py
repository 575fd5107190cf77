"""FLOP/s of a GSPO training step's phases against this machine's measured matmul peak of the
precision each phase runs in (fp32, or bf16 under rollout.mixed_precision / model.mixed_precision).

    python bench/flops.py                                 # hidden 1024, 4 layers, 64 x 128 tokens (~2.5 min)
    python bench/flops.py --quick                         # seconds: the test's smoke run
    python bench/flops.py --out flops.json tiny.num_layers=6   # key=value overrides, as bench/step.py
    python bench/flops.py model.mixed_precision=bf16 rollout.mixed_precision=bf16   # the bf16 step
    python bench/flops.py --model compute-dense           # a bench/trl_compare.py model, saved and loaded

(a) Matmul peaks. fp32 and bf16 `torch.mm` (both measured in the same run; bf16 runs on AMX
where the CPU has it) at the shapes the measured model runs (tokens x hidden times
hidden x {hidden, hidden/2 (k, v), intermediate}, intermediate x hidden, their backward
counterparts dX = dY W and dW = X^T dY, and the LM head), plus (2048 x hidden) x (hidden x
4 hidden) and a 2048^3 square, with the torch thread count the step runs with (the library
default: 1 thread on <= 4 cores, every core for a compute-bound model: gspo.train.run.setup_threads
and threads_for_model). Each shape is timed in blocks of
>= --mm-seconds; its figure is its best block; the peak is the best shape.

(b) One real training step, timed by phase through bench/step.py (the functions gspo.train.train
calls), on a compute-bound shape: the tiny Qwen3 (hidden 1024, 4 layers; the tiny model's MLP
is always 128 wide, heads 4 / kv heads 2), 8 prompts x 8 completions, completions forced to
run to max_new_tokens=128 (bench/step.py:force_full_length; the random model would otherwise end
~1 in |V| tokens with EOS). FLOPs are counted analytically from the step's own tensors: every
forward/backward runs on the trimmed (b, L) rectangle of its micro-batch (Rollout.select), so
padding positions inside it are computed and counted.

Formulas (multiply-add = 2 FLOPs; per micro-batch of b rows, L = trimmed prompt + completion
columns, Mc = real completion tokens in it; N = weights of the decoder layers' Linear modules
(q, k, v, o, gate, up, down; embeddings, norms excluded), l = layers, A = heads x head_dim
(the attention width, = hidden here), H = hidden, V = vocabulary):

    pi_old (forward, no grad)  2 N bL + 4 l A b L^2 + 2 H V Mc
    update (executed)          6 N bL + 14 l A b L^2 + 8 H V Mc
    update ("model" FLOPs)     6 N bL + 12 l A b L^2 + 6 H V Mc
    generate (KV cache)        prefill 2 N bP + 4 l A b P^2 + 2 H V b, then for t = 1..T-1:
                               2 N b + 4 l A b (P + t) + 2 H V b          (P = prompt width)

6 N per position = forward 2N + backward 4N (dX and dW). Attention (per layer, per row):
QK^T and PV are 2 A L^2 each in the forward; torch's CPU flash-attention backward recomputes
QK^T and does four more L^2 products, 10 A L^2, so 14 executed against the textbook 12 (no
recomputation). The mask is a padding mask, not is_causal, so the full L x L square is counted.
pi_old runs on the rows outside the first minibatch (the plan's old_forwards; the
first minibatch's forward in the update is its pi_old), so it is ~3/4 of a full pass with 4
minibatches. The LM head runs only on the Mc real completion tokens (gspo.models.logprobs.token_logprobs), under
activation checkpointing in the update: forward 2, recomputed forward 2, backward 4 = 8 H V
(model count 6); when a micro-batch's Mc x V fp32 logits fit in 16 MiB (small vocabularies)
the head is not checkpointed and it is 6 H V. Elementwise work (norms, RoPE, SiLU, softmax, loss, AdamW) is not counted.
Generation computes logits for the last position only (logits_to_keep=1) and never runs the
model on the last sampled token. `cross_check` compares these formulas with
torch.utils.flop_counter.FlopCounterMode on a tiny model (it counts aten.mm; the CPU
flash-attention ops are added with torch's own sdpa formulas), and `step_cross_check` does
the same for whole training steps of the --quick shape, phase by phase; they agree exactly.

"% of peak" = executed FLOPs / phase time / the matmul peak of the phase's precision (generate:
rollout.mixed_precision; pi_old and update: model.mixed_precision); "% of fp32 peak" beside it. Update time includes the 4 AdamW steps,
gradient clipping and the loss; pi_old and generate include their Python overheads.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import step as bench_step  # noqa: E402  (bench/step.py)

# the compute-bound default shape of (b). rollout.old_logp=trainer: the pi_old pass is measured
# as MoE, bf16 and vLLM runs have it (a dense fp32 run on the hf backend skips it by default);
# schedule.skip_zero_advantage=false: every row runs, whatever the rewards
# (equal-reward groups would otherwise leave the passes)
DEFAULT = ["tiny.hidden_size=1024", "tiny.num_layers=4", "rollout.max_new_tokens=128",
           "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.old_logp=trainer",
           "schedule.skip_zero_advantage=false"]
QUICK = ["tiny.hidden_size=128", "tiny.num_layers=2", "rollout.max_new_tokens=8",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "data.num_prompts=200", "rollout.old_logp=trainer",
         "schedule.skip_zero_advantage=false"]
PHASES = ("generate", "pi_old", "update")


# ---------------------------------------------------------------- analytic FLOP counts


def model_dims(model) -> dict:
    """Sizes the formulas need, read from the model's modules (Qwen3-style decoder)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    layers = base.get_decoder().layers
    n_matmul = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    attn = layers[0].self_attn
    return {"N": n_matmul, "layers": len(layers), "A": attn.q_proj.out_features, "kv": attn.k_proj.out_features,
            "H": head.weight.shape[1], "V": head.weight.shape[0],
            "intermediate": layers[0].mlp.gate_proj.out_features if hasattr(layers[0].mlp, "gate_proj") else None}


def forward_flops(d: dict, b: int, L: int, mc: int) -> int:
    """One no-grad LogprobModule forward on a (b, L) micro-batch with mc real completion tokens."""
    return 2 * d["N"] * b * L + 4 * d["layers"] * d["A"] * b * L * L + 2 * d["H"] * d["V"] * mc


def train_flops(d: dict, b: int, L: int, mc: int, executed: bool = True) -> int:
    """Forward + backward on a (b, L) micro-batch: executed (attention-backward and LM-head
    recomputation included) or textbook "model" FLOPs."""
    from gspo.models.lm_head import _UNCHECKPOINTED_LOGITS_BYTES  # below it the head is not recomputed

    recomputed = mc * d["V"] * 4 > _UNCHECKPOINTED_LOGITS_BYTES
    attn, head = (14, 8 if recomputed else 6) if executed else (12, 6)
    return 6 * d["N"] * b * L + attn * d["layers"] * d["A"] * b * L * L + head * d["H"] * d["V"] * mc


def shared_flops(d: dict, k: int, Pw: int, b: int, t: int, mc: int, train: bool) -> int:
    """A call that runs k distinct Pw-wide prompts once, then b rows' first t-1 completion
    columns on their keys/values (gspo.models.logprobs.prompt_share_plan): forward, or forward + backward."""
    from gspo.models.lm_head import _UNCHECKPOINTED_LOGITS_BYTES

    tc = t - 1
    positions = k * Pw + b * tc
    attn = k * Pw * Pw + b * tc * (Pw + tc)  # query x key products of the two calls
    if not train:
        return 2 * d["N"] * positions + 4 * d["layers"] * d["A"] * attn + 2 * d["H"] * d["V"] * mc
    head = 8 if mc * d["V"] * 4 > _UNCHECKPOINTED_LOGITS_BYTES else 6
    return 6 * d["N"] * positions + 14 * d["layers"] * d["A"] * attn + head * d["H"] * d["V"] * mc


def call_flops(d: dict, ids, mask, t: int, mc: int, train: bool, share: bool = True, min_saved: int = 0) -> int:
    """One LogprobModule call on (b, L) ids/mask, with prompt sharing when gspo would use it."""
    from gspo.models.logprobs import prompt_share_plan

    b, L = ids.shape
    plan = prompt_share_plan(ids, mask, t, min_saved) if share else None
    if plan is None:  # one forward over every column but the last (it predicts nothing)
        return train_flops(d, b, L - 1, mc) if train else forward_flops(d, b, L - 1, mc)
    first, _, cut = plan
    return shared_flops(d, len(first), L - t - cut, b, t, mc, train)


def generate_flops(d: dict, b: int, P: int, T: int, k: int | None = None) -> int:
    """Sampling T tokens for b rows from a P-wide prompt with the KV cache; the prefill runs the
    k distinct prompts (k = b when every row's prompt differs)."""
    k = b if k is None else k
    f = 2 * d["N"] * k * P + 4 * d["layers"] * d["A"] * k * P * P + 2 * d["H"] * d["V"] * k
    for t in range(1, T):
        f += 2 * d["N"] * b + 4 * d["layers"] * d["A"] * b * (P + t) + 2 * d["H"] * d["V"] * b
    return f


def sorted_positions(rollout, groups, size: int) -> int:
    """Positions the forward passes would compute if each group of rows (a minibatch, or the pi_old
    rows) were run as micro-batches of `size` rows sorted by completion length, each trimmed to
    its own longest prompt + longest completion: what length bucketing would leave of padding."""
    plen = rollout.prompt_mask.sum(dim=1)
    clen = rollout.completion_mask.sum(dim=1)
    total = 0
    for rows in groups:
        rows = rows[clen[rows].argsort()]
        for part in rows.split(size):
            total += len(part) * int(plen[part].max() + clen[part].max())
    return total


def step_flops(run, rollout, rollout_index: int) -> dict:
    """FLOPs of one step's phases from its rollout, chunked as generate / the plan's π_old pass /
    its micro-batches chunk it; also the update's computed positions and how many are padding."""
    import torch

    from gspo.train import loop as train

    d = model_dims(run.policy)
    n = rollout.num_samples
    T = rollout.completion_ids.shape[1]
    from gspo.models.logprobs import prompt_groups

    gen = 0
    chunk = run.generator.batch_size or n
    share = getattr(run.trainer, "share_prompt", False)  # (a forward the plan left undecided shares if it pays)
    from gspo.models.logprobs import share_min_saved

    min_saved = share_min_saved(run.policy, getattr(run.trainer, "share_min_work", 0.0))
    for s in range(0, n, chunk):
        mask, ids = rollout.prompt_mask[s:s + chunk], rollout.prompt_ids[s:s + chunk]
        P = mask.shape[1] - int(mask.any(dim=0).long().argmax())  # columns padded in every row dropped
        k = len(prompt_groups(ids, mask, mask.shape[1])[0])
        gen += generate_flops(d, mask.shape[0], P, T, k)
    # the plan learn ran (bench steps run every row: skip_zero_advantage is off in this bench)
    plan = train.make_plan(run, rollout, torch.ones(n), train.TrainerState(rollout=rollout_index))
    old = old_positions = old_total = old_real = 0
    for idx, shared in zip(plan.old_forwards, plan.old_share):
        if idx is None:
            continue
        part = rollout.select(idx)
        old += call_flops(d, part.input_ids, part.attention_mask, part.completion_ids.shape[1],
                          int(part.completion_mask.sum()), train=False, share=shared is not False and share, min_saved=min_saved)
        old_positions = max(old_positions, part.input_ids.numel())
        old_total += part.input_ids.numel()
        old_real += int(part.attention_mask.sum())
    upd = upd_model = positions = real = micro = 0
    for mb in plan.minibatches:
        for mi in mb.micro:
            part = rollout.select(mi.rows)
            b, L = part.input_ids.shape
            mc = int(part.completion_mask.sum())
            upd += call_flops(d, part.input_ids, part.attention_mask, part.completion_ids.shape[1], mc, train=True,
                              share=mi.share is not False and share, min_saved=min_saved)
            upd_model += train_flops(d, b, L, mc, executed=False)
            positions += b * L
            real += int(part.attention_mask.sum())
            micro += 1
    return {"flops_generate": gen, "flops_pi_old": old, "flops_update": upd, "flops_update_model": upd_model,
            "pi_old_positions": old_positions, "pi_old_positions_total": old_total, "pi_old_real_tokens": old_real,
            "update_positions": positions, "update_real_tokens": real, "update_micro_batches": micro,
            # decode row-steps: every row is run for all T steps, finished or not
            "generate_row_steps": n * T,
            "update_positions_sorted4": sorted_positions(rollout, [mb.rows for mb in plan.minibatches], 4), "generate_real_tokens": int(rollout.completion_mask.sum())}


# ---------------------------------------------------------------- cross-check with FlopCounterMode


def _counter():
    """FlopCounterMode that also counts torch's CPU flash-attention ops (not in its registry)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def fwd(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, q, k, v)

    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: fwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd})


def cross_check(hidden: int = 64, layers: int = 2, rows: int = 3, prompt: int = 5, completion: int = 7,
                seed: int = 0, groups: int = 0) -> dict:
    """Analytic vs FlopCounterMode FLOPs on a tiny model: a LogprobModule forward (pi_old), a
    forward + backward (update; rows with left padding and an early-ended completion, head
    chunked so the checkpointed recomputation shows) and a generate call. With `groups`, the
    rows hold that many distinct prompts (consecutive rows share one), so the calls share them."""
    import torch

    from gspo.models.logprobs import LogprobModule, prompt_share_plan
    from gspo.rollout.hf import HFGenerator
    from gspo.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=hidden, num_layers=layers, seed=seed)
    d = model_dims(model)
    g = torch.Generator().manual_seed(seed)
    L = prompt + completion
    ids = torch.randint(4, len(tok), (rows, L), generator=g)
    mask = torch.ones_like(ids)
    mask[0, : prompt // 2] = 0                       # a left-padded prompt
    mask[min(1, rows - 1), prompt + completion // 2:] = 0   # a completion that ended early
    if groups:  # rows i*rows/groups .. share row i*rows/groups's prompt (and its padding)
        lead = torch.arange(rows) // (rows // groups) * (rows // groups)
        ids[:, :prompt], mask[:, :prompt] = ids[lead, :prompt], mask[lead, :prompt]
    lm = LogprobModule(model, chunk_size=4, share_prompt=True)
    with torch.no_grad():
        lm(ids, mask, completion)                    # the once-per-model head check, not counted
    mc = int(mask[:, prompt:].sum())
    with torch.no_grad(), _counter() as c:
        lm(ids, mask, completion)
    fwd = c.get_total_flops()
    with _counter() as c:
        lm(ids, mask, completion).sum().backward()
    fb = c.get_total_flops()
    gen = HFGenerator(model, tok, max_new_tokens=completion, eos_token_ids=[len(tok)])
    with _counter() as c:
        r = gen.generate(["1+2=", "ab"], 2)
    gen_counted = c.get_total_flops()
    return {"dims": d, "rows": rows, "L": L, "completion_tokens": mc,
            "shared": prompt_share_plan(ids, mask, completion) is not None,
            "forward": {"counted": fwd, "formula": call_flops(d, ids, mask, completion, mc, train=False)},
            "train": {"counted": fb, "formula": call_flops(d, ids, mask, completion, mc, train=True)},
            "generate": {"counted": gen_counted,  # two distinct prompts, twice each
                         "formula": generate_flops(d, r.num_samples, r.prompt_ids.shape[1], r.completion_ids.shape[1],
                                                   k=2)}}


def step_cross_check(overrides: list[str] | None = None, threads: int = 0) -> dict:
    """`step_flops` against FlopCounterMode on whole training steps (bench/step.py:timed_step, the
    quick shape by default): per phase, {"counted", "formula"}. One untimed step first (the
    once-per-model LM-head check runs then)."""
    import tempfile

    from gspo.train import loop as train

    with tempfile.TemporaryDirectory(prefix="gspo-bench-flops-") as tmp:
        _, run, _ = bench_step.build(None, [*QUICK, *(overrides or [])], threads=threads, steps=2, out_dir=tmp)
        try:
            bench_step.force_full_length(run)
            state = train.TrainerState()
            bench_step.timed_step(run, state)
            counters = {}

            def wrap(phase):  # one counter per call (the update phase is one call per minibatch)
                counters.setdefault(phase, []).append(_counter())
                return counters[phase][-1]

            index = state.rollout
            _, rollout = bench_step.timed_step(run, state, wrap=wrap)
            f = step_flops(run, rollout, index)
        finally:
            run.close()
    return {p: {"counted": sum(c.get_total_flops() for c in counters.get(p, [])), "formula": f[f"flops_{p}"]}
            for p in PHASES}


# ---------------------------------------------------------------- (a) matmul peak


def matmul_shapes(d: dict, tokens: int, pi_old_tokens: int, big: bool = True) -> list[tuple[str, int, int, int, bool]]:
    """(label, m, k, n, A transposed) of the model's matmuls at `tokens` rows (an update
    micro-batch), their backward counterparts, q at `pi_old_tokens` rows (the pi_old pass runs
    every row at once), and two generic big ones (the 2048^3 square only when `big`)."""
    H, I, V, A, kv = d["H"], d["intermediate"] or 4 * d["H"], d["V"], d["A"], d["kv"]
    return [
        ("x W_q (fwd)", tokens, H, A, False),
        ("x W_kv (fwd)", tokens, H, kv, False),
        ("x W_up (fwd)", tokens, H, I, False),
        ("h W_down (fwd)", tokens, I, H, False),
        ("dY W_q^T (bwd dX)", tokens, A, H, False),
        ("X^T dY (bwd dW)", H, tokens, A, True),
        ("x W_q (pi_old rows)", pi_old_tokens, H, A, False),
        ("LM head", tokens, H, V, False),
        ("2048xH . Hx4H", 2048, H, 4 * H, False),
        *([("2048^3", 2048, 2048, 2048, False)] if big else []),
    ]


def matmul_peak(shapes, seconds: float = 0.5, blocks: int = 3, dtype=None) -> list[dict]:
    """GFLOP/s of torch.mm per shape (fp32, or `dtype`): the best of `blocks` blocks of >= `seconds` each."""
    import torch

    dtype = dtype or torch.float32
    out = []
    g = torch.Generator().manual_seed(0)
    for label, m, k, n, trans in shapes:
        a = (torch.randn(k, m, generator=g).t() if trans else torch.randn(m, k, generator=g)).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
        c = torch.empty(m, n, dtype=dtype)
        torch.mm(a, b, out=c)  # warm
        flops = 2 * m * k * n
        best = 0.0
        for _ in range(blocks):
            reps, t0 = 0, time.perf_counter()
            while True:
                torch.mm(a, b, out=c)
                reps += 1
                dt = time.perf_counter() - t0
                if dt >= seconds:
                    break
            best = max(best, flops * reps / dt / 1e9)
        out.append({"label": label, "m": m, "k": k, "n": n, "a_transposed": trans, "gflops": best})
    return out


# ---------------------------------------------------------------- main


def run(args, overrides: list[str]) -> dict:
    import torch

    from gspo.train.run import setup_threads

    threads = setup_threads(args.threads)
    t_start = time.perf_counter()
    check = cross_check()
    check_step = step_cross_check(threads=args.threads)
    steps = []

    def on_step(run, rollout, rollout_index, rec):
        rec.update(step_flops(run, rollout, rollout_index))
        rec["dims"] = model_dims(run.policy)
        rec["threads"] = torch.get_num_threads()  # the run's own (threads_for_model may give a big model every core)
        steps.append(rec)

    if args.model:  # a realistic layer (MLP 4x hidden), saved with save_pretrained and loaded by path
        from trl_compare import WORKLOADS, build_model_dir

        tmp = tempfile.mkdtemp(prefix="flops-model-")
        atexit.register(shutil.rmtree, tmp, True)
        model_dir = Path(tmp) / args.model
        build_model_dir(model_dir, WORKLOADS[args.model])
        overrides = [f"model.name_or_path={model_dir}", *overrides]
    res = bench_step.measure(None, [*(QUICK if args.quick else DEFAULT), *overrides], threads=args.threads,
                             warmup=args.warmup, rollouts=args.rollouts, repeats=1,
                             prepare=None if args.natural_length else bench_step.force_full_length, on_step=on_step)
    recs = res["records"]
    d = recs[0]["dims"]
    # the update's micro-batch rows x columns: the tokens of the model's forward matmuls
    mb_tokens = round(statistics.fmean(r["update_positions"] / r["update_micro_batches"] for r in recs))
    threads = recs[0]["threads"]
    torch.set_num_threads(threads)  # the peaks at the step's own thread count
    old_tokens = round(statistics.fmean(r["pi_old_positions"] for r in recs))
    shapes = matmul_shapes(d, max(mb_tokens, 64), old_tokens, big=not args.quick)
    kw = dict(seconds=0.05 if args.quick else args.mm_seconds, blocks=2 if args.quick else 3)
    mm = matmul_peak(shapes, **kw)
    mm16 = matmul_peak(shapes, dtype=torch.bfloat16, **kw)
    peaks = {"fp32": max(x["gflops"] for x in mm), "bf16": max(x["gflops"] for x in mm16)}
    given = [*(QUICK if args.quick else DEFAULT), *overrides]
    learn = "bf16" if "model.mixed_precision=bf16" in given else "fp32"
    precision = {"generate": "bf16" if "rollout.mixed_precision=bf16" in given else "fp32", "pi_old": learn,
                 "update": learn}
    phases = {}
    for p in PHASES:
        t = sum(r[p] for r in recs)
        f = sum(r[f"flops_{p}"] for r in recs)
        peak = peaks[precision[p]]
        phases[p] = {"s_per_step": t / len(recs), "gflop_per_step": f / len(recs) / 1e9, "precision": precision[p],
                     "gflops": f / t / 1e9, "pct_of_peak": 100 * f / t / 1e9 / peak,
                     "pct_of_fp32_peak": 100 * f / t / 1e9 / peaks["fp32"],
                     "per_step_gflops": [r[f"flops_{p}"] / r[p] / 1e9 for r in recs]}
    fm = sum(r["flops_update_model"] for r in recs)
    phases["update"]["model_gflops"] = fm / sum(r["update"] for r in recs) / 1e9
    phases["update"]["model_pct_of_peak"] = 100 * phases["update"]["model_gflops"] / peaks[learn]
    pos = sum(r["update_positions"] for r in recs)
    real = sum(r["update_real_tokens"] for r in recs)
    return {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": threads,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "matmul": mm, "matmul_bf16": mm16, "matmul_peak_gflops": peaks["fp32"],
        "matmul_peak_gflops_bf16": peaks["bf16"], "dims": d, "cross_check": check, "cross_check_step": check_step,
        "step": {k: v for k, v in res.items() if k not in ("records", "blocks")},
        "records": [{k: v for k, v in r.items() if k != "dims"} for r in recs],
        "mean_completion_tokens": statistics.fmean(r["tokens"] for r in recs) / res["samples"],
        "update_pad_share": 1 - real / pos, "update_micro_batch_tokens": mb_tokens,
        "pi_old_pad_share": 1 - sum(r["pi_old_real_tokens"] for r in recs) / max(sum(r["pi_old_positions_total"] for r in recs), 1),
        "update_pad_share_sorted4": 1 - real / sum(r["update_positions_sorted4"] for r in recs),
        "generate_pad_share": 1 - sum(r["generate_real_tokens"] for r in recs) / sum(r["generate_row_steps"] for r in recs),
        "phases": phases, "wall_s": time.perf_counter() - t_start, "model": args.model,
    }


def print_report(out: dict) -> None:
    d, st = out["dims"], out["step"]
    print(f"torch {out['machine']['torch']}, {out['machine']['threads']} thread(s) of {out['machine']['cpus']} CPUs, "
          f"OMP_WAIT_POLICY={out['machine']['omp_wait_policy'] or 'unset'}")
    print("\n(a) torch.mm, best block of the shape (m x k . k x n), fp32 and bf16:")
    for x, y in zip(out["matmul"], out["matmul_bf16"]):
        print(f"  {x['label']:<20}{x['m']:>6} x{x['k']:>6} . x{x['n']:>6}  {x['gflops']:8.1f} {y['gflops']:8.1f} GFLOP/s")
    print(f"  matmul peak: fp32 {out['matmul_peak_gflops']:.1f}, bf16 {out['matmul_peak_gflops_bf16']:.1f} GFLOP/s")
    print(f"\n(b) {out['model'] or 'tiny'} Qwen3: hidden {d['H']}, {d['layers']} layers, MLP {d['intermediate']}, attention width {d['A']}, "
          f"vocab {d['V']}, N = {d['N'] / 1e6:.2f}M matmul weights; {st['samples']} completions x "
          f"max_new_tokens {st['max_new_tokens']}, mean completion {out['mean_completion_tokens']:.1f} tokens; "
          f"{st['warmup']} warm-up + {st['rollouts']} timed steps")
    print(f"    update: {out['update_micro_batch_tokens']} positions per micro-batch (rows x trimmed columns), "
          f"{100 * out['update_pad_share']:.1f}% of them padding (pi_old pass {100 * out['pi_old_pad_share']:.1f}%; "
          f"generate: {100 * out['generate_pad_share']:.1f}% of decode row-steps on finished rows); "
          f"in micro-batches of 4 rows sorted by length: {100 * out['update_pad_share_sorted4']:.1f}%")
    print(f"{'phase':<10}{'prec':>5}{'s/step':>9}{'GFLOP/step':>12}{'GFLOP/s':>10}{'% of peak':>11}{'% fp32':>8}"
          f"   per step GFLOP/s")
    for p in PHASES:
        x = out["phases"][p]
        print(f"{p:<10}{x['precision']:>5}{x['s_per_step']:>9.3f}{x['gflop_per_step']:>12.1f}{x['gflops']:>10.1f}"
              f"{x['pct_of_peak']:>10.1f}%{x['pct_of_fp32_peak']:>7.1f}%   {', '.join(f'{v:.1f}' for v in x['per_step_gflops'])}")
    u = out["phases"]["update"]
    print(f"update in model FLOPs (no recomputation: attention 12, head 6): {u['model_gflops']:.1f} GFLOP/s, "
          f"{u['model_pct_of_peak']:.1f}% of the {u['precision']} peak")
    c = out["cross_check"]
    print("cross-check with FlopCounterMode (tiny model): " + ", ".join(
        f"{k} {c[k]['formula']} vs {c[k]['counted']}" for k in ("forward", "train", "generate")))
    c = out["cross_check_step"]
    print("  and on a whole quick-shape step: " + ", ".join(
        f"{k} {c[k]['formula']} vs {c[k]['counted']}" for k in PHASES))
    print(f"({out['wall_s']:.0f} s in all; CPU during the timed steps: own {st['cpu_own']:.2f}, "
          f"others {st['cpu_others']:.2f} cores)")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (after the default shape)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = the library's auto default)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    ap.add_argument("--rollouts", type=int, default=None, help="timed steps (default 3; --quick 1)")
    ap.add_argument("--mm-seconds", type=float, default=0.5, help="seconds per matmul timing block")
    ap.add_argument("--natural-length", action="store_true",
                    help="let completions end at EOS (not forced to max_new_tokens): shows the padding computed")
    ap.add_argument("--quick", action="store_true", help="a tiny shape, one step: seconds (for the test)")
    ap.add_argument("--model", default=None, metavar="WORKLOAD",
                    help="measure a bench/trl_compare.py WORKLOADS model (e.g. compute-dense: hidden 512, 8 layers, "
                         "MLP 2048) instead of the built-in tiny one, whose MLP is 128 wide")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"not a key=value override: {bad[0]}")
    args.warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup
    args.rollouts = (1 if args.quick else 3) if args.rollouts is None else args.rollouts
    out = run(args, args.overrides)
    print_report(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
