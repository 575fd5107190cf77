"""A run's prompt rows, from its config: loaded (`load_prompt_rows`), checked against what the
rewards and one rollout need (`check_answer_column`, `enough_rows`), and cut to the prompts that
fit data.max_prompt_tokens (`fitting_prompts`). Training (`gspo.train.run.build_run`) and
`gspo eval` take their rows through here.
"""

from __future__ import annotations

import sys

from gspo.config import Config
from gspo.data import DataError, filter_long_prompts, load_rows
from gspo.tasks import TASKS, make_task


def load_prompt_rows(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows. Built-in tasks get a held-out split disjoint from training."""
    d = cfg.data
    if d.source in TASKS:
        train = make_task(d.source, d.num_prompts, seed=cfg.seed, difficulty=d.difficulty)
        seen = {r["prompt"] for r in train}
        n_held = cfg.eval.num_prompts
        held = [r for r in make_task(d.source, n_held * 3, seed=cfg.seed + 1_000_003,
                                     difficulty=d.difficulty) if r["prompt"] not in seen]
        held = held[:n_held]
    else:
        train = load_rows(d.source, prompt_column=d.prompt_column, split=d.split)
        held = []
    if d.eval_source:
        held = (make_task(d.eval_source, cfg.eval.num_prompts, seed=cfg.seed + 1_000_003, difficulty=d.difficulty)
                if d.eval_source in TASKS else load_rows(d.eval_source, prompt_column=d.prompt_column, split=d.eval_split))
        held = held[: cfg.eval.num_prompts]
    return train, held


def enough_rows(cfg: Config, n: int, which: str = "") -> None:
    """A rollout draws rollout.prompts_per_step distinct prompts: the data must hold that many."""
    if n < cfg.rollout.prompts_per_step:
        raise DataError(f"data.source {cfg.data.source}: {n} prompts{which}, fewer than one rollout's "
                        f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}")


def fitting_prompts(cfg: Config, rows: list[dict], tok, schemas: list[dict] | None, *, say: bool = True) -> list[dict]:
    """The rows whose prompt (with the tools' schemas of an episode) fits data.max_prompt_tokens,
    saying how many were dropped; one error when none fits. Training and `gspo eval` alike."""
    rows, dropped = filter_long_prompts(rows, tok, cfg.data.max_prompt_tokens, schemas)
    if dropped and say:
        print(f"dropped {dropped} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}",
              file=sys.stderr)
    if not rows:
        raise DataError(f"data.source {cfg.data.source}: no prompt fits data.max_prompt_tokens="
                        f"{cfg.data.max_prompt_tokens}")
    return rows


ANSWER_REWARDS = ("exact_answer", "math_verify")  # built-ins that compare with the `answer` column


def check_answer_column(cfg: Config, rows: list[dict]) -> None:
    """A built-in reward that compares with the `answer` column, on data that has none, would
    score nothing (every reward missing): one error before the model loads."""
    for i, f in enumerate(cfg.rewards.functions):
        if f.name in ANSWER_REWARDS and f.weight != 0 and not any(r.get("answer") is not None for r in rows):
            columns = sorted({k for r in rows[:100] for k in r})
            raise DataError(f"config field 'rewards.functions[{i}].name': {f.name} compares completions with the "
                            f"dataset's 'answer' column, which data.source {cfg.data.source} does not have (its "
                            f"columns: {', '.join(columns)}); name the reference answer 'answer' (MATH's is in "
                            f"'solution', GSM8K's after '####' in 'answer')")
