"""`gspo demo`: the whole GSPO path, offline on a CPU, in a few minutes.

1. Build a tiny Qwen3-style model and a character-level tokenizer (nothing is downloaded).
2. Warm it up with a short supervised phase on the built-in arithmetic task, so that it
   answers some prompts right: RL needs groups whose rewards differ.
3. Save it in HF format and train it with GSPO through the same `train()` that
   `gspo train` runs, loading it back with `from_pretrained`.
4. Report held-out greedy accuracy before and after the GSPO phase in `summary.json`.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from gspo.config import ConfigError, load_config
from gspo.data import encode_texts
from gspo.train.prompts import load_prompt_rows
from gspo.train.run import build_run, seed_everything
from gspo.train.threads import setup_threads

# The demo's GSPO phase. Everything else is the library's default (GSPO, paper clip ranges,
# 4 minibatches per rollout).
DEMO_OVERRIDES = [
    "data.source=arithmetic", "data.difficulty=1", "data.num_prompts=4000",     "rollout.prompts_per_step=32", "rollout.group_size=8", "rollout.max_new_tokens=6",
    "optim.lr=1e-4", "optim.max_grad_norm=1.0",
    "schedule.rollouts=300", "schedule.num_minibatches=4",
    "eval.num_prompts=200", "eval.every=50",
    "logging.table_every=50", "logging.completions_every=25",
    "tiny.hidden_size=128", "tiny.num_layers=2",
]
QUICK_OVERRIDES = ["schedule.rollouts=3", "rollout.prompts_per_step=8", "eval.num_prompts=32", "eval.every=0",
                   "data.num_prompts=400", "logging.table_every=0"]
DEMO_MARK = ".gspo-demo"  # in the demo's folder: the demo may replace it (a folder without it, never)
WARMUP = {"steps": 300, "batch_size": 64, "lr": 1e-3}
QUICK_WARMUP = {"steps": 10, "batch_size": 32, "lr": 3e-3}


def warmup(model, tokenizer, rows: list[dict], *, steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """Supervised warm-up: teacher-forced `prompt + answer + EOS`, loss on the answer tokens only."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(rows), (batch_size,), generator=g)
        seqs, labels = [], []
        prompts = encode_texts(tokenizer, [rows[i]["prompt"] for i in idx.tolist()])  # as GSPO will see them
        for i, p in zip(idx.tolist(), prompts):
            a = tokenizer(rows[i]["answer"], add_special_tokens=False)["input_ids"] + [eos]
            seqs.append(p + a)
            labels.append([-100] * len(p) + a)
        losses.append(supervised_step(model, opt, seqs, labels, pad))
    return losses


def supervised_step(model, opt, seqs: list[list[int]], labels: list[list[int]], pad: int) -> float:
    """One teacher-forced step on right-padded sequences: cross-entropy where `labels` is not
    -100 (transformers shifts them), gradient norm clipped to 1; the loss."""
    dev = next(model.parameters()).device
    L = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs], device=dev)                # (B, L)
    lab = torch.tensor([s + [-100] * (L - len(s)) for s in labels], device=dev)            # (B, L)
    att = (torch.arange(L, device=dev)[None] < torch.tensor([len(s) for s in seqs], device=dev)[:, None]).long()
    loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _old_demo(out: Path) -> bool:
    """A folder an earlier gspo demo wrote, before the mark: its summary names the demo's figures."""
    try:
        return "accuracy_before_rl" in json.loads((out / "summary.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def run_demo(out_dir: str | Path = "runs/demo", overrides: list[str] | tuple[str, ...] = (),
             quick: bool = False, warmup_steps: int | None = None) -> dict:
    t_start = time.time()
    out = Path(out_dir)
    placed = [o for o in overrides if o.split("=", 1)[0].strip() in ("output.dir", "output.name")]
    if placed:
        raise ConfigError(f"config field '{placed[0].split('=', 1)[0].strip()}': the demo's run directory is "
                          f"--out (here {out}); give --out DIR instead")
    base = DEMO_OVERRIDES + (QUICK_OVERRIDES if quick else [])
    cfg = load_config(None, [*base, f"output.dir={out.parent}", f"output.name={out.name}", *overrides])  # first:
    if out.exists() and not out.is_dir():                                  # a typo deletes nothing
        raise ConfigError(f"--out {out}: a file, not a folder")
    if out.exists() and any(out.iterdir()):
        if not ((out / DEMO_MARK).exists() or _old_demo(out)):
            raise ConfigError(f"--out {out}: the folder is not empty and no demo wrote it (it has no {DEMO_MARK}); "
                              "the demo starts afresh in its folder, so give it a new or empty one")
        shutil.rmtree(out)  # the demo's own directory: start afresh each time
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARK).write_text("written by gspo demo, which replaces this folder each time it runs\n")
    setup_threads(cfg.threads)
    seed_everything(cfg.seed)

    # 1-2. tiny model + supervised warm-up
    from gspo.train.run import build_policy

    model, tok = build_policy(cfg)
    rows, _ = load_prompt_rows(cfg)
    w = dict(QUICK_WARMUP if quick else WARMUP)
    if warmup_steps is not None:
        w["steps"] = warmup_steps
    t0 = time.time()
    losses = warmup(model, tok, rows, seed=cfg.seed, **w)
    t_warm = time.time() - t0
    warm_dir = out / "warmup"
    model.save_pretrained(warm_dir, safe_serialization=True)
    tok.save_pretrained(warm_dir)
    print(f"warm-up: {w['steps']} supervised steps in {t_warm:.1f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    # 3. GSPO from the saved warm-up model, loaded back with from_pretrained
    from gspo.train import train

    cfg.model.name_or_path = str(warm_dir)
    run = build_run(cfg)
    t0 = time.time()
    train(cfg, run=run)
    t_rl = time.time() - t0

    # 4. accuracy after, measured on the saved final model
    from gspo.report.sinks import read_metrics

    evals = [m for m in read_metrics(out / "metrics.jsonl") if m.get("eval/accuracy") is not None]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    summary = {
        "accuracy_before_rl": round(before, 4),
        "accuracy_after_rl": round(after, 4),
        "accuracy_gain_points": round(100 * (after - before), 1),
        "eval_prompts": len(run.eval_rows[: cfg.eval.num_prompts]),
        "warmup_seconds": round(t_warm, 1),
        "rl_seconds": round(t_rl, 1),
        "seconds": round(time.time() - t_start, 1),
        "rollouts": cfg.schedule.rollouts,
        "final_model": str(out / "final"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
