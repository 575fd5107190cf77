"""Turn a validated `Config` into the objects one training step needs (`RunContext`).

Everything that can be wrong with the input is checked here, cheapest first, before any model
loads: the run directory is writable, reward names resolve, the data loads and has its prompt
column, a requested checkpoint exists.
"""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo import checkpoint as ckpt
from gspo.config import Config, ConfigError, to_yaml
from gspo.data import DataError, PromptSampler, filter_long_prompts, format_prompt, load_rows
from gspo.models import load_policy, resolve_device, token_logprobs
from gspo.rewards import RewardRunner, RewardSpec, validate_specs
from gspo.rollout import HFGenerator, Rollout
from gspo.tasks import TASKS, TASK_CHARS, make_task


def setup_threads(n: int = 0) -> int:
    """torch CPU threads: `n`, or auto. On machines with <= 4 cores, one thread: on a 2-core VM
    (docs/benchmarks.md, bench/step.py --compare-threads) it was within 1.3-1.7x of the best
    setting in every case and never slowed by outside load, while 2 threads were 1.4x slower
    with OMP_WAIT_POLICY=PASSIVE and up to 3.3x slower without it once another process held a
    core. On bigger machines half the cores leaves room for reward workers (not yet measured)."""
    if n <= 0:
        if "OMP_NUM_THREADS" in os.environ:
            return torch.get_num_threads()
        cores = os.cpu_count() or 1
        n = 1 if cores <= 4 else max(cores // 2, 1)
    torch.set_num_threads(n)
    return n


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"config field 'output.dir': cannot write to run directory {run_dir}: {e.strerror or e}") from None


def reward_specs(cfg: Config) -> list[RewardSpec]:
    specs = []
    for f in cfg.rewards.functions:
        kwargs = dict(f.kwargs)
        if f.name == "code_tests":
            kwargs.setdefault("allow_code_execution", cfg.rewards.allow_code_execution)
        specs.append(RewardSpec(name=f.name, weight=f.weight, kwargs=kwargs))
    return specs


