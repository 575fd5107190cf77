"""Turn a validated `Config` into the parts of a run (`Run`, by `build_run`).

Everything that can be wrong with the input is checked here, cheapest first, before any model
loads: the run directory is writable, reward names resolve, the data loads and has its prompt
column, a requested checkpoint exists.
"""

from __future__ import annotations

import math
import contextlib
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo.train import async_job, async_mode, distributed
from gspo.config import Config, ConfigError, to_yaml, validate_world
from gspo.config.rules import needs_reference, records_routes
from gspo.data import DataError, PromptStream, column_names, use_template_kwargs
from gspo.train.distributed import Dist
from gspo.train.prompts import (check_reward_columns, enough_rows, first_fitting, fitting_prompts, load_prompt_rows,
                                model_prompt_cap, prompt_cap, rows_source, say_held_out)
from gspo.train.resume import base_weights_fingerprint, claim_run_dir, release_run_dir, resume_point
from gspo.models import (base_model, half_precision_warnings, is_adapter_folder, load_policy, load_tokenizer,
                         resolve_device, set_activation_checkpointing, set_trainer_mode, takes_dynamic_cache,
                         use_cpu_gqa_attention)
from gspo.models.logprobs import LogprobModule
from gspo.algo import kl_loss_note
from gspo.rewards.runner import RewardRunner
from gspo.train.reward_specs import checked_reward_specs, reward_specs  # noqa: F401  (reward_specs: API)
from gspo.rollout.hf import HFGenerator
from gspo.train.episode_setup import (  # noqa: F401  (re-exported: the names users and the step import)
    Tools, checked_schemas, episode_tools, load_episode_tools, play_episodes)
from gspo.models.lora import lora_targets
from gspo.models.routing import RouteTracker, find_routers, no_routers
from gspo.tasks import TASKS, TASK_CHARS
from gspo.train.threads import setup_threads, threads_for_model


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"config field 'output.dir': cannot write to run directory {run_dir}: {e.strerror or e}") from None


