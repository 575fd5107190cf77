"""The configuration's cross-field rules (`validate`, and `validate_world` once the number of
processes is known): every failure is one `ConfigError` naming the field, raised before any
model loads."""

from __future__ import annotations

import dataclasses
import math
import re

from gspo.config.fields import (OBJECTIVE_CLIP, PAPER_CLIP, TRACKER_NAMES, AlgoConfig, Config, ConfigError,
                                 RolloutConfig)


def runs_model_code(reward_name: str) -> bool:
    """The code_tests reward, by its built-in name or its import path: it runs model-written code,
    so it needs rewards.allow_code_execution."""
    return reward_name.replace(" ", "") in ("code_tests", "gspo.rewards.sandbox:code_tests_reward",
                                            "gspo.rewards.sandbox.code_tests_reward")

# ---------------------------------------------------------------- validation


def _check(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config field '{field_name}': {msg}")


def validate_world(cfg: Config, world_size: int) -> None:
    """The rules that depend on the number of processes (checked again once torchrun's is known):
    every rank gets whole prompts, its share splits into sampling chunks, and every chunk
    splits into the minibatches (so each optimizer step sees every rank's data)."""
    r, s = cfg.rollout, cfg.schedule
    _check(r.prompts_per_step % world_size == 0, "rollout.prompts_per_step",
           f"{r.prompts_per_step} prompts do not split evenly over {world_size} processes")
    share = r.prompts_per_step // world_size * r.group_size
    chunk = r.batch_size or share
    _check(share % chunk == 0, "rollout.batch_size",
           f"each process's {share} sequences do not split into chunks of {chunk}")
    _check(chunk % s.num_minibatches == 0, "schedule.num_minibatches",
           f"a sampling chunk of {chunk} sequences (rollout.batch_size, or each process's share) does not "
           f"split into {s.num_minibatches} minibatches")
    per_rank_mb = share // s.num_minibatches
    _check(s.micro_batch_size <= per_rank_mb or world_size == 1, "schedule.micro_batch_size",
           f"{s.micro_batch_size} is larger than each process's part of a minibatch ({per_rank_mb} sequences)")
    _check(s.micro_batch_size == 0 or per_rank_mb % s.micro_batch_size == 0, "schedule.micro_batch_size",
           f"each process's part of a minibatch ({per_rank_mb} sequences) does not split into micro-batches "
           f"of {s.micro_batch_size}")


def _algo_field(err: ValueError) -> str:
    """The algo.* field a `gspo.algo` validation message is about: it starts with the argument's
    name (`eps_low ...`, `aggregation='token-mean' ...`, `mismatch_cap ...`)."""
    word = re.split(r"[\s=:,]", str(err), maxsplit=1)[0]
    word = {"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"}.get(word, word)
    return f"algo.{word}" if word in {f.name for f in dataclasses.fields(AlgoConfig)} else "algo"


def validate(cfg: Config) -> None:
    """Cross-field rules that types cannot express. Raises one ConfigError naming the field."""
    from gspo import algo

    m, d, r, s = cfg.model, cfg.data, cfg.rollout, cfg.schedule
    _check(m.dtype in ("float32", "bfloat16", "float16"), "model.dtype", f"'{m.dtype}' is not float32 | bfloat16 | float16")
    _check(m.mixed_precision in ("no", "bf16"), "model.mixed_precision", f"'{m.mixed_precision}' is not no | bf16")
    _check(not (m.mixed_precision == "bf16" and m.dtype != "float32"), "model.mixed_precision",
           f"bf16 mixed precision keeps fp32 master weights: set model.dtype=float32 (got {m.dtype})")
    _check(r.mixed_precision in ("no", "bf16", "fp16"), "rollout.mixed_precision",
           f"'{r.mixed_precision}' is not no | bf16 | fp16")
    _check(not (r.mixed_precision != "no" and r.backend == "vllm"), "rollout.mixed_precision",
           "applies to the hf backend; the vllm engine's precision is vllm.dtype")
    _check(not (r.mixed_precision != "no" and m.dtype != "float32"), "rollout.mixed_precision",
           f"{r.mixed_precision} autocast runs over fp32 weights: set model.dtype=float32 (got {m.dtype})")
    _check(m.share_prompt_min_work >= 0, "model.share_prompt_min_work", "must be >= 0")
    lc = cfg.lora
    _check(lc.r >= 1, "lora.r", "must be >= 1")
    _check(lc.alpha > 0, "lora.alpha", "must be > 0")
    _check(0 <= lc.dropout < 1, "lora.dropout", "must be in [0, 1)")
    _check(lc.dropout == 0 or not lc.enabled or m.dropout, "lora.dropout",
           f"{lc.dropout} would never act: dropout is off in every pass that enters the ratio unless "
           f"model.dropout=true (set it to accept the noise, or leave lora.dropout at 0)")
    _check(len(lc.target_modules) >= 1, "lora.target_modules", "needs at least one module name (or all-linear)")
    dc = cfg.distributed
    _check(dc.strategy in ("fsdp", "ddp"), "distributed.strategy", f"'{dc.strategy}' is not fsdp | ddp")
    _check(dc.backend in ("auto", "nccl", "gloo"), "distributed.backend", f"'{dc.backend}' is not auto | nccl | gloo")
    _check(dc.timeout_s > 0, "distributed.timeout_s", "must be > 0")
    _check(m.logprob_chunk_size >= 1, "model.logprob_chunk_size", "must be >= 1")
    t = cfg.tiny
    _check(t.hidden_size >= 8 and t.hidden_size % 8 == 0, "tiny.hidden_size",
           f"must be a positive multiple of 8 (4 attention heads of an even size), got {t.hidden_size}")
    _check(t.num_layers >= 1, "tiny.num_layers", "must be >= 1")
    _check(t.num_experts >= 1, "tiny.num_experts", "must be >= 1")
    _check(1 <= t.experts_per_tok <= t.num_experts, "tiny.experts_per_tok",
           f"must be in [1, tiny.num_experts={t.num_experts}]")
    _check(r.backend in ("hf", "vllm"), "rollout.backend", f"'{r.backend}' is not hf | vllm")
    _check(r.group_size >= 2, "rollout.group_size", f"must be >= 2 (got {r.group_size}): group advantages need at least two samples")
    _check(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    _check(r.temperature > 0 and math.isfinite(r.temperature), "rollout.temperature",
           "must be a finite number > 0 (log-probs are taken at the sampling temperature)")
    _check(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _check(r.top_k >= 0, "rollout.top_k", "must be >= 0")
    _check(r.batch_size >= 0, "rollout.batch_size", "must be >= 0")
    _check(r.old_logp in ("auto", "trainer", "sampler"), "rollout.old_logp",
           f"'{r.old_logp}' is not auto | trainer | sampler")
    _check(r.decode in ("gspo", "generate"), "rollout.decode", f"'{r.decode}' is not gspo | generate")
    _validate_vllm(cfg)
    _validate_async(cfg)
    _validate_tools(cfg)
    _validate_data_controls(cfg)
    n = r.prompts_per_step * r.group_size
    _check(s.num_minibatches >= 1, "schedule.num_minibatches", "must be >= 1")
    _check(n % s.num_minibatches == 0, "schedule.num_minibatches",
           f"the rollout of {r.prompts_per_step} x {r.group_size} = {n} sequences does not split into {s.num_minibatches} minibatches")
    mb = n // s.num_minibatches
    _check(s.micro_batch_size >= 0, "schedule.micro_batch_size", "must be >= 0")
    _check(s.length_buckets >= 1, "schedule.length_buckets", "must be >= 1 (1 = one forward per minibatch)")
    _check(s.micro_batch_size <= mb, "schedule.micro_batch_size",
           f"{s.micro_batch_size} is larger than the minibatch ({mb} sequences)")
    _check(s.micro_batch_size == 0 or mb % s.micro_batch_size == 0, "schedule.micro_batch_size",
           f"the minibatch of {mb} sequences does not split into micro-batches of {s.micro_batch_size}")
    validate_world(cfg, 1)
    _check(s.rollouts >= 1, "schedule.rollouts", "must be >= 1")
    _check(s.warmup_steps >= 0, "schedule.warmup_steps", "must be >= 0")
    _check(s.minibatch_by in ("group", "row"), "schedule.minibatch_by", f"'{s.minibatch_by}' is not group | row")
    _check(s.lr_schedule in ("constant", "cosine"), "schedule.lr_schedule", f"'{s.lr_schedule}' is not constant | cosine")
    _check(0 <= s.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]")
    o = cfg.optim
    _check(0 < o.lr < 3.4e38, "optim.lr", "must be a number > 0 and below float32's range (3.4e38)")
    _check(0 <= o.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {o.beta1}")
    _check(0 <= o.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {o.beta2}")
    _check(o.weight_decay >= 0 and math.isfinite(o.weight_decay), "optim.weight_decay", "must be a finite number >= 0")
    _check(o.adam_eps > 0 and math.isfinite(o.adam_eps), "optim.adam_eps",
           "must be a finite number > 0 (at 0 a parameter whose gradient is 0 gets 0/0)")
    _check(cfg.algo.adv_eps >= 0 and math.isfinite(cfg.algo.adv_eps), "algo.adv_eps", "must be a finite number >= 0")
    _check(cfg.seed >= 0, "seed", f"must be >= 0, got {cfg.seed}")
    e = cfg.eval
    _check(e.num_prompts >= 1 or not e.enabled, "eval.num_prompts", f"must be >= 1, got {e.num_prompts}")
    _check(e.pass_k >= 0, "eval.pass_k", f"must be >= 0 (0 = off), got {e.pass_k}")
    _check(e.every >= 0, "eval.every", f"must be >= 0 (0 = only at start and end), got {e.every}")
    _check(cfg.optim.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0")
    _check(cfg.optim.router_lr_scale > 0 and math.isfinite(cfg.optim.router_lr_scale), "optim.router_lr_scale",
           "must be a finite number > 0")
    _check(d.num_prompts >= 1, "data.num_prompts", "must be >= 1")
    _check(d.max_prompt_tokens >= 1, "data.max_prompt_tokens", "must be >= 1")
    a = cfg.algo
    _check(a.adv_scale in ("group", "none"), "algo.adv_scale", f"'{a.adv_scale}' is not group | none")
    _check(a.max_log_ratio > 0, "algo.max_log_ratio", "must be > 0")
    _check(a.objective in algo.OBJECTIVES, "algo.objective", f"'{a.objective}' is not {' | '.join(algo.OBJECTIVES)}")
    levels = algo.OBJECTIVE_LEVELS[a.objective]
    _check(a.level in levels, "algo.level",
           f"'{a.level}' is not {' | '.join(levels)}" if len(levels) > 1 else
           f"objective={a.objective} is defined at level={levels[0]} (its paper's ratio), not level={a.level}")
    defaults = (AlgoConfig.sapo_tau_pos, AlgoConfig.sapo_tau_neg)
    _check(a.objective == "sapo" or (a.sapo_tau_pos, a.sapo_tau_neg) == defaults,
           "algo.sapo_tau_pos" if a.sapo_tau_pos != defaults[0] else "algo.sapo_tau_neg",
           f"algo.sapo_tau_pos / sapo_tau_neg are SAPO's gate temperatures, not used by objective={a.objective}: "
           f"leave them unset, or set algo.objective=sapo")
    if a.objective == "sapo":
        for name in ("eps_low", "eps_high"):
            _check(getattr(a, name) is None, f"algo.{name}", "is not used by objective=sapo (a soft gate, no clip "
                   "range; its temperatures are algo.sapo_tau_pos / sapo_tau_neg): leave it unset")
    try:
        fill_clip(cfg)
        lo, hi, a.aggregation = algo.validate_algo(**objective_args(cfg))
    except ValueError as e:
        raise ConfigError(f"config field '{_algo_field(e)}': {e}") from None
    _check(lo is None or a.objective in ("cispo", "gmpo") or lo <= hi, "algo.eps_low",
           f"{lo} is larger than algo.eps_high={hi}: out of order (the paper's ranges, 3e-4/4e-4 and 0.2/0.27, "
           "widen the upper side)")
    _check(a.kl_coef >= 0 and math.isfinite(a.kl_coef), "algo.kl_coef", "must be a finite number >= 0")
    _check(a.kl_estimator in algo.KL_ESTIMATORS, "algo.kl_estimator",
           f"'{a.kl_estimator}' is not {' | '.join(algo.KL_ESTIMATORS)}")
    _check(a.entropy_coef >= 0 and math.isfinite(a.entropy_coef), "algo.entropy_coef", "must be a finite number >= 0")
    _check(a.router_aux_loss_coef >= 0 and math.isfinite(a.router_aux_loss_coef), "algo.router_aux_loss_coef",
           "must be a finite number >= 0")
    _check(not (a.routing_replay and r.old_logp == "sampler") or records_routes(cfg), "algo.routing_replay",
           "replays pi_old's experts: with rollout.old_logp=sampler they are the sampler's, which only gspo's own "
           "decode loop records (rollout.backend=hf, rollout.decode=gspo, single completions; vLLM, transformers' "
           "generate and multi-turn episodes cannot): use one, or rollout.old_logp=trainer")
    try:
        method = "none" if a.mismatch_correction == "auto" else a.mismatch_correction
        algo.validate_mismatch(method, a.mismatch_level, a.mismatch_cap, a.mismatch_floor)
    except ValueError as e:
        raise ConfigError(f"config field '{_algo_field(e)}': {e}") from None
    _check(a.mismatch_correction in ("none", "auto") or r.old_logp == "trainer", "algo.mismatch_correction",
           "weighs by pi_old / pi_sampler, which needs both: set rollout.old_logp=trainer (with the sampler's "
           "log-probs as pi_old the weight is 1 and GSPO's clip is the correction, paper section 5.4)")
    rw = cfg.rewards
    _check(rw.on_error in ("raise", "skip", "zero"), "rewards.on_error", f"'{rw.on_error}' is not raise | skip | zero")
    _check(rw.timeout_s > 0, "rewards.timeout_s", "must be > 0")
    _check(rw.num_workers >= 1, "rewards.num_workers", "must be >= 1")
    _check(len(rw.functions) >= 1, "rewards.functions", "needs at least one reward function")
    for i, fn in enumerate(rw.functions):
        _check(bool(fn.name), f"rewards.functions[{i}].name", "must not be empty")
        if runs_model_code(fn.name):
            _check(rw.allow_code_execution, "rewards.allow_code_execution",
                   "the code_tests reward runs model-written code: set rewards.allow_code_execution=true to allow it")
    own = sorted(set(cfg.data.chat_template_kwargs) & {"conversation", "messages", "tools", "documents", "tokenize",
                                                        "add_generation_prompt", "continue_final_message", "return_dict"})
    _check(not own, "data.chat_template_kwargs", f"{', '.join(map(repr, own))} is apply_chat_template's own argument, "
           "which gspo sets; give the template's variables only (e.g. enable_thinking)")
    names = cfg.logging.report_to
    if names == ["none"]:  # TRL's and transformers' words for no tracker, and for every installed one
        names = cfg.logging.report_to = []
    elif names == ["all"]:  # (each tracker's package has its name: gspo.report.trackers)
        import importlib.util

        names = cfg.logging.report_to = [n for n in TRACKER_NAMES if importlib.util.find_spec(n)]
    unknown = [n for n in names if n not in TRACKER_NAMES]
    _check(not unknown, "logging.report_to", f"unknown tracker {', '.join(map(str, unknown))}: choose from "
           f"{' | '.join(TRACKER_NAMES)}, or none, or all (each alone)")
    _check(len(set(names)) == len(names), "logging.report_to", "names a tracker twice")
    _check(bool(cfg.logging.project), "logging.project", "must not be empty")
    for name in ("completions_every", "table_every", "table_rows"):  # (0 = never / none)
        _check(getattr(cfg.logging, name) >= 0, f"logging.{name}", f"must be >= 0, got {getattr(cfg.logging, name)}")
    c = cfg.checkpoint
    _check(c.every >= 0, "checkpoint.every", "must be >= 0")
    _check(c.every_minutes >= 0, "checkpoint.every_minutes", "must be >= 0")
    _check(c.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _check(c.max_bad_steps >= 1, "checkpoint.max_bad_steps", "must be >= 1")
    _check(cfg.threads >= 0, "threads", "must be >= 0")
    _check(cfg.output.final_dtype in ("auto", "float32", "bfloat16", "float16"), "output.final_dtype",
           f"{cfg.output.final_dtype!r} is not auto | float32 | bfloat16 | float16")
    _check(bool(cfg.output.name) and "/" not in cfg.output.name and cfg.output.name not in (".", ".."), "output.name",
           f"must be a plain directory name inside output.dir (got {cfg.output.name!r})")


def _validate_data_controls(cfg: Config) -> None:
    """DAPO's dynamic sampling (rollout.dynamic_sampling) and soft overlong penalty
    (rewards.overlong_penalty); docs/data_controls.md."""
    import math

    from gspo.rewards.shaping import length_limit

    r, rw = cfg.rollout, cfg.rewards
    _check(r.dynamic_sampling_max_rounds >= 1, "rollout.dynamic_sampling_max_rounds",
           f"must be >= 1 (the first round included; got {r.dynamic_sampling_max_rounds})")
    _check(r.dynamic_sampling or r.dynamic_sampling_max_rounds == RolloutConfig.dynamic_sampling_max_rounds,
           "rollout.dynamic_sampling_max_rounds", "is the round budget of rollout.dynamic_sampling, which is off: "
           "set rollout.dynamic_sampling=true as well, or leave it out")
    _check(not (r.dynamic_sampling and r.mode == "async"), "rollout.dynamic_sampling",
           "is not supported with rollout.mode=async (the generators sample a fixed schedule of rollouts ahead); "
           "use rollout.mode=sync or set rollout.dynamic_sampling=false")
    p = rw.overlong_penalty
    _check(math.isfinite(p) and p >= 0, "rewards.overlong_penalty", f"must be a finite number >= 0 (0 = off; got {p})")
    _check(rw.overlong_buffer >= 0, "rewards.overlong_buffer", f"must be >= 0 (0 = a fifth of the length limit; "
           f"got {rw.overlong_buffer})")
    _check(p > 0 or rw.overlong_buffer == 0, "rewards.overlong_buffer", "is the buffer of rewards.overlong_penalty, "
           "which is 0 (off): set the penalty too, or leave the buffer unset")
    limit = length_limit(r)
    _check(p == 0 or rw.overlong_buffer <= limit, "rewards.overlong_buffer",
           f"{rw.overlong_buffer} is longer than the length limit it ends at ({limit} tokens: "
           + ("rollout.max_episode_tokens, or max_turns x max_new_tokens" if r.tools or r.environment
              else "rollout.max_new_tokens") + "); it must be in [1, that limit]")


def _validate_async(cfg: Config) -> None:
    """rollout.mode and the settings of async mode (`gspo.train.async_mode`)."""
    r = cfg.rollout
    _check(r.mode in ("sync", "async"), "rollout.mode", f"'{r.mode}' is not sync | async")
    _check(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0 (got {r.max_staleness})")
    _check(r.generators >= 1, "rollout.generators", f"must be >= 1 (got {r.generators})")
    _check(r.generator_timeout_s > 0, "rollout.generator_timeout_s", "must be > 0")


def _validate_vllm(cfg: Config) -> None:
    """The vllm section, and the rollout settings the vllm backend cannot honour exactly."""
    v, r = cfg.vllm, cfg.rollout
    _check(0 < v.gpu_memory_utilization <= 1, "vllm.gpu_memory_utilization", "must be in (0, 1]")
    _check(v.dtype in ("auto", "float32", "bfloat16", "float16"), "vllm.dtype",
           f"'{v.dtype}' is not auto | float32 | bfloat16 | float16")
    _check(v.max_model_len >= 0, "vllm.max_model_len", "must be >= 0")
    _check(v.kv_cache_gb >= 0, "vllm.kv_cache_gb", "must be >= 0")
    if r.backend != "vllm":
        return
    need = cfg.data.max_prompt_tokens + r.max_new_tokens
    _check(v.max_model_len == 0 or v.max_model_len >= need, "vllm.max_model_len",
           f"{v.max_model_len} is shorter than data.max_prompt_tokens + rollout.max_new_tokens = {need}")
    vllm_logprobs_mode(r.temperature, r.top_p, r.top_k)  # raises a ConfigError naming the field


def vllm_logprobs_mode(temperature: float, top_p: float, top_k: int) -> str:
    """The vLLM ``logprobs_mode`` whose value is log_softmax(raw_logits / T) of the unfiltered
    distribution (`gspo.rollout.vllm`'s docstring says why), or a ConfigError when none is."""
    filtered = top_p < 1.0 or top_k > 0
    if not filtered:
        return "processed_logprobs"  # temperature only: nothing else is configured
    if temperature == 1.0:
        return "raw_logprobs"
    name = "rollout.top_p" if top_p < 1.0 else "rollout.top_k"
    raise ConfigError(
        f"config field '{name}': with rollout.backend=vllm, top-p/top-k filtering works only at "
        f"rollout.temperature=1 (got {temperature}): vLLM returns either raw log-probs (T = 1) or "
        f"log-probs renormalised over the filtered tokens, never log_softmax(logits / T) unfiltered, "
        f"which π_old must be. Set rollout.top_p=1 and rollout.top_k=0, or rollout.temperature=1")


def records_routes(cfg: Config) -> bool:
    """Can the sampler record every token's MoE routes as it samples (R3)? gspo's decode loop
    can, for single completions; HF's generate and vLLM cannot, and in multi-turn episodes
    (rollout.tools / rollout.environment) no sampler runs the tokens a tool or an environment
    inserts."""
    r = cfg.rollout
    return r.backend == "hf" and r.decode == "gspo" and not r.tools and not r.environment


def objective_args(cfg: Config) -> dict:
    """The policy objective's settings as `gspo.algo.policy_loss` / `validate_algo` take them:
    the sapo temperatures only for SAPO, `max_len` only for Dr. GRPO's fixed denominator: the
    most tokens the model can write (`length_limit`: an episode's whole budget, not one turn's)."""
    from gspo.rewards.shaping import length_limit

    a = cfg.algo
    sapo = a.objective == "sapo"
    return dict(level=a.level, objective=a.objective, eps_low=a.eps_low, eps_high=a.eps_high,
                aggregation=a.aggregation, max_log_ratio=a.max_log_ratio,
                max_len=length_limit(cfg.rollout) if a.aggregation == "seq-mean-token-sum-norm" else None,
                tau_pos=a.sapo_tau_pos if sapo else None, tau_neg=a.sapo_tau_neg if sapo else None)


def fill_clip(cfg: Config) -> None:
    """algo.eps_low / eps_high left unset take the objective's clip range (`OBJECTIVE_CLIP`),
    else the level's (`PAPER_CLIP`)."""
    a = cfg.algo
    if a.objective in OBJECTIVE_CLIP or a.level in PAPER_CLIP:
        low, high = OBJECTIVE_CLIP.get(a.objective) or PAPER_CLIP[a.level]
        a.eps_low = low if a.eps_low is None else a.eps_low
        a.eps_high = high if a.eps_high is None else a.eps_high


def _validate_tools(cfg) -> None:
    """Multi-turn tool use (rollout.tools): its limits, and what it does not run with yet."""
    r = cfg.rollout
    _check(cfg.logging.no_signal_every >= 0, "logging.no_signal_every", "must be >= 0 (0 = never)")
    _check(r.max_turns >= 1, "rollout.max_turns", "must be >= 1")
    _check(r.max_episode_tokens >= 0, "rollout.max_episode_tokens", "must be >= 0 (0 = max_turns x max_new_tokens)")
    _check(r.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0")
    _check(r.tool_workers >= 0, "rollout.tool_workers", "must be >= 0 (0 = in-process)")
    _check(r.tool_reply_max_chars >= 1, "rollout.tool_reply_max_chars", "must be >= 1")
    if not r.tools and not r.environment:
        return
    _check(all(isinstance(t, str) and t for t in r.tools), "rollout.tools", "must be a list of import paths "
           "(pkg.mod:fn or path/file.py:fn)")


def needs_reference(cfg: Config) -> bool:
    """A KL reference runs with a KL penalty (algo.kl_coef > 0) or when the KL is logged alone
    (logging.kl_reference)."""
    return cfg.algo.kl_coef > 0 or cfg.logging.kl_reference
