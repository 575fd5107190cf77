"""GPU check: a few GSPO rollouts on a random model with the Qwen2.5-0.5B shape, under
torchrun + FSDP2 in bf16 (fp32 master weights), reporting tokens/s per phase and the update
phase's model-FLOPs utilisation (MFU).

    torchrun --standalone --nproc_per_node=1 bench/gpu_check.py            # one H200: <= 8 min
    python bench/gpu_check.py --small --launch                             # CPU smoke of the script

It saves the random model (built from a Qwen2Config; nothing is downloaded) with gspo's
character tokenizer (ids beyond it decode to nothing, which is fine for throughput), then runs
`gspo train` on it and reads `metrics.jsonl`:

- generate, π_old and update: seconds per rollout, and tokens/s (completion tokens for
  generation; prompt + completion tokens for the two trainer passes);
- update MFU = 6 · parameters · tokens trained / update seconds / peak bf16 FLOP/s (dense;
  989 TFLOP/s for H100/H200 unless --peak-tflops says otherwise). Gradient checkpointing's
  recomputation and attention FLOPs are not counted (the usual MFU convention).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2)
SMALL = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def build_model(path: Path, shape: dict, seed: int = 0) -> int:
    """Save a random Qwen2 of `shape` and gspo's char tokenizer to `path`; returns #params."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gspo.tasks import TASK_CHARS
    from gspo.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer("".join(sorted(TASK_CHARS)))
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def peak_flops(override_tflops: float) -> float:
    import torch

    if override_tflops:
        return override_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if "H100" in name or "H200" in name:
            return 989e12
        if "A100" in name:
            return 312e12
    return float("nan")


def train_args(model_dir: Path, out: Path, a: argparse.Namespace) -> list[str]:
    return ["train", f"model.name_or_path={model_dir}", "model.mixed_precision=bf16",
            "model.gradient_checkpointing=true", "distributed.strategy=fsdp",
            f"rollout.prompts_per_step={a.prompts}", f"rollout.group_size={a.group}",
            f"rollout.max_new_tokens={a.new_tokens}", f"schedule.rollouts={a.rollouts}",
            "schedule.num_minibatches=4", f"schedule.micro_batch_size={a.micro}", "optim.lr=1e-6",
            "eval.enabled=false", "logging.console=false", "logging.completions_every=0",
            f"output.dir={out}", "output.name=gpu_check"]


def summarize(run: Path, n_params: int, peak: float) -> dict:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by_rollout: dict[int, list[dict]] = {}
    for r in recs:
        if r.get("rollout"):
            by_rollout.setdefault(r["rollout"], []).append(r)
    rolls = [v for k, v in sorted(by_rollout.items()) if k > 1] or list(by_rollout.values())  # skip warm-up
    first = [v[0] for v in rolls]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    t_gen, t_old = mean([r["time/generate"] for r in first]), mean([r["time/old_logp"] for r in first])
    t_upd = mean([sum(s["time/update"] for s in v) for v in rolls])
    comp, total = mean([r["tokens/completion"] for r in first]), mean([r["tokens/total"] for r in first])
    out = {"params": n_params, "rollouts_timed": len(rolls), "completion_tokens": comp, "total_tokens": total,
           "generate_s": t_gen, "generate_tok_s": comp / t_gen, "old_logp_s": t_old, "old_logp_tok_s": total / t_old,
           "update_s": t_upd, "update_tok_s": total / t_upd, "step_s": mean([r["time/step"] for r in first]),
           "update_mfu": 6 * n_params * total / t_upd / peak}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny model of the same family (CPU smoke)")
    p.add_argument("--launch", action="store_true", help="start torchrun (1 process) from here")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gspo-gpu-check"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    a = p.parse_args(argv)
    if a.small:
        a.prompts, a.group, a.new_tokens, a.micro, a.rollouts = 4, 4, 8, 4, 2
    out = Path(a.out)
    model_dir = out / "model"
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0 and not (model_dir / "config.json").exists():
        n_params = build_model(model_dir, SMALL if a.small else QWEN05)
        (model_dir / "n_params.txt").write_text(str(n_params))
    run_args = train_args(model_dir, out / "runs", a)
    if a.launch:  # a fresh torchrun of `python -m gspo train` (one process per GPU, or one on a CPU)
        import torch

        n = max(torch.cuda.device_count(), 1)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               "-m", "gspo", *run_args]
        subprocess.run(cmd, check=True)
    else:  # already under torchrun: train in this process
        from gspo.cli import main as gspo_main

        if "RANK" in os.environ:
            import torch.distributed as dist

            if not dist.is_initialized():  # wait for rank 0's model files
                backend = "nccl" if __import__("torch").cuda.is_available() else "gloo"
                dist.init_process_group(backend)
            dist.barrier()
        rc = gspo_main(run_args)
        if rc:
            raise SystemExit(rc)
    if not rank0:
        return {}
    n_params = int((model_dir / "n_params.txt").read_text())
    res = summarize(out / "runs" / "gpu_check", n_params, peak_flops(a.peak_tflops))
    print(json.dumps(res, indent=1))
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