def policy_tokenizer(cfg: Config):
    """The policy's tokenizer, before its model loads (the run checks its prompts with it
    first), with data.chat_template_kwargs: the built-in tiny model's character tokenizer, or
    the checkpoint's own (`load_tokenizer`). `build_policy` takes it."""
    if cfg.model.name_or_path == "tiny":
        from gspo.models.tiny import build_char_tokenizer

        tok = build_char_tokenizer("".join(sorted(TASK_CHARS)))
    else:
        tok = load_tokenizer(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
    use_template_kwargs(tok, cfg.data.chat_template_kwargs)
    return tok


def build_policy(cfg: Config, device: torch.device | None = None, tokenizer=None):
    """The policy and tokenizer: the built-in tiny model, or any HF causal LM; with LoRA
    adapters when `lora.enabled` (only they are trainable). `tokenizer`: `policy_tokenizer`'s,
    where the caller loaded it first."""
    m = cfg.model
    device = device or resolve_device(m.device)
    tok = tokenizer or policy_tokenizer(cfg)
    if m.name_or_path == "tiny":
        from gspo.models.tiny import build_tiny_model

        t = cfg.tiny
        model = build_tiny_model(tok, hidden_size=t.hidden_size, num_layers=t.num_layers, moe=t.moe,
                                 num_experts=t.num_experts, num_experts_per_tok=t.experts_per_tok, seed=cfg.seed,
                                 max_position_embeddings=max(128, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens))
        model.to(device)
    else:
        model, tok = load_policy(m.name_or_path, dtype=m.dtype, device=str(device),
                                 trust_remote_code=m.trust_remote_code, tokenizer=tok)
    use_cpu_gqa_attention(model)  # a no-op off the CPU or without grouped-query attention
    if m.gradient_checkpointing:
        try:
            set_activation_checkpointing(model, True)
        except ValueError as e:  # transformers: "XForCausalLM does not support activation checkpointing."
            raise ConfigError(f"config field 'model.gradient_checkpointing': {e} Set it to false.") from None
        model.config.use_cache = False
    if cfg.lora.enabled:
        import peft

        if is_adapter_folder(m.name_or_path) and os.environ.get("RANK", "0") == "0":
            print(f"note: model.name_or_path {m.name_or_path} is a LoRA adapter: it is merged into its base and the "
                  f"run trains new adapters on that; final/ (merged) loads anywhere, final/adapter in gspo, or in peft "
                  f"onto the base with this adapter merged first (docs/scaling.md)", file=sys.stderr)
        lc = cfg.lora
        targets, leave_out = lora_targets(model, list(lc.target_modules))
        try:
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, task_type="CAUSAL_LM",
                target_modules=targets, exclude_modules=leave_out or None))
        except ValueError as e:  # peft's own refusal of a target (a Mamba mixer's out_proj, a name that matches nothing)
            raise ConfigError(f"config field 'lora.target_modules': {e}") from e
    set_trainer_mode(model, dropout=m.dropout)  # after every wrapper: one mode for every trainer pass
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
class Run:
    """The parts of a training run, built once from the config by `build_run`; the step
    (`gspo.train`) holds the behaviour.

    `policy` is the model as transformers (or peft) built it; `trainer` is the module the loss
    runs through (`LogprobModule` around `policy`, sharded by FSDP2 or wrapped by DDP under
    torchrun); `generator_model` is the module the generator samples from: `policy` itself, or
    under FSDP2 a full copy that `push_weights` refreshes after every update."""

    cfg: Config
    dist: Dist
    policy: Any
    trainer: Any
    generator_model: Any
    tokenizer: Any
    generator: Any
    rewards: RewardRunner
    prompts: PromptStream
    eval_rows: list
    optimizer: torch.optim.Optimizer
    scheduler: Any
    chat: bool
    old_logp: str                     # rollout.old_logp resolved: trainer | sampler
    routes: Any = None                # gspo.models.routing.RouteTracker on a MoE model
    resume_from: Path | None = None   # the checkpoint to resume from
    remote: Any = None                # rollout.mode=async: gspo.train.async_mode.AsyncRollouts
    tools: Any = None                 # rollout.tools: the Tools episodes call (gspo.rollout.tools)
    reference: Any = None             # pi_ref's forward for algo.kl_coef / logging.kl_reference (needs_reference)
    base_weights: str = ""            # `resume.base_weights_fingerprint`: starting weights checkpoints do not hold
    lock: Path | None = None          # run_dir/.lock, rank 0's (`resume.claim_run_dir`)
    eval_columns: list | None = None  # the held-out data's columns, for every evaluation's reward calls
    no_signal: list = field(default_factory=list)  # per rollout of this session: every group's rewards equal
    no_signal_warned: float = -math.inf              # the rollout of the last no-signal warning
    reward_failures: int = 0                         # tolerated reward failures since the last warning
    reward_failures_warned: float = -math.inf        # the rollout of the last such warning
    silent_warned: float = -math.inf                 # ... and of the last about a function that scored nothing
    threads_before: int = 0                          # torch's CPU threads before the run, as `close` leaves them

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        self.rewards.close()
        release_run_dir(self.lock)
        if self.tools is not None:
            self.tools.runner.close()
        if hasattr(self.generator, "close"):  # the vllm engine's memory
            self.generator.close()
        if self.routes is not None:
            self.routes.close()
        distributed.shutdown(self.dist)
        if self.threads_before:  # (a caller's own setting, in a process that goes on)
            torch.set_num_threads(self.threads_before)


def policy_state(trainer_state: dict) -> dict:
    """The policy's own names of a `LogprobModule` state dict (its keys are "policy.<name>")."""
    prefix = "policy."
    return {k[len(prefix):]: v for k, v in trainer_state.items()}


def push_weights(run: Run) -> None:
    """After an update: the generator gets the new weights (a no-op when it samples from the
    trainer's own module; under FSDP2 the full copy is refreshed from the shards first)."""
    if run.generator_model is not run.policy:
        run.generator_model.load_state_dict(policy_state(distributed.full_state_dict(run.trainer, run.dist)),
                                            strict=True)
    run.generator.sync_weights(run.generator_model)