def load_prompt_rows(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows. Built-in tasks get a held-out split disjoint from training."""
    d = cfg.data
    if d.source in TASKS:
        train = make_task(d.source, d.num_prompts, seed=cfg.seed, difficulty=d.difficulty)
        seen = {r["prompt"] for r in train}
        held = [r for r in make_task(d.source, d.eval_num_prompts * 3, seed=cfg.seed + 1_000_003,
                                     difficulty=d.difficulty) if r["prompt"] not in seen]
        held = held[: d.eval_num_prompts]
    else:
        train = load_rows(d.source, prompt_column=d.prompt_column, split=d.split)
        held = []
    if d.eval_source:
        held = (make_task(d.eval_source, d.eval_num_prompts, seed=cfg.seed + 1_000_003, difficulty=d.difficulty)
                if d.eval_source in TASKS else load_rows(d.eval_source, prompt_column=d.prompt_column))
        held = held[: d.eval_num_prompts]
    return train, held


def build_policy(cfg: Config):
    """The policy and tokenizer: the built-in tiny model, or any HF causal LM."""
    m = cfg.model
    if m.name_or_path == "tiny":
        from gspo.tiny import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer("".join(sorted(TASK_CHARS)))
        model = build_tiny_model(tok, hidden_size=m.tiny_hidden_size, num_layers=m.tiny_num_layers,
                                 moe=m.tiny_moe, seed=cfg.seed,
                                 max_position_embeddings=max(128, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens))
        model.to(resolve_device(m.device))
    else:
        model, tok = load_policy(m.name_or_path, dtype=m.dtype, device=m.device,
                                 trust_remote_code=m.trust_remote_code)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model, tok


def lr_lambda(cfg: Config):
    s = cfg.schedule
    total = s.rollouts * s.num_minibatches

    def f(step: int) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.lr_schedule == "cosine":
            p = min((step - s.warmup_steps) / max(total - s.warmup_steps, 1), 1.0)
            return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
        return 1.0

    return f


@dataclass
class RunContext:
    """What one training step needs, built once from the config."""

    cfg: Config
    model: Any
    tokenizer: Any
    generator: Any
    rewards: RewardRunner
    sampler: PromptSampler
    eval_rows: list
    optimizer: torch.optim.Optimizer
    scheduler: Any
    chat: bool
    resume_from: Path | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def render(self, prompt) -> str:
        return format_prompt(prompt, self.tokenizer)

    def logprobs(self, part: Rollout) -> torch.Tensor:
        """Per-token log-probs of the completion tokens at the sampling temperature. (b, T)"""
        dev = next(self.model.parameters()).device
        return token_logprobs(self.model, part.input_ids.to(dev), part.attention_mask.to(dev),
                              part.completion_ids.shape[1], temperature=self.cfg.rollout.temperature,
                              chunk_size=self.cfg.model.logprob_chunk_size)

    def evaluate(self) -> dict:
        if not self.eval_rows:
            return {}
        from gspo.evaluate import evaluate

        e = self.cfg.eval
        return evaluate(self.model, self.tokenizer, self.eval_rows[: e.num_prompts], self.rewards,
                        max_new_tokens=self.cfg.rollout.max_new_tokens, pass_k=e.pass_k,
                        generator=self.generator, chat=self.chat)

    def save(self, state) -> Path:
        return ckpt.save_checkpoint(self.cfg.run_dir, state.step, model=self.model, optimizer=self.optimizer,
                                    scheduler=self.scheduler, trainer_state=asdict(state),
                                    config_text=to_yaml(self.cfg), keep_last=self.cfg.checkpoint.keep_last)

    def restore(self, path: Path) -> dict:
        return ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)

    def save_final(self) -> Path:
        out = self.cfg.run_dir / "final"
        self.model.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
        return out

    def close(self) -> None:
        self.rewards.close()


def build_context(cfg: Config) -> RunContext:
    """Validate inputs cheapest-first, then load the model and build the step's objects."""
    setup_threads(cfg.threads)
    run_dir = cfg.run_dir
    check_writable(run_dir)                                              # output dir
    specs = reward_specs(cfg)
    validate_specs(specs)                                                # reward names
    rows, eval_rows = load_prompt_rows(cfg)                              # data
    resume_from = ckpt.resolve_resume(run_dir, cfg.resume)              # checkpoint
    if resume_from is None and ((run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()):
        raise ConfigError(f"config field 'output.name': run directory {run_dir} already holds a run; "
                          f"continue it with resume=auto, or choose another output.name")
    if rows and isinstance(rows[0]["prompt"], list) and cfg.data.source in TASKS:
        raise DataError("built-in tasks are plain-text")
    chat = isinstance(rows[0]["prompt"], list)
    seed_everything(cfg.seed)
    model, tok = build_policy(cfg)                                       # model
    rows, dropped = filter_long_prompts(rows, tok, cfg.data.max_prompt_tokens)
    eval_rows, _ = filter_long_prompts(eval_rows, tok, cfg.data.max_prompt_tokens) if eval_rows else ([], 0)
    if dropped:
        print(f"dropped {dropped} prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}",
              file=sys.stderr)
    if not rows:
        raise DataError(f"data.source {cfg.data.source}: no prompt fits data.max_prompt_tokens="
                        f"{cfg.data.max_prompt_tokens}")
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    sampler = PromptSampler(rows, cfg.rollout.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    r = cfg.rollout
    if r.backend == "vllm":
        raise ConfigError("config field 'rollout.backend': vllm is not available in this build yet; use hf")
    generator = HFGenerator(model, tok, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            max_new_tokens=r.max_new_tokens, batch_size=r.batch_size or None)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.adam_eps,
                                  weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    runner = RewardRunner(specs, timeout_s=cfg.rewards.timeout_s, on_error=cfg.rewards.on_error,
                          num_workers=cfg.rewards.num_workers)
    return RunContext(cfg=cfg, model=model, tokenizer=tok, generator=generator, rewards=runner, sampler=sampler,
                      eval_rows=eval_rows, optimizer=optimizer, scheduler=scheduler, chat=chat,
                      resume_from=resume_from)
