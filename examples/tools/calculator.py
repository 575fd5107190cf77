"""A tiny model learns to call a calculator with GSPO, on a CPU.

    python examples/tools/calculator.py                  # 3 seeds (~4 min each on 2 cores)
    python examples/tools/calculator.py --quick          # a minute: checks the script

The task (`gspo.tool_tasks.multiply`): 'what is 347*28?'. A 2-layer, hidden-128 model cannot
multiply in its head, but with the `calc` tool the answer is one call away:

    assistant: <tool_call>{"name":"calc","arguments":{"expression":"347*28"}}</tool_call><eos>
    tool: 9716
    assistant: 9716<eos>

1. Build the tiny model with a character tokenizer that can write the call, and warm it up
   with a short supervised phase in which only `--tool-frac` of the examples use the tool
   (the rest answer directly, which it cannot learn): RL then has both behaviours to choose
   from. The warm-up's episodes are laid out exactly as gspo's episodes are (the tool's reply
   inserted by the chat template, out of the loss).
2. Save it with `save_pretrained`, then train it with GSPO through the same `train()` that
   `gspo train` runs (rollout.tools=[gspo.tool_tasks:calc], exact_answer on the last turn).
3. Held-out greedy episodes before and after: accuracy and the fraction of episodes with a
   tool call. `results.json` and `table.md` in the output directory; docs/tools.md has the
   figures of the full run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CHARS = "0123456789+-*/=abcdefghijklmnopqrstuvwxyz:,.? \n<>_{}\""
BASE = ["data.source=multiply", "data.difficulty=1", "data.num_prompts=4000",
        "rollout.tools=[gspo.tool_tasks:calc]", "rollout.tool_workers=1", "rollout.max_turns=2",
        "rollout.max_new_tokens=80", "rollout.prompts_per_step=16", "rollout.group_size=8",
        "rewards.functions=[{name: exact_answer}]", "schedule.num_minibatches=4",
        "eval.num_prompts=100", "logging.console=false", "logging.completions_every=20", "checkpoint.every=0"]


def episode_example(tok, row: dict, schema: list[dict], use_tool: bool) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one supervised episode, in gspo's episode layout."""
    from gspo.data import encode_texts
    from gspo.rollout.episodes import inserted_text, render
    from gspo.tool_tasks import calc

    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    messages = [{"role": "user", "content": row["prompt"]}]
    ids = encode_texts(tok, [render(tok, messages, schema, generation_prompt=True)])[0]  # as gspo encodes prompts
    mask = [0] * len(ids)
    eos = tok.eos_token_id
    if use_tool:
        expr = row["prompt"].removeprefix("what is ").removesuffix("?")
        call = "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expression": expr}},
                                          separators=(",", ":")) + "</tool_call>"
        turn = enc(call) + [eos]
        ids, mask = ids + turn, mask + [1] * len(turn)
        messages.append({"role": "assistant", "content": call})
        between = enc(inserted_text(tok, messages, [{"role": "tool", "name": "calc", "content": calc(expr)}], schema,
                                    tok.decode([eos], skip_special_tokens=False)))
        ids, mask = ids + between, mask + [0] * len(between)
    answer = enc(row["answer"]) + [eos]
    return ids + answer, mask + [1] * len(answer)


def warm_up(model, tok, rows, schema, *, steps: int, tool_frac: float, seed: int, batch: int = 32,
            lr: float = 2e-3) -> list[float]:
    import torch

    from gspo.demo import supervised_step

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(rows), (batch,), generator=g).tolist()
        tool = (torch.rand(batch, generator=g) < tool_frac).tolist()
        ex = [episode_example(tok, rows[i], schema, t) for i, t in zip(idx, tool)]
        labels = [[t if m else -100 for t, m in zip(x, mk)] for x, mk in ex]  # the model's tokens only
        losses.append(supervised_step(model, opt, [x for x, _ in ex], labels, tok.pad_token_id))
    model.eval()
    return losses


