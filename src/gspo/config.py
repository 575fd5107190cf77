"""Run configuration: one dataclass per concern, YAML files, `key=value` overrides.

Every default lives here and nowhere else; YAML and the command line only override. Each field
carries a one-line doc (`metadata["help"]`) that `gspo train --help` prints. OmegaConf does the
parsing, merging and type checking; `validate` adds the cross-field rules, and every failure is
one `ConfigError` naming the field, raised before any model loads.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf  # noqa: F401  (MISSING re-exported for users)
from omegaconf.errors import OmegaConfBaseException


# The clip range of each algo.level (paper §5.1: GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.27). They differ
# by orders of magnitude: the sequence ratio s_i is a geometric mean of token ratios and stays
# within ~1e-3 of 1, where 0.2 would never clip. load_config fills algo.eps_low / eps_high from
# here when they are left unset, so the run's config.yaml holds the values it trained with.
PAPER_CLIP = {"sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4), "token": (0.2, 0.27)}

# logging.report_to's values (TRL's names); gspo.report.trackers has a class for each
TRACKER_NAMES = ("tensorboard", "wandb", "trackio", "mlflow")


class ConfigError(ValueError):
    """A bad configuration value, named by its dotted field path."""


def doc(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a default and a one-line help string."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    name_or_path: str = doc("tiny", "HF model id or local path; 'tiny' builds the demo's tiny Qwen3 from scratch")
    dtype: str = doc("float32", "parameter dtype: float32 | bfloat16")
    device: str = doc("auto", "auto (CUDA when present, else CPU) | cpu | cuda | cuda:N")
    trust_remote_code: bool = doc(False, "allow model repos to run their own Python code (off unless you trust the repo)")
    gradient_checkpointing: bool = doc(False, "recompute activations in the backward pass to save memory")
    dropout: bool = doc(False, "apply the checkpoint's dropout (and LoRA's) in the trainer's passes; off by default because "
                        "it is noise in the ratio: pi_theta differs from pi_old on the same weights (docs/modes.md)")
    mixed_precision: str = doc("no", "no | bf16: bf16 compute over fp32 master weights (FSDP2 policy under torchrun, else autocast)")
    share_prompt: bool = doc(True, "trainer forwards run each distinct prompt once and its completions on top "
                             "(same numbers; not under gradient checkpointing); false for a remote-code decoder "
                             "that does not take a prompt's KV cache as transformers' own models do")
    logprob_chunk_size: int = doc(512, "tokens per chunk when computing log-probs from hidden states (bounds the logits memory)")


@dataclass
class TinyConfig:
    """The built-in tiny model (model.name_or_path=tiny): the demo's and the tests' model."""

    hidden_size: int = doc(128, "hidden size of the built-in tiny model (model.name_or_path=tiny)")
    num_layers: int = doc(3, "layers of the built-in tiny model")
    moe: bool = doc(False, "make the built-in tiny model a Qwen3-MoE")
    num_experts: int = doc(8, "experts per MoE layer of the built-in tiny model (tiny.moe=true)")
    experts_per_tok: int = doc(2, "experts each token is routed to (top-k) in the built-in tiny MoE")


@dataclass
class LoraConfig:
    enabled: bool = doc(False, "train LoRA adapters (peft; extra gspo[lora]) instead of every weight")
    r: int = doc(16, "adapter rank")
    alpha: float = doc(32.0, "LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = doc(0.0, "dropout on the adapters' input; acts only with model.dropout=true")
    target_modules: List[str] = doc(["all-linear"], "modules to adapt: names like q_proj, or all-linear (every linear layer but the head)")
    merge_final: bool = doc(True, "final/ holds the merged model (the adapters alone go to final/adapter)")


@dataclass
class DistributedConfig:
    strategy: str = doc("fsdp", "under torchrun: fsdp (FSDP2 fully_shard) | ddp (replicated weights)")
    backend: str = doc("auto", "process group backend: auto (nccl on GPUs, gloo on CPUs) | nccl | gloo")
    reshard_after_forward: bool = doc(True, "FSDP2: free gathered weights after each forward (less memory, more traffic)")
    timeout_s: float = doc(1800.0, "collective timeout in seconds")


@dataclass
class DataConfig:
    source: str = doc("arithmetic", "built-in task name (arithmetic | sorting) or a .jsonl / .parquet / datasets save_to_disk path")
    prompt_column: str = doc("prompt", "column holding the prompt (a string, or a list of chat messages)")
    split: Optional[str] = doc(None, "split to use when the source is a DatasetDict (default: train)")
    difficulty: int = doc(1, "difficulty of the built-in task (1 = easiest)")
    num_prompts: int = doc(2000, "number of prompts generated for a built-in task")
    eval_source: Optional[str] = doc(None, "held-out prompts (same forms as source); default: a built-in task's own held-out "
                                     "split of eval.num_prompts prompts")
    max_prompt_tokens: int = doc(512, "prompts longer than this are dropped at start-up, with a logged count")
    shuffle: bool = doc(True, "reshuffle the prompts every epoch (seeded)")


@dataclass
class RolloutConfig:
    backend: str = doc("hf", "generation backend: hf (transformers generate) | vllm (extra gspo[vllm])")
    prompts_per_step: int = doc(16, "prompts (groups) per rollout, B")
    group_size: int = doc(8, "completions per prompt, G (paper Eq. 6 normalises within a group)")
    max_new_tokens: int = doc(64, "maximum completion length in tokens")
    temperature: float = doc(1.0, "sampling temperature; log-probs are taken at this temperature")
    top_p: float = doc(1.0, "nucleus sampling threshold (1 = off)")
    top_k: int = doc(0, "top-k sampling (0 = off)")
    batch_size: int = doc(0, "sequences per generate() call and per seeded sampling chunk (0 = the process's whole share); "
                          "set it to make samples independent of the number of processes")
    old_logp: str = doc("auto", "pi_old source: trainer (one no-grad pass) | sampler (the generator's log-probs, paper §5.4) | "
                        "auto (sampler when they are the trainer's own numbers: hf backend, fp32, no MoE routes to "
                        "record, no LoRA dropout; else trainer)")
    decode: str = doc("gspo", "hf backend's decode loop: gspo (own KV-cache loop, finished rows leave the batch) | "
                      "generate (transformers' generate, for architectures that need its preparation)")


@dataclass
class VllmConfig:
    gpu_memory_utilization: float = doc(0.3, "rollout.backend=vllm: fraction of the GPU the engine may take (weights, activations, KV cache); the trainer keeps the rest")
    sleep: bool = doc(True, "vllm: free the engine's GPU memory between rollouts (sleep level 1; ignored where unsupported, e.g. CPU)")
    dtype: str = doc("auto", "vllm engine dtype: auto (a bf16/fp16 policy's own, else bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16")
    enforce_eager: bool = doc(False, "vllm: no CUDA graphs or torch.compile (starts faster, decodes slower)")
    max_model_len: int = doc(0, "vllm: longest prompt + completion served (0 = data.max_prompt_tokens + rollout.max_new_tokens)")
    kv_cache_gb: float = doc(0.0, "vllm: KV cache size in GiB (0 = sized by vLLM from gpu_memory_utilization, or its CPU default)")


@dataclass
class RewardFunctionConfig:
    name: str = doc("exact_answer", "built-in reward name, import path (pkg.module:function) or file (path/to/file.py:function); "
                    "modules and files are found among installed modules, in the working directory and beside the config file")
    weight: float = doc(1.0, "weight of this function in the summed reward")
    kwargs: Dict[str, Any] = doc({}, "extra keyword arguments passed to the function")


@dataclass
class RewardsConfig:
    functions: List[RewardFunctionConfig] = field(
        default_factory=lambda: [RewardFunctionConfig()],
        metadata={"help": "reward functions: a list of {name, weight, kwargs}"})
    timeout_s: float = doc(60.0, "deadline for one reward call; a hung function is killed and counted")
    on_error: str = doc("raise", "when a reward function fails: raise | skip (score missing) | zero")
    num_workers: int = doc(1, "reward worker processes")
    allow_code_execution: bool = doc(False, "allow the code_tests reward to run model-written code (contained, not sandboxed)")


@dataclass
class AlgoConfig:
    level: str = doc("sequence", "sequence (GSPO) | sequence_token (GSPO-token) | token (GRPO baseline)")
    eps_low: Optional[float] = doc(None, "lower clip range; default per level: 3e-4 sequence levels, 0.2 token (paper §5.1)")
    eps_high: Optional[float] = doc(None, "upper clip range; default per level: 4e-4 sequence levels, 0.27 token")
    aggregation: Optional[str] = doc(None, "token level only: seq-mean-token-mean | token-mean | seq-mean-token-sum-norm")
    max_log_ratio: float = doc(10.0, "log-ratios are clamped to +-this before exp (finite loss for finite inputs)")
    adv_scale: str = doc("group", "advantage scaling: group (divide by group std, Eq. 6) | none (mean only, Dr. GRPO)")
    adv_eps: float = doc(1e-6, "added to the group std")
    routing_replay: bool = doc(False, "MoE: reuse pi_old's experts in the update pass (for the GRPO baseline)")


@dataclass
class OptimConfig:
    lr: float = doc(1e-6, "peak learning rate (AdamW)")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    beta1: float = doc(0.9, "AdamW beta1")
    beta2: float = doc(0.999, "AdamW beta2")
    adam_eps: float = doc(1e-8, "AdamW epsilon")
    max_grad_norm: float = doc(1.0, "clip the global gradient norm to this (0 = off)")


@dataclass
class ScheduleConfig:
    rollouts: int = doc(100, "number of rollouts (each: generate, score, num_minibatches optimizer steps)")
    num_minibatches: int = doc(4, "optimizer steps per rollout (paper §5.1: 4, so steps 2-4 are off-policy)")
    micro_batch_size: int = doc(0, "sequences per forward/backward inside a minibatch (0 = the whole minibatch)")
    skip_zero_advantage: bool = doc(True, "leave rows with advantage 0 (a group whose rewards are all equal) out of the "
                                    "trainer's passes: they add exactly 0 to the loss and gradient; metrics then cover "
                                    "the other rows (rows/skipped_frac); false: clip and ratio metrics over every row, "
                                    "as TRL and verl report them")
    minibatch_by: str = doc("group", "how rows are dealt into minibatches: group (a group's rows together, in "
                            "random order, so their prompt runs once; verl's layout) | row (each row on its own; "
                            "TRL's layout, for runs compared step by step against TRL)")
    warmup_steps: int = doc(0, "linear LR warm-up, in optimizer steps")
    lr_schedule: str = doc("constant", "after warm-up: constant | cosine")
    min_lr_ratio: float = doc(0.0, "cosine schedule floor, as a fraction of lr")


@dataclass
class EvalConfig:
    every: int = doc(0, "evaluate on held-out prompts every N rollouts (0 = only at start and end)")
    num_prompts: int = doc(100, "held-out prompts per evaluation (a built-in task's held-out split has this many; "
                           "data.eval_source is cut to it)")
    pass_k: int = doc(0, "also sample k completions per prompt and report pass@k (0 = off)")
    enabled: bool = doc(True, "evaluate at all")


@dataclass
class LoggingConfig:
    console: bool = doc(True, "progress bar and tables on the console")
    completions_every: int = doc(10, "write sampled completions to completions/ every N rollouts (0 = never)")
    table_every: int = doc(10, "print a table of sample completions every N rollouts (0 = never)")
    table_rows: int = doc(4, "rows in the console completions table")
    routing_per_layer: bool = doc(False, "MoE: also log routing/changed_frac for every layer")
    report_to: List[str] = doc([], "experiment trackers (TRL's names): any of tensorboard, wandb, trackio, mlflow "
                               "(extras gspo[NAME]); each gets every step's metrics, the completions and the config")
    project: str = doc("gspo", "wandb / trackio project and mlflow experiment the run (named output.name) is filed under")


@dataclass
class CheckpointConfig:
    every: int = doc(0, "save a checkpoint every N rollouts (0 = only at the end and on SIGTERM/SIGINT)")
    keep_last: int = doc(2, "checkpoints kept")
    max_bad_steps: int = doc(5, "stop after this many consecutive non-finite losses or gradient norms")


@dataclass
class OutputConfig:
    dir: str = doc("runs", "parent directory of run directories")
    name: str = doc("gspo", "run name: the run directory is dir/name")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tiny: TinyConfig = field(default_factory=TinyConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    seed: int = doc(0, "seed for data order, sampling and initialisation")
    threads: int = doc(0, "torch CPU threads (0 = auto: 1 on machines with <= 4 cores, else cores/2)")
    resume: str = doc("none", "none | auto (newest complete checkpoint of the run directory) | PATH to a checkpoint")

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir) / self.output.name


# ---------------------------------------------------------------- loading


def _friendly(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
    if "not in" in msg and key:
        import difflib

        names = [n for n, _, _ in field_docs()]
        close = difflib.get_close_matches(key, names, n=1)
        msg = "unknown field" + (f" (did you mean '{close[0]}'?)" if close else "")
    return f"config field '{key}': {msg}" if key else msg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: Config | None = None) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, type-checked, then `validate`d."""
    schema = OmegaConf.structured(base or Config())
    layers = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            layers.append(OmegaConf.load(p))
        except Exception as e:  # yaml syntax errors
            raise ConfigError(f"config file {p}: {e}") from None
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override '{o}' is not of the form key=value (e.g. rollout.group_size=16)")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(schema, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_friendly(e)) from None
    if path is not None:
        for f in cfg.rewards.functions:
            f.name = anchor_import_path(f.name, Path(path).resolve().parent)
    _fill_clip(cfg)
    validate(cfg)
    return cfg