def resolve_old_logp(cfg: Config, has_routers: bool) -> str:
    """`rollout.old_logp=auto`: the sampler's log-probs when they are the numbers a trainer pass
    would compute (the hf backend samples from the trainer's own fp32 weights in the trainer's
    mode, `gspo.models.set_trainer_mode`, so the two agree to float rounding, ~1e-6; the
    mismatch monitor logs the gap every rollout) and the pass would be pure waste; the trainer
    pass when they are not (vLLM, a bf16 / fp16 sampler or learner, dropout in the trainer's
    passes) or when the pass has work of its own (recording MoE routes for routing/changed_frac
    and Routing Replay) that the sampler cannot do: a MoE's routes are recorded by gspo's own
    decode loop as it samples (R3, `records_routes`), so only transformers' generate, vLLM and
    multi-turn episodes need the pass for them."""
    r = cfg.rollout
    if r.old_logp != "auto":
        return r.old_logp
    routes_ok = records_routes(cfg) or not (has_routers or cfg.algo.routing_replay)
    if r.mode == "async":  # the sampler's, as the paper takes the engine's (section 5.4)
        return "sampler" if routes_ok else "trainer"
    same_numbers = (r.backend == "hf" and cfg.model.dtype == "float32" and cfg.model.mixed_precision == "no"
                    and r.mixed_precision == "no" and not cfg.model.dropout)
    return "sampler" if same_numbers and routes_ok else "trainer"


def resolve_correction(cfg: Config, old_logp: str) -> str:
    """`algo.mismatch_correction=auto`: token-level TIS (C = algo.mismatch_cap) for GRPO's token
    level when pi_old is the trainer's in async mode, else none. On the demo task at K = 2 (3
    seeds, docs/async.md) TIS lifted GRPO's held-out accuracy on every seed and left GSPO's
    where it was; with the sampler's pi_old the weight is 1 and there is nothing to correct."""
    a = cfg.algo
    if a.mismatch_correction != "auto":
        return a.mismatch_correction
    stale = cfg.rollout.mode == "async" and old_logp == "trainer"
    return "tis" if stale and a.level == "token" and a.mismatch_level == "token" else "none"


def weight_dtype_notes(cfg: Config) -> list[str]:
    """Trainable weights in half precision (`model.dtype`, no LoRA: peft keeps adapters in fp32):
    float16 is refused (no loss scaling and no fp32 master copy: AdamW's moments and steps
    underflow and overflow, and a probe's weights moved by up to 0.95 in 8 steps at lr 1e-6);
    bfloat16 gets a warning, since a step smaller than half a weight's bf16 spacing (2^-8 of its
    size) rounds away: at lr 1e-6 on weights ~0.02 nearly all do. Returns the warnings."""
    m = cfg.model
    if cfg.lora.enabled or m.dtype == "float32":
        return []
    if m.dtype == "float16":
        raise ConfigError("config field 'model.dtype': float16 weights do not train here (no loss scaling, no fp32 "
                          "master copy: AdamW's updates underflow and overflow); use model.dtype=float32 with "
                          "model.mixed_precision=bf16 (fp32 weights, bf16 compute), or LoRA over a float16 base")
    return [f"model.dtype={m.dtype} keeps the trained weights themselves in {m.dtype}: an update smaller than "
            f"half a weight's {m.dtype} spacing (about 0.4% of its size) is rounded away, which at optim.lr={cfg.optim.lr:g} "
            f"is most of them; model.dtype=float32 with model.mixed_precision=bf16 computes in bf16 over fp32 "
            f"weights"]


def _check_extras(cfg: Config) -> None:
    if cfg.lora.enabled:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ConfigError("config field 'lora.enabled': LoRA needs peft: pip install 'gspo[lora]'") from None
    if cfg.rollout.backend == "vllm":
        from gspo.rollout.vllm import check_available

        check_available()  # vllm importable, and a CUDA device or a CPU build of vLLM
    from gspo.report.trackers import check_available as check_trackers

    check_trackers(cfg.logging.report_to)  # each named tracker's package


def hf_generator(cfg: Config, model, tok, *, greedy: bool = False) -> HFGenerator:
    """The hf backend's sampler with the rollout settings; `greedy`: the argmax at every step
    (top-k 1), as held-out episodes are played. A model whose forward takes no DynamicCache
    (MiniMax-Text's cache class of its own) is refused gspo's decode loop, naming the setting."""
    r = cfg.rollout
    if r.backend == "hf" and r.decode == "gspo" and not takes_dynamic_cache(model):
        raise ConfigError(f"config field 'rollout.decode': {type(base_model(model)).__name__} keeps its decode state "
                          "in a cache class of its own, which gspo's decode loop does not drive; set "
                          "rollout.decode=generate (transformers' generate, with the same sampling rule)")
    return HFGenerator(model, tok, temperature=r.temperature, top_p=1.0 if greedy else r.top_p,
                       top_k=1 if greedy else r.top_k,
                       max_new_tokens=r.max_new_tokens, batch_size=r.batch_size or None,
                       engine="hf" if r.decode == "generate" else "gspo",
                       autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(r.mixed_precision))


