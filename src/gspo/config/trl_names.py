"""TRL's GRPOConfig names for gspo's settings: a config key that is unknown here but is one of
TRL's names, bare or under any section (`num_generations=8`, `algo.beta=0.04`), is answered with
the field gspo has for it, or with what gspo does instead where it has none (docs/trl.md has the
same table with the defaults that differ)."""

from __future__ import annotations

# TRL's name -> (gspo's field, or None where gspo has none; a note). The test checks that every
# field named here, in either column, is a field of gspo.config.Config.
TRL_NAMES: dict[str, tuple[str | None, str]] = {
    "num_generations": ("rollout.group_size", ""),
    "beta": ("algo.kl_coef", "a KL penalty towards the starting weights, with TRL's k3 estimator: algo.kl_estimator"),
    "max_completion_length": ("rollout.max_new_tokens", ""),
    "max_prompt_length": ("data.max_prompt_tokens", "longer prompts are dropped at start-up, not truncated"),
    "epsilon": ("algo.eps_low", "default per algo.level: 3e-4 for GSPO, 0.2 for GRPO"),
    "epsilon_high": ("algo.eps_high", "default per algo.level: 4e-4 for GSPO, 0.27 for GRPO"),
    "importance_sampling_level": ("algo.level", "sequence (GSPO, gspo's default) | token (GRPO, TRL's default) | "
                                                "sequence_token (GSPO-token)"),
    "loss_type": ("algo.objective", "clip (GSPO or GRPO by algo.level) | sapo | cispo | gmpo | luspo; TRL's grpo, "
                                    "dapo and dr_grpo are algo.aggregation's seq-mean-token-mean, token-mean and "
                                    "seq-mean-token-sum-norm at algo.level=token"),
    "scale_rewards": ("algo.adv_scale", "group for TRL's group or true, none for none or false; batch has no counterpart"),
    "mask_truncated_completions": ("algo.mask_truncated", ""),
    "sapo_temperature_pos": ("algo.sapo_tau_pos", ""),
    "sapo_temperature_neg": ("algo.sapo_tau_neg", ""),
    "vllm_importance_sampling_correction": ("algo.mismatch_correction", "auto (gspo's default: tis where it was "
                                                                        "measured to help) | none | tis | mis, with "
                                                                        "algo.mismatch_level and algo.mismatch_cap"),
    "vllm_importance_sampling_mode": ("algo.mismatch_correction", "TRL's <level>_truncate is tis and <level>_mask is "
                                                                  "mis, with the level in algo.mismatch_level"),
    "vllm_importance_sampling_cap": ("algo.mismatch_cap", ""),
    "vllm_importance_sampling_clip_max": ("algo.mismatch_cap", ""),
    "vllm_importance_sampling_clip_min": ("algo.mismatch_floor", "mis only"),
    "delta": (None, "TRL's two-sided bound on the ratio of a negative-advantage token (INTELLECT-2) has no "
                    "counterpart; ratios are clipped to [1 - algo.eps_low, 1 + algo.eps_high]"),
    "num_generations_eval": ("eval.pass_k", "evaluation scores one greedy completion per prompt, and with "
                                            "eval.pass_k=k also k samples for pass@k"),
    "per_device_eval_batch_size": (None, "evaluation generates its held-out prompts (eval.num_prompts) in batches "
                                         "of its own"),
    "save_strategy": (None, "gspo saves every checkpoint.every rollouts and every checkpoint.every_minutes"),
    "learning_rate": ("optim.lr", ""),
    "adam_beta1": ("optim.beta1", ""),
    "adam_beta2": ("optim.beta2", ""),
    "adam_epsilon": ("optim.adam_eps", ""),
    "lr_scheduler_type": ("schedule.lr_schedule", "constant (gspo's default) | cosine; TRL's default linear has no "
                                                  "counterpart"),
    "warmup_ratio": ("schedule.warmup_steps", "a number of optimizer steps"),
    "temperature": ("rollout.temperature", ""),
    "top_p": ("rollout.top_p", ""),
    "top_k": ("rollout.top_k", ""),
    "generation_batch_size": ("rollout.prompts_per_step", "prompts per rollout, each sampled rollout.group_size "
                                                          "times; TRL's counts completions"),
    "steps_per_generation": ("schedule.num_minibatches", "optimizer steps per rollout; TRL's counts micro-batches, "
                                                         "gradient_accumulation_steps of them to an optimizer step"),
    "per_device_train_batch_size": ("schedule.micro_batch_size", "sequences per forward/backward; an optimizer step "
                                                                 "takes 1/schedule.num_minibatches of the rollout"),
    "gradient_accumulation_steps": (None, "an optimizer step takes 1/schedule.num_minibatches of the rollout's "
                                          "rows, in forwards of schedule.micro_batch_size sequences"),
    "max_steps": ("schedule.rollouts", "counted in rollouts, each schedule.num_minibatches optimizer steps"),
    "num_train_epochs": ("schedule.rollouts", "counted in rollouts, each of rollout.prompts_per_step prompts"),
    "num_iterations": (None, "each rollout is learned from once, in schedule.num_minibatches optimizer steps; "
                             "TRL's num_iterations > 1 (several passes over a rollout) has no counterpart"),
    "repetition_penalty": (None, "gspo samples from the policy at rollout.temperature, filtered by rollout.top_p "
                                 "and rollout.top_k only"),
    "min_p": (None, "gspo samples from the policy at rollout.temperature, filtered by rollout.top_p and "
                    "rollout.top_k only"),
    "reward_weights": ("rewards.functions", "a weight per function: [{name: ..., weight: ...}]"),
    "disable_dropout": ("model.dropout", "dropout is off by default here (TRL's default keeps it on)"),
    "bf16": ("model.mixed_precision", "bf16: bf16 compute over fp32 weights; model.dtype=bfloat16 for bf16 weights"),
    "use_vllm": ("rollout.backend", "rollout.backend=vllm, extra gspo[vllm]"),
    "vllm_gpu_memory_utilization": ("vllm.gpu_memory_utilization", ""),
    "vllm_enable_sleep_mode": ("vllm.sleep", ""),
    "vllm_max_model_length": ("vllm.max_model_len", ""),
    "shuffle_dataset": ("data.shuffle", ""),
    "seed": ("seed", ""),
    "logging_steps": (None, "gspo logs every optimizer step (metrics.jsonl and logging.report_to's trackers)"),
    "log_completions": ("logging.completions_every", "every N rollouts"),
    "report_to": ("logging.report_to", ""),
    "eval_steps": ("eval.every", "counted in rollouts"),
    "save_steps": ("checkpoint.every", "counted in rollouts; checkpoint.every_minutes saves by time as well"),
    "save_total_limit": ("checkpoint.keep_last", ""),
    "output_dir": ("output.dir", "the run directory is output.dir/output.name"),
    "run_name": ("output.name", ""),
}


def trl_hint(key: str) -> str | None:
    """What gspo has for TRL's setting `key` (a bare name, the last part of a dotted key), or None
    when `key` is none of TRL's names."""
    if key not in TRL_NAMES:
        return None
    field, note = TRL_NAMES[key]
    if field is None:
        return f"TRL's {key} has no counterpart here: {note}"
    return f"TRL's {key} is {field} here" + (f" ({note})" if note else "")