def _fill_clip(cfg: Config) -> None:
    """algo.eps_low / eps_high left unset take the level's clip range (`PAPER_CLIP`)."""
    a = cfg.algo
    if a.level in PAPER_CLIP:
        low, high = PAPER_CLIP[a.level]
        a.eps_low = low if a.eps_low is None else a.eps_low
        a.eps_high = high if a.eps_high is None else a.eps_high


def anchor_import_path(name: str, config_dir: Path) -> str:
    """An import path of a config file made independent of the working directory.

    'file.py:fn' relative to the working directory or, failing that, to `config_dir` becomes
    absolute; 'module:fn' whose module is neither installed nor in the working directory but is
    a file or package beside the config file becomes that file's absolute path. Anything else
    (built-in names, installed modules, names that resolve nowhere) is returned unchanged, and
    `gspo.rewards` reports it when it fails to import."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        return name
    if module.endswith(".py"):
        p = Path(module).expanduser()
        if p.is_absolute():
            return name
        for base in (Path.cwd(), config_dir):
            if (base / p).is_file():
                return f"{(base / p).resolve()}:{attr}"
        return name
    import importlib.util

    top = module.split(".")[0]
    local = lambda d: (d / f"{top}.py").is_file() or (d / top / "__init__.py").is_file()  # noqa: E731
    if local(Path.cwd()) or not local(config_dir) or importlib.util.find_spec(top) is not None:
        return name
    rel = Path(*module.split("."))
    target = config_dir / rel.with_suffix(".py")
    if not target.is_file():
        target = config_dir / rel / "__init__.py"
    return f"{target.resolve()}:{attr}"


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml_text(text: str) -> Config:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config()), OmegaConf.create(text))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_friendly(e)) from None
    _fill_clip(cfg)
    return cfg


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, help) of every field, for `--help`."""
    rows = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            rows.extend(field_docs(type(default), name + "."))
            continue
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(x) for x in default]
        rows.append((name, repr(default), f.metadata.get("help", "")))
    return rows


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