def _vllm_generator(cfg: Config, model, tok, d: Dist, workdir: Path | None = None):
    """A colocated vLLM engine holding `model`'s weights (LoRA merged); it gets the trainer's
    new weights through `push_weights` after every update. Under torchrun every process runs
    its own engine on its own prompts (a vLLM data-parallel rank); under FSDP2 it is fed from
    the full copy that `push_weights` refreshes."""
    from gspo.rollout.vllm import VLLMGenerator

    r, v = cfg.rollout, cfg.vllm
    max_len = v.max_model_len
    if not max_len:  # what start-up filtering lets through, within the model's positions
        max_len = cfg.data.max_prompt_tokens + r.max_new_tokens
        cap = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        max_len = min(max_len, cap) if isinstance(cap, int) and cap > 0 else max_len
    return VLLMGenerator(model, tok, workdir=workdir or cfg.run_dir / "vllm", temperature=r.temperature, top_p=r.top_p,
                         top_k=r.top_k, max_new_tokens=r.max_new_tokens, max_model_len=max_len,
                         gpu_memory_utilization=v.gpu_memory_utilization, sleep=v.sleep, dtype=v.dtype,
                         enforce_eager=v.enforce_eager, kv_cache_gb=v.kv_cache_gb, seed=cfg.seed,
                         world_size=d.world_size, quiet=not d.is_main)


def fitted_rows(cfg: Config, rows: list[dict], eval_rows: list[dict], tok, schemas, cap: tuple[int, str], *,
                say: bool, again: bool = False) -> tuple[list[dict], list[dict], int]:
    """The training and held-out rows whose prompts fit `cap` (`fitting_prompts`), and how many
    held-out ones did not; an error where too few training rows are left. `again`: a second
    pass under a model's learned positions, whose notes on the prompts were said the first time."""
    rows = fitting_prompts(cfg, rows, tok, schemas, say=say, cap=cap, notes=not again)
    eval_rows, dropped_held = first_fitting(eval_rows, cfg.eval.num_prompts, tok, cap[0], schemas,
                                            source=rows_source(cfg, held=True))
    enough_rows(cfg, len(rows), f" of {cap[0]} tokens or fewer ({cap[1]})")
    return rows, eval_rows, dropped_held


def build_run(cfg: Config) -> Run:
    """Validate inputs cheapest-first, then load the model and build the step's objects (torch's
    CPU threads are the run's until `Run.close`, or a failure here, sets the caller's back)."""
    threads_before = torch.get_num_threads()
    try:
        return _build_run(cfg, threads_before)
    except BaseException:
        torch.set_num_threads(threads_before)
        raise