def run_seed(out: Path, seed: int, a) -> dict:
    from gspo.config import load_config
    from gspo.models.tiny import build_char_tokenizer, build_tiny_model
    from gspo.report.sinks import read_metrics
    from gspo.rollout.tools import tool_schema
    from gspo.tool_tasks import calc
    from gspo.train import train
    from gspo.train.prompts import load_prompt_rows
    from gspo.train.run import seed_everything

    over = [*BASE, f"seed={seed}", f"output.dir={out}", f"output.name=seed{seed}", f"schedule.rollouts={a.rollouts}",
            f"optim.lr={a.lr}", f"eval.every={a.eval_every}", *a.set]
    if a.quick:
        over += ["eval.num_prompts=16", "rollout.prompts_per_step=4", "rollout.group_size=4"]
    cfg = load_config(None, over)
    seed_everything(seed)
    tok = build_char_tokenizer(CHARS)
    model = build_tiny_model(tok, hidden_size=a.hidden, num_layers=a.layers, seed=seed, max_position_embeddings=320)
    rows, held = load_prompt_rows(cfg)
    t0 = time.time()
    losses = warm_up(model, tok, rows, [tool_schema(calc)], steps=a.warmup_steps, tool_frac=a.tool_frac, seed=seed)
    t_warm = time.time() - t0
    warm_dir = out / f"seed{seed}-warmup"
    model.save_pretrained(warm_dir, safe_serialization=True)
    tok.save_pretrained(warm_dir)
    cfg.model.name_or_path = str(warm_dir)  # loaded back with from_pretrained, as a user's checkpoint is
    t0 = time.time()
    train(cfg)
    t_rl = time.time() - t0
    evals = [m for m in read_metrics(out / f"seed{seed}" / "metrics.jsonl") if m.get("eval/accuracy") is not None]
    first, last = evals[0], evals[-1]
    return {"seed": seed, "warmup_loss": [round(losses[0], 3), round(losses[-1], 3)], "warmup_s": round(t_warm, 1),
            "rl_s": round(t_rl, 1), "rollouts": cfg.schedule.rollouts,
            "accuracy_before": first["eval/accuracy"], "accuracy_after": last["eval/accuracy"],
            "tool_call_before": first["eval/tool_call_frac"], "tool_call_after": last["eval/tool_call_frac"],
            "curve": [(m["rollout"], m["eval/accuracy"], m["eval/tool_call_frac"]) for m in evals]}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/tools_calculator")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rollouts", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=700)
    p.add_argument("--tool-frac", type=float, default=0.3, help="share of warm-up examples that call the tool")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra gspo config override")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.rollouts, a.warmup_steps, a.eval_every = 1, 2, 5, 0
    from gspo.train.threads import setup_threads

    setup_threads(0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in range(a.seeds):
        r = run_seed(out, seed, a)
        results.append(r)
        print(f"seed {seed}: accuracy {r['accuracy_before']:.2f} -> {r['accuracy_after']:.2f}, tool calls "
              f"{r['tool_call_before']:.2f} -> {r['tool_call_after']:.2f} (warm-up {r['warmup_s']:.0f}s, "
              f"GSPO {r['rl_s']:.0f}s)", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = ["| seed | accuracy before | after | tool-call rate before | after | GSPO s |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['seed']} | {r['accuracy_before']:.2f} | {r['accuracy_after']:.2f} | "
                     f"{r['tool_call_before']:.2f} | {r['tool_call_after']:.2f} | {r['rl_s']:.0f} |")
    mean = lambda k: statistics.fmean(r[k] for r in results)  # noqa: E731
    lines.append(f"| mean | {mean('accuracy_before'):.2f} | {mean('accuracy_after'):.2f} | "
                 f"{mean('tool_call_before'):.2f} | {mean('tool_call_after'):.2f} | {mean('rl_s'):.0f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
