"""The executed FLOPs of a GSPO training step's phases, counted analytically from the step's own
tensors (`step_flops`: bench/flops.py divides them by the phases' times, bench/scaling.py fits
them), and the check of the formulas against torch's FlopCounterMode (`cross_check` on single
calls of a tiny model, `step_cross_check` on whole training steps of the QUICK shape).

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
the same for whole training steps of the QUICK shape, phase by phase; they agree exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import step as bench_step  # noqa: E402  (bench/step.py)

# a tiny step in seconds: the one `step_cross_check` counts, and bench/flops.py --quick's shape.
# rollout.old_logp=trainer and schedule.skip_zero_advantage=false as in bench/flops.py's DEFAULT:
# the pi_old pass runs, and every row runs whatever the rewards
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