def _build_run(cfg: Config, threads_before: int) -> Run:
    setup_threads(cfg.threads)
    asynchronous = cfg.rollout.mode == "async"
    store = None
    if asynchronous:  # the learner ranks' own group; their job with the generators is async_mode's
        async_job.check_world(cfg)
        d, store = async_job.learner_dist(cfg, resolve_device(cfg.model.device))
    else:
        d = distributed.init_distributed(cfg.distributed.strategy, resolve_device(cfg.model.device),
                                         cfg.distributed.backend, cfg.distributed.timeout_s)
    validate_world(cfg, d.world_size)                                    # world size
    _check_extras(cfg)                                                   # optional packages
    kl_note = kl_loss_note(cfg.algo.kl_estimator, cfg.algo.kl_coef)
    for line in [*weight_dtype_notes(cfg), *([kl_note] if kl_note else [])]:  # half-precision weights, a k1 loss
        if d.is_main:
            print(f"warning: {line}", file=sys.stderr)
    specs = checked_reward_specs(cfg)                                    # reward names
    tools = load_episode_tools(cfg)                                      # tool names
    rows, eval_rows = load_prompt_rows(cfg)                              # data
    enough_rows(cfg, len(rows))
    check_reward_columns(cfg, rows, specs=specs)
    if cfg.eval.enabled:
        check_reward_columns(cfg, eval_rows, held=True, specs=specs)
    if rows and isinstance(rows[0]["prompt"], list) and cfg.data.source in TASKS:
        raise DataError("built-in tasks are plain-text")
    chat = isinstance(rows[0]["prompt"], list) or tools is not None  # episodes are conversations
    if tools is not None and asynchronous and d.world_size > 1 and cfg.distributed.strategy == "fsdp" \
            and cfg.eval.enabled:
        raise ConfigError("config field 'eval.enabled': held-out episodes under async mode with FSDP2 learners "
                          "would be played on a generator, which does not run them yet; set eval.enabled=false "
                          "or distributed.strategy=ddp")
    tok = policy_tokenizer(cfg)                                          # tokenizer
    schemas = checked_schemas(cfg, tools, tok, say=d.is_main)           # its chat template, for episodes
    held_out = eval_rows  # (all of them: a second pass under learned positions takes its first that fit too)
    rows, eval_rows, dropped_held = fitted_rows(cfg, rows, held_out, tok, schemas, prompt_cap(cfg), say=d.is_main)
    run_dir = cfg.run_dir
    made = not run_dir.exists()
    check_writable(run_dir)                                              # output dir
    lock = claim_run_dir(run_dir, d)
    try:
        resume_from = resume_point(cfg, d)                               # checkpoint
        job = async_job.start_job(cfg, d.device, store) if asynchronous else None  # generators load as the learner does
        seed_everything(cfg.seed)
        model, tok = build_policy(cfg, d.device, tok)                    # model
        threads_for_model(cfg, model)
        if d.is_main:  # half precision where this CPU emulates it (measured after the thread count is set)
            settings = {"model.dtype": cfg.model.dtype, "model.mixed_precision": cfg.model.mixed_precision,
                        "rollout.mixed_precision": cfg.rollout.mixed_precision}
            for line in half_precision_warnings(settings, d.device):
                print(f"warning: {line}", file=sys.stderr)
        cap = model_prompt_cap(cfg, model, say=d.is_main, rows=[*rows, *eval_rows], tok=tok, schemas=schemas)
        if cap != prompt_cap(cfg):
            rows, eval_rows, dropped_held = fitted_rows(cfg, rows, held_out, tok, schemas, cap, say=d.is_main,
                                                        again=True)
        if d.is_main:
            say_held_out(cfg, eval_rows, dropped_held, cap)
        r = cfg.rollout
        prompts = PromptStream(rows, r.prompts_per_step // d.world_size, seed=cfg.seed, shuffle=cfg.data.shuffle,
                               rank=d.rank, world_size=d.world_size, source=cfg.data.source)
        mp = cfg.model.mixed_precision == "bf16"
        # async mode samples on the generators: the learners hold no copy and no engine of their own
        generator_model = model if asynchronous else distributed.generator_copy(model, d) or model
        has_routers = bool(find_routers(model))
        old_logp = resolve_old_logp(cfg, has_routers=has_routers)
        cfg.algo.mismatch_correction = resolve_correction(cfg, old_logp)
        # MoE routes come from the trainer's pi_old pass, or with the sampler's pi_old from gspo's decode loop (R3)
        sampler_routes = old_logp == "sampler" and records_routes(cfg) and has_routers
        routes = RouteTracker(model) if old_logp == "trainer" or sampler_routes else None  # the trainer's routers only
        if cfg.algo.routing_replay and not (routes and routes.active):
            raise ConfigError(f"config field 'algo.routing_replay': no routes to replay: {no_routers(model)}")
        if cfg.algo.router_aux_loss_coef > 0:
            if not has_routers:
                raise ConfigError(f"config field 'algo.router_aux_loss_coef': no routers to balance: "
                                  f"{no_routers(model)}")
            routes = routes or RouteTracker(model)  # (its hooks see every router call of the update pass)
            routes.aux = True
        if routes is not None and (cfg.algo.routing_replay or routes.aux):  # routers they cannot serve: refused now
            routes.check_rules(model, replay=cfg.algo.routing_replay, aux=routes.aux)
        autocast = torch.bfloat16 if mp and not (d.enabled and d.strategy == "fsdp") else None

        def logprob_module(policy):
            return LogprobModule(policy, temperature=r.temperature, chunk_size=cfg.model.logprob_chunk_size,
                                 autocast_dtype=autocast, share_prompt=cfg.model.share_prompt,
                                 share_min_work=cfg.model.share_prompt_min_work)

        base_weights = base_weights_fingerprint(cfg, model)  # before any checkpoint is loaded into it
        frozen = frozen_copy(model) if needs_reference(cfg) and not cfg.lora.enabled else None  # before sharding
        trainer = distributed.wrap_for_training(logprob_module(model), model, d,
                                                mixed_precision=cfg.model.mixed_precision,
                                                reshard_after_forward=cfg.distributed.reshard_after_forward)
        reference = None  # pi_ref's forward, through the trainer's own chunked log-prob path
        if frozen is not None:
            reference = distributed.wrap_frozen(logprob_module(frozen), frozen, d,
                                                mixed_precision=cfg.model.mixed_precision)
        elif needs_reference(cfg):  # LoRA: the base model is the trainer with its adapters off
            reference = AdaptersOff(trainer, model)
        if r.backend == "vllm" and not asynchronous:  # (async: the engines run on the generators)
            generator = _vllm_generator(cfg, generator_model, tok, d)
        else:
            generator = hf_generator(cfg, generator_model, tok)
            if sampler_routes and not asynchronous:  # every rollout carries the routes its decode loop chose
                generator.routes = RouteTracker(generator_model)
        params = [p for p in trainer.parameters() if p.requires_grad]
        o = cfg.optim
        # the fused kernel: one pass over each parameter (on a CPU ~4x faster than the default loop)
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        optimizer = torch.optim.AdamW(param_groups(cfg, trainer, params), lr=o.lr, betas=(o.beta1, o.beta2),
                                      eps=o.adam_eps, weight_decay=o.weight_decay, fused=fused or None)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        runner = RewardRunner(specs, timeout_s=cfg.rewards.timeout_s, on_error=cfg.rewards.on_error,
                              num_workers=cfg.rewards.num_workers)
        remote = None
        if job is not None:
            async_job.connect(job, cfg, d.device)
            remote = async_mode.AsyncRollouts(cfg, job, model, tok, prompts, cfg.schedule.rollouts)
        if d.is_main and resume_from is None:  # the run is set up (a resume writes it once it goes on: `loop.train`)
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        return Run(cfg=cfg, dist=d, policy=model, trainer=trainer, generator_model=generator_model, tokenizer=tok,
                   generator=generator, rewards=runner, prompts=prompts, eval_rows=eval_rows,
                   eval_columns=column_names(held_out), optimizer=optimizer,
                   scheduler=scheduler, chat=chat, old_logp=old_logp,
                   routes=routes if routes and routes.active else None,
                   resume_from=resume_from, remote=remote, reference=reference, base_weights=base_weights, lock=lock,
                   tools=episode_tools(cfg, tools),  # (async: the generators play the episodes; these serve eval)
                   threads_before=threads_before)
    except BaseException:  # a run that never started leaves no directory of its own behind
        release_run_dir(lock)
        if made and d.is_main:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise


