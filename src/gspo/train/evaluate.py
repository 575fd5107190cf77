"""Held-out evaluation: greedy accuracy, mean reward and (optionally) pass@k.

Accuracy is the fraction of prompts whose greedy completion gets full marks (>= 1) from the
first reward function, which by convention is the correctness check (e.g. `exact_answer`).
pass@k uses the unbiased estimator of Chen et al. (2021) over k sampled completions per prompt.
"""

from __future__ import annotations

import math

import torch

from gspo.config import EvalConfig
from gspo.data import column_names, encode_texts, format_prompt, reward_views
from gspo.models import eos_token_ids, generation_mode
from gspo.rewards import reward_columns
from gspo.rollout import chunk_seed, completion_mask, decode_completions, left_pad


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], *, max_new_tokens: int,
                       batch_size: int = 64) -> list[str]:
    """Greedy completions of rendered prompts, tokenized as the sampler tokenizes them
    (`gspo.data.encode_texts`), under `gspo.models.generation_mode`: the argmax of the
    policy's logits at every step, whatever the checkpoint's generation config says."""
    dev = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    eos_t = torch.tensor(eos, device=dev)
    out = []
    with generation_mode(model):
        for i in range(0, len(prompts), batch_size):
            ids, mask = left_pad(encode_texts(tokenizer, prompts[i:i + batch_size]), pad, dev)
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
            comp = gen[:, ids.shape[1]:]  # (B, T): up to and including the first EOS, then padding
            keep = completion_mask(comp, eos_t)[0].bool()
            out.extend(decode_completions(tokenizer, comp, keep, eos_t))
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k draws (without replacement) from n samples, c correct, is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def _score(runner, rows: list[dict], texts: list[str], repeat: int,
           columns: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rewards of completion texts, `repeat` a row, in TRL's shapes for each row's prompt (`reward_views`):
    the weighted sums, the first function's values, and how many calls failed under rewards.on_error."""
    prompts = [r["prompt"] for r in rows for _ in range(repeat)]
    prompts, completions = reward_views(prompts, texts)
    res = runner.score(prompts, completions, reward_columns(rows, repeat, columns))
    first = next(iter(res.per_function))
    failed = int(res.stats.get("reward/errors", 0) + res.stats.get("reward/timeouts", 0))  # (on_error=skip|zero)
    return res.rewards, torch.tensor(res.per_function[first], dtype=torch.float32), failed


def evaluate(model, tokenizer, rows: list[dict], runner, *, max_new_tokens: int, pass_k: int = EvalConfig.pass_k,
             generator=None, complete=None, seed: int = 0, columns: list[str] | None = None) -> dict:
    """Metrics named `eval/...`: accuracy and mean reward of greedy completions, pass@k if asked.
    Accuracy (the first reward function's value >= 1) and pass@k are over the prompts that
    function scored; the mean reward over those any function scored (`eval/missing_frac`: the
    prompts none did, e.g. no answer).
    `complete(texts, pass_k) -> (greedy, samples or None, samples per prompt)` computes the
    completions elsewhere (async mode: on a generator); by default `model` and `generator` here.
    `columns`: the held-out data's columns, which every reward call gets (default: these rows')."""
    texts = [format_prompt(r["prompt"], tokenizer) for r in rows]
    if complete is None:
        def complete(texts: list[str], k: int):
            greedy = greedy_completions(model, tokenizer, texts, max_new_tokens=max_new_tokens)
            if not (k and generator is not None):
                return greedy, None, 0
            ro = generator.generate(texts, max(k, 2), seed=seed)  # (the same samples every time)
            return greedy, ro.completions, ro.group_size

    comps, samples, n = complete(texts, pass_k)
    total, first, failed = _score(runner, rows, comps, 1, columns)
    scored = ~torch.isnan(first)  # a prompt the first function did not score (no answer) is neither right nor wrong
    ok = first[scored] >= 1.0 - 1e-9
    m = {"eval/accuracy": ok.float().mean().item() if scored.any() else float("nan"),
         "eval/reward_mean": torch.nanmean(total).item(),
         "eval/missing_frac": torch.isnan(total).float().mean().item()}  # no function scored it (TRL's nansum)
    if failed:
        m["eval/reward_failures"] = failed
    if samples is not None:
        _, first_k, _ = _score(runner, rows, samples, n, columns)
        first_k = first_k.view(len(rows), n)
        kept = ~torch.isnan(first_k).all(-1)
        correct = (first_k >= 1.0 - 1e-9).sum(-1)[kept]
        m[f"eval/pass@{pass_k}"] = (sum(pass_at_k(n, int(c), pass_k) for c in correct) / len(correct)
                                    if len(correct) else float("nan"))
    return m


def evaluate_run(run, version: int = 0) -> dict:
    """A training run's held-out metrics (`gspo.train.run.Run`) under weights `version`, logged
    by rank 0 alone (other ranks return {}), computed on the generator's copy of the weights
    (full on every strategy); in async mode with FSDP2, where no learner rank holds them all, on
    a generator process, which every learner rank sends its part of the weights (so every rank
    calls this)."""
    if not run.eval_rows:
        return {}
    cfg = run.cfg
    if run.remote is not None and run.dist.enabled and run.dist.strategy == "fsdp":  # no full copy here
        kw = dict(max_new_tokens=cfg.rollout.max_new_tokens, pass_k=cfg.eval.pass_k)
        if not run.dist.is_main:
            run.remote.evaluate(version, [], **kw)
            return {}

        def complete(texts: list[str], k: int):
            out = run.remote.evaluate(version, texts, **kw)
            return out["greedy"], out["samples"], out["group_size"]

        return evaluate(None, run.tokenizer, run.eval_rows[: cfg.eval.num_prompts], run.rewards,
                        complete=complete, columns=run.eval_columns, **kw)
    if not run.dist.is_main:
        return {}
    from gspo.train.run import hf_generator

    generator = run.generator
    if cfg.rollout.backend == "vllm" and run.dist.world_size > 1:
        # vLLM's data-parallel ranks step together: rank 0 cannot sample alone
        generator = hf_generator(cfg, run.generator_model, run.tokenizer)
    if run.tools is not None:
        return evaluate_episodes(run, run.eval_rows[: cfg.eval.num_prompts], generator)
    return evaluate(run.generator_model, run.tokenizer, run.eval_rows[: cfg.eval.num_prompts], run.rewards,
                    max_new_tokens=cfg.rollout.max_new_tokens, pass_k=cfg.eval.pass_k, generator=generator,
                    seed=chunk_seed(cfg.seed, version, 2),  # (as a generator process seeds them, async_generator)
                    columns=run.eval_columns)


@torch.no_grad()
def evaluate_episodes(run, rows: list[dict], generator) -> dict:
    """Held-out multi-turn episodes with the run's tools and environment: one greedy episode per
    prompt gives accuracy (the first reward function's full marks on the whole episode), mean
    reward, how often the model called a tool and its turns; with eval.pass_k, k episodes per
    prompt sampled by `generator` give pass@k. A failed episode counts as wrong."""
    from gspo.train.produce import score  # the scoring rule of training episodes
    from gspo.train.run import hf_generator, play_episodes

    cfg = run.cfg

    def play(generator, repeat: int):
        ro = play_episodes(cfg, generator, run.tokenizer, run.tools, rows, seed=0, offset=0, group_size=repeat)
        res = score(run, rows, ro, getattr(run, "eval_columns", None) or column_names(rows))  # (the held-out data's)
        first = torch.tensor(res.per_function[next(iter(res.per_function))], dtype=torch.float32)
        failed = torch.tensor([f == "error" for f in ro.finish_reason])
        return ro, (first >= 1.0 - 1e-9) & ~failed, torch.where(failed, torch.nan, res.rewards)

    ro, ok, total = play(hf_generator(cfg, run.generator_model, run.tokenizer, greedy=True), 1)
    m = {"eval/accuracy": ok.float().mean().item(), "eval/reward_mean": torch.nanmean(total).item(),
         "eval/tool_call_frac": ro.episode_stats["episode/tool_call_frac"],
         "eval/turns_mean": ro.episode_stats["episode/turns_mean"]}
    k = cfg.eval.pass_k
    if k:
        n = max(k, 2)
        _, ok_k, _ = play(generator, n)
        correct = ok_k.view(len(rows), n).sum(-1)
        m[f"eval/pass@{k}"] = sum(pass_at_k(n, int(c), k) for c in correct) / len(rows)
    return m