def validate(cfg: Config) -> None:
    """Cross-field rules that types cannot express. Raises one ConfigError naming the field."""
    from gspo import algo

    m, d, r, s = cfg.model, cfg.data, cfg.rollout, cfg.schedule
    _check(m.dtype in ("float32", "bfloat16", "float16"), "model.dtype", f"'{m.dtype}' is not float32 | bfloat16 | float16")
    _check(m.mixed_precision in ("no", "bf16"), "model.mixed_precision", f"'{m.mixed_precision}' is not no | bf16")
    _check(not (m.mixed_precision == "bf16" and m.dtype != "float32"), "model.mixed_precision",
           f"bf16 mixed precision keeps fp32 master weights: set model.dtype=float32 (got {m.dtype})")
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
    _check(t.num_experts >= 1, "tiny.num_experts", "must be >= 1")
    _check(1 <= t.experts_per_tok <= t.num_experts, "tiny.experts_per_tok",
           f"must be in [1, tiny.num_experts={t.num_experts}]")
    _check(r.backend in ("hf", "vllm"), "rollout.backend", f"'{r.backend}' is not hf | vllm")
    _check(r.group_size >= 2, "rollout.group_size", f"must be >= 2 (got {r.group_size}): group advantages need at least two samples")
    _check(r.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
    _check(r.temperature > 0, "rollout.temperature", "must be > 0 (log-probs are taken at the sampling temperature)")
    _check(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _check(r.top_k >= 0, "rollout.top_k", "must be >= 0")
    _check(r.batch_size >= 0, "rollout.batch_size", "must be >= 0")
    _check(r.old_logp in ("auto", "trainer", "sampler"), "rollout.old_logp",
           f"'{r.old_logp}' is not auto | trainer | sampler")
    _check(r.decode in ("gspo", "generate"), "rollout.decode", f"'{r.decode}' is not gspo | generate")
    _validate_vllm(cfg)
    n = r.prompts_per_step * r.group_size
    _check(s.num_minibatches >= 1, "schedule.num_minibatches", "must be >= 1")
    _check(n % s.num_minibatches == 0, "schedule.num_minibatches",
           f"the rollout of {r.prompts_per_step} x {r.group_size} = {n} sequences does not split into {s.num_minibatches} minibatches")
    mb = n // s.num_minibatches
    _check(s.micro_batch_size >= 0, "schedule.micro_batch_size", "must be >= 0")
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
    _check(cfg.optim.lr > 0, "optim.lr", "must be > 0")
    _check(cfg.optim.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0")
    _check(d.num_prompts >= 1, "data.num_prompts", "must be >= 1")
    _check(d.max_prompt_tokens >= 1, "data.max_prompt_tokens", "must be >= 1")
    a = cfg.algo
    _check(a.adv_scale in ("group", "none"), "algo.adv_scale", f"'{a.adv_scale}' is not group | none")
    _check(a.max_log_ratio > 0, "algo.max_log_ratio", "must be > 0")
    max_len = r.max_new_tokens if a.aggregation == "seq-mean-token-sum-norm" else None
    try:
        _fill_clip(cfg)
        lo, hi, _ = algo.validate_algo(a.level, a.eps_low, a.eps_high, a.aggregation, max_len,
                                       max_log_ratio=a.max_log_ratio)
    except ValueError as e:
        raise ConfigError(f"config field 'algo': {e}") from None
    _check(lo <= hi, "algo.eps_low", f"{lo} is larger than algo.eps_high={hi}: out of order (the paper's ranges, "
           f"3e-4/4e-4 and 0.2/0.27, widen the upper side)")
    _check(not (a.routing_replay and r.old_logp == "sampler"), "algo.routing_replay",
           "replays the experts of the trainer's pi_old pass: needs rollout.old_logp=trainer")
    rw = cfg.rewards
    _check(rw.on_error in ("raise", "skip", "zero"), "rewards.on_error", f"'{rw.on_error}' is not raise | skip | zero")
    _check(rw.timeout_s > 0, "rewards.timeout_s", "must be > 0")
    _check(rw.num_workers >= 1, "rewards.num_workers", "must be >= 1")
    _check(len(rw.functions) >= 1, "rewards.functions", "needs at least one reward function")
    for i, fn in enumerate(rw.functions):
        _check(bool(fn.name), f"rewards.functions[{i}].name", "must not be empty")
        if fn.name == "code_tests":
            _check(rw.allow_code_execution, "rewards.allow_code_execution",
                   "the code_tests reward runs model-written code: set rewards.allow_code_execution=true to allow it")
    names = cfg.logging.report_to
    unknown = [n for n in names if n not in TRACKER_NAMES]
    _check(not unknown, "logging.report_to", f"unknown tracker {', '.join(unknown)}: choose from {' | '.join(TRACKER_NAMES)}")
    _check(len(set(names)) == len(names), "logging.report_to", "names a tracker twice")
    _check(bool(cfg.logging.project), "logging.project", "must not be empty")
    c = cfg.checkpoint
    _check(c.every >= 0, "checkpoint.every", "must be >= 0")
    _check(c.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    _check(c.max_bad_steps >= 1, "checkpoint.max_bad_steps", "must be >= 1")
    _check(cfg.threads >= 0, "threads", "must be >= 0")
    _check(bool(cfg.output.name) and "/" not in cfg.output.name, "output.name", "must be a plain directory name")


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