def param_groups(cfg: Config, trainer, params: list) -> list[dict]:
    """AdamW's parameter groups: one, or with `optim.router_lr_scale` the MoE routers' weights
    apart at lr × that scale (the rest first, so `lr` in the metrics is optim.lr's schedule)."""
    scale = cfg.optim.router_lr_scale
    if scale == 1.0:
        return [{"params": params}]
    ids = {id(p) for router in find_routers(trainer) for p in router.parameters()}
    routers = [p for p in params if id(p) in ids]
    if not routers:
        raise ConfigError("config field 'optim.router_lr_scale': the model has no trainable MoE router weights")
    return [{"params": [p for p in params if id(p) not in ids]}, {"params": routers, "lr": cfg.optim.lr * scale}]


def frozen_copy(model):
    """The KL reference's weights: a frozen copy of the starting model, made before it trains.
    (With LoRA there is none: the base model itself is the reference, `AdaptersOff`.)"""
    import copy

    frozen = copy.deepcopy(model)
    frozen.requires_grad_(False)
    return frozen


class AdaptersOff:
    """The KL reference of a LoRA run: the trainer's own forward with the adapters disabled
    (peft's `disable_adapter`), i.e. the frozen base model, at no extra weight memory."""

    def __init__(self, trainer, policy):
        self.trainer, self.policy = trainer, policy

    def __call__(self, input_ids, attention_mask, completion_len, share=None):
        with self.policy.disable_adapter():
            return self.trainer(input_ids, attention_mask, completion_len, share)
