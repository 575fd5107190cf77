"""The configuration's dataclasses: one per concern, each field with its default and a one-line
doc (`metadata["help"]`, printed by `gspo train --help`). Every default of gspo lives here; YAML
and the command line only override."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

# The clip range of each algo.level (paper §5.1: GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.27). They differ
# by orders of magnitude: the sequence ratio s_i is a geometric mean of token ratios and stays
# within ~1e-3 of 1, where 0.2 would never clip. load_config fills algo.eps_low / eps_high from
# here when they are left unset, so the run's config.yaml holds the values it trained with.
PAPER_CLIP = {"sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4), "token": (0.2, 0.27)}
# ... and of each algo.objective whose paper gives its own: GMPO's are bounds of the token
# LOG-ratio (arXiv 2507.20673: e^-0.4, e^0.4); CISPO's lower 1 is no lower bound (MiniMax-M1
# sets none) and its upper 0.28 is DAPO's eps_high (MiniMax-M1 tunes it and reports no value);
# LUSPO keeps GSPO's; SAPO has no clip range (its gate's temperatures are algo.sapo_tau_*).
OBJECTIVE_CLIP = {"gmpo": (0.4, 0.4), "cispo": (1.0, 0.28), "sapo": (None, None)}

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
    dtype: str = doc("float32", "parameter dtype: float32 | bfloat16 | float16")
    device: str = doc("auto", "auto (CUDA when present, else CPU) | cpu | cuda | cuda:N")
    trust_remote_code: bool = doc(False, "allow model repos to run their own Python code (off unless you trust the repo)")
    gradient_checkpointing: bool = doc(False, "recompute activations in the backward pass to save memory")
    dropout: bool = doc(False, "apply the checkpoint's dropout (and LoRA's) in the trainer's passes; off by default because "
                        "it is noise in the ratio: pi_theta differs from pi_old on the same weights (docs/modes.md)")
    mixed_precision: str = doc("no", "no | bf16: bf16 compute over fp32 master weights (FSDP2 policy under torchrun, else autocast)")
    share_prompt: bool = doc(True, "trainer forwards run each distinct prompt once and its completions on top "
                             "(same numbers; not under gradient checkpointing); false for a remote-code decoder "
                             "that does not take a prompt's KV cache as transformers' own models do")
    share_prompt_min_work: float = doc(1e7, "share_prompt pays only when the prompt tokens a call saves times the "
                                       "weights of one decoder layer a token runs through reach this (a second decoder "
                                       "call has a fixed cost per layer): on a 0.1M-weight layer a call must save ~100 "
                                       "prompt tokens; 0 = whenever it saves 1/8 of the call's tokens")
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
    merge_final: bool = doc(True, "final/ holds the merged model (the adapters alone go to final/adapter); false: "
                            "the adapters alone, which gspo eval and gspo train load onto their base")


@dataclass
class DistributedConfig:
    strategy: str = doc("fsdp", "under torchrun: fsdp (FSDP2 fully_shard) | ddp (replicated weights)")
    backend: str = doc("auto", "process group backend: auto (nccl on GPUs, gloo on CPUs) | nccl | gloo")
    reshard_after_forward: bool = doc(True, "FSDP2: free gathered weights after each forward (less memory, more traffic)")
    timeout_s: float = doc(1800.0, "collective timeout in seconds")


@dataclass
class DataConfig:
    source: str = doc("arithmetic", "built-in task name (arithmetic | sorting; multiply | guess, multi-turn: docs/tools.md) or a .jsonl / .json / .csv / .parquet "
                      "file (.jsonl.gz, .json.gz, .csv.gz too), a datasets save_to_disk folder, or a folder of such "
                      "files as the hub lays a dataset out (relative: from the working directory, else beside the "
                      "config file)")
    prompt_column: str = doc("prompt", "column holding the prompt (a string, or a list of chat messages)")
    split: Optional[str] = doc(None, "split of a DatasetDict or of a hub-style folder (train-*.parquet, test-*...; "
                               "default: train); a single file or Dataset has none")
    difficulty: int = doc(1, "difficulty of the built-in task (1 = easiest)")
    num_prompts: int = doc(2000, "number of prompts generated for a built-in task")
    eval_source: Optional[str] = doc(None, "held-out prompts (same forms as source); default: a built-in task's own held-out "
                                     "split of eval.num_prompts prompts")
    eval_split: Optional[str] = doc(None, "split of data.eval_source when it is a DatasetDict or a hub-style folder "
                                    "(default: the first of test, validation, valid, dev, eval it has, else train)")
    max_prompt_tokens: int = doc(512, "prompts longer than this are dropped at start-up, with a logged count (fewer "
                                      "where a learned position table leaves less room beside the completion)")
    shuffle: bool = doc(True, "reshuffle the prompts every epoch (seeded); false: file order, each epoch starting where "
                        "the last stopped")
    resume_on_changed: bool = doc(False, "resume on data whose rows differ from the checkpoint's (as many rows, other "
                                  "contents), going on from the saved position over them; false: that is an error")
    chat_template_kwargs: Dict[str, Any] = doc({}, "extra variables for the tokenizer's chat template wherever it "
                                               "renders (TRL's chat_template_kwargs), e.g. {enable_thinking: false} "
                                               "for Qwen3")


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
    mixed_precision: str = doc("no", "hf backend: no | bf16 | fp16 (sample under bf16 / float16 autocast over the fp32 "
                               "weights, fp32 log-softmax; its log-probs are then not the trainer's, so old_logp=auto "
                               "recomputes pi_old)")
    mode: str = doc("sync", "sync (generate, then learn, in turn) | async (generator processes sample the next rollouts "
                    "while the learner trains; docs/async.md)")
    generators: int = doc(1, "rollout.mode=async: generator processes (started by gspo on one machine; under torchrun "
                          "the last this many ranks)")
    max_staleness: int = doc(1, "rollout.mode=async: rollout r is sampled by the weights after rollout r-K (K = this; "
                             "0 = on-policy, the same parameters as sync mode)")
    generator_timeout_s: float = doc(600.0, "rollout.mode=async: a generator that sends nothing for this long is "
                                     "counted as hung and the run stops (its last checkpoint intact)")
    tools: list = doc([], "multi-turn tool use: the tools the model may call, by import path (pkg.mod:fn or "
                      "path/file.py:fn; type hints and a docstring with Args:, docs/tools.md); empty = one completion "
                      "per prompt")
    environment: str = doc("", "multi-turn episodes with an environment: a class by import path (pkg.mod:Class); one "
                           "instance per episode, reset(**row) gives the first observation, its public methods are "
                           "tools, step(messages) -> (messages, done) answers a turn without a call, its reward "
                           "reaches the reward functions as the env_reward column (docs/tools.md)")
    tool_parser: str = doc("hermes", "how tool calls are read from a turn: hermes (<tool_call>{json}</tool_call>, Qwen "
                           "and Hermes templates), llama3_json (a turn that is {json} calls, Llama 3.1-3.3), mistral "
                           "([TOOL_CALLS] calls, with the call ids Mistral's templates pair replies by) or a "
                           "function text -> list[ToolCall] by import path")
    max_turns: int = doc(4, "rollout.tools: model turns per episode at most (the last turn's calls are not run)")
    max_episode_tokens: int = doc(0, "rollout.tools: tokens after the prompt per episode at most, the model's and the "
                                  "tool replies' (0 = max_turns x max_new_tokens)")
    tool_timeout_s: float = doc(10.0, "rollout.tools: deadline of one tool call (its worker is then killed and the "
                                "model reads a timeout error)")
    tool_workers: int = doc(1, "rollout.tools: worker processes that run tool calls (0 = in-process, no deadline)")
    tool_reply_max_chars: int = doc(16384, "rollout.tools: a tool's reply, an environment's observation or step "
                                    "message longer than this is cut to its start, with a note of how much was cut")
    dynamic_sampling: bool = doc(False, "DAPO's dynamic sampling: draw rounds of prompts_per_step prompts and keep the "
                                 "groups with signal (rewards not all equal) until prompts_per_step are kept; the batch "
                                 "is topped up with groups without signal when the rounds run out (docs/data_controls.md)")
    dynamic_sampling_max_rounds: int = doc(4, "rollout.dynamic_sampling: generation rounds per rollout at most, the first "
                                           "included (4: at most 4x the sampling of a plain rollout; fills the batch in "
                                           "expectation while a quarter of the groups carry signal)")


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
                    "modules and files are found among installed modules, in the working directory and beside the config file; "
                    "or model:PATH_OR_ID (a sequence-classification reward model) | judge:PATH_OR_ID (a causal-LM judge), "
                    "docs/rewards.md")
    weight: float = doc(1.0, "weight of this function in the summed reward")
    kwargs: Dict[str, Any] = doc({}, "extra keyword arguments passed to the function (model: / judge: its loading "
                                 "options: device, dtype, batch_size, label, template, regex, ...; docs/rewards.md)")


@dataclass
class RewardsConfig:
    functions: List[RewardFunctionConfig] = field(
        default_factory=lambda: [RewardFunctionConfig()],
        metadata={"help": "reward functions: a list of {name, weight, kwargs}"})
    timeout_s: float = doc(60.0, "deadline for one reward call; a hung function is killed and counted")
    on_error: str = doc("raise", "when a reward function fails: raise | skip (score missing) | zero")
    num_workers: int = doc(1, "reward worker processes")
    allow_code_execution: bool = doc(False, "allow the code_tests reward to run model-written code (contained, not sandboxed)")
    overlong_penalty: float = doc(0.0, "DAPO's soft overlong penalty: up to this much is taken off the reward of a "
                                  "completion that runs into the last overlong_buffer tokens of the length limit (0 = off; "
                                  "DAPO: 1.0; docs/data_controls.md)")
    overlong_buffer: int = doc(0, "rewards.overlong_penalty: the buffer L_cache in tokens, the penalty growing linearly over "
                               "it to the full penalty at the length limit (0 = a fifth of the limit, DAPO's 4096 of 20480)")


@dataclass
class AlgoConfig:
    level: str = doc("sequence", "sequence (GSPO) | sequence_token (GSPO-token) | token (GRPO baseline)")
    objective: str = doc("clip", "what is applied to the ratio: clip (PPO's clip: GSPO / GSPO-token / GRPO by level) | "
                         "sapo (soft gate, level=token) | cispo (truncated stop-gradient weight, level=token) | gmpo "
                         "(clipped geometric mean, level=sequence) | luspo (GSPO x |y|, level=sequence); docs/objectives.md")
    sapo_tau_pos: float = doc(1.0, "sapo: gate temperature where the advantage is > 0 (SAPO paper: 1.0)")
    sapo_tau_neg: float = doc(1.05, "sapo: gate temperature where the advantage is <= 0 (SAPO paper: 1.05)")
    kl_coef: float = doc(0.0, "weight of a KL(pi_theta || pi_ref) penalty towards the starting weights (0 = none, "
                         "as in the paper; with LoRA the reference is the base model with adapters disabled)")
    kl_estimator: str = doc("k3", "KL estimator per token: k1 (log ratio) | k2 (half its square) | k3 (r - 1 - log r, GRPO's)")
    entropy_coef: float = doc(0.0, "weight of an entropy bonus (pi_theta's entropy, aggregated as the loss; 0 = none)")
    mask_truncated: bool = doc(False, "leave completions cut by the length limit (finish reason 'length') out of the "
                               "loss (DAPO's overlong filtering): they add 0 but still count in the mean")
    eps_low: Optional[float] = doc(None, "lower clip range, at most eps_high (as the paper's ranges, except CISPO's and "
                                   "GMPO's own); default per level: 3e-4 sequence levels, 0.2 token (paper §5.1)")
    eps_high: Optional[float] = doc(None, "upper clip range; default per level: 4e-4 sequence levels, 0.27 token")
    aggregation: Optional[str] = doc(None, "token level only: seq-mean-token-mean | token-mean | seq-mean-token-sum-norm")
    max_log_ratio: float = doc(10.0, "log-ratios are clamped to +-this before exp (finite loss for finite inputs)")
    adv_scale: str = doc("group", "advantage scaling: group (divide by group std, Eq. 6) | none (mean only, Dr. GRPO)")
    adv_eps: float = doc(1e-6, "added to the group std")
    routing_replay: bool = doc(False, "MoE: reuse pi_old's experts in the update pass (for the GRPO baseline)")
    router_aux_loss_coef: float = doc(0.0, "MoE: weight of the load-balancing loss (Switch Transformer's, as "
                                      "transformers' router_aux_loss_coef; 0 = none, the RL default of TRL and verl) "
                                      "on the update pass's real tokens; logged as routing/aux_loss")
    mismatch_correction: str = doc("auto", "train/inference mismatch correction with weight w = pi_old / pi_sampler "
                                   "(needs rollout.old_logp=trainer): none | tis (truncate w at mismatch_cap) | mis "
                                   "(drop what has w outside [mismatch_floor, mismatch_cap]; IcePop at token level) | "
                                   "auto (tis for level=token with the trainer's pi_old in async mode, else none; "
                                   "the measurement is in docs/async.md)")
    mismatch_level: str = doc("token", "what the correction weighs: token (w per token) | sequence (the full product of "
                              "token weights) | geometric (their geometric mean, GSPO's normalisation)")
    mismatch_cap: float = doc(2.0, "upper bound of the mismatch weight (TIS's C)")
    mismatch_floor: float = doc(0.5, "mis: lower bound of the mismatch weight")


@dataclass
class OptimConfig:
    lr: float = doc(1e-6, "peak learning rate (AdamW)")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    beta1: float = doc(0.9, "AdamW beta1")
    beta2: float = doc(0.999, "AdamW beta2")
    adam_eps: float = doc(1e-8, "AdamW epsilon")
    max_grad_norm: float = doc(1.0, "clip the global gradient norm to this (0 = off); grad_norm logs the norm before clipping")
    router_lr_scale: float = doc(1.0, "MoE: the routers' learning rate is optim.lr times this (the router weights "
                                 "of every *TopKRouter module; 1 = the same lr as the rest)")


@dataclass
class ScheduleConfig:
    rollouts: int = doc(100, "number of rollouts (each: generate, score, num_minibatches optimizer steps)")
    num_minibatches: int = doc(4, "optimizer steps per rollout (paper §5.1: 4, so steps 2-4 are off-policy)")
    micro_batch_size: int = doc(0, "sequences per forward/backward inside a minibatch (0 = the whole minibatch)")
    length_buckets: int = doc(8, "with micro_batch_size=0, split a minibatch's forward into at most this many "
                              "forwards of rows of similar length where the padding it saves pays for the extra "
                              "calls (1 = one forward); with micro_batch_size > 0 the rows are sorted by length "
                              "before they are cut into micro-batches")
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
    num_prompts: int = doc(100, "held-out prompts per evaluation (a built-in task's held-out split has this many, fewer where "
                           "it runs out of prompts training does not see, which is said; "
                           "data.eval_source is cut to it)")
    pass_k: int = doc(0, "also sample k completions per prompt and report pass@k (0 = off)")
    enabled: bool = doc(True, "evaluate at all")


@dataclass
class LoggingConfig:
    console: bool = doc(True, "progress bar and tables on the console")
    completions_every: int = doc(10, "write sampled completions to completions/ on rollout 1 and every N rollouts "
                                 "(0 = never)")
    table_every: int = doc(10, "print a table of sample completions every N rollouts (0 = never)")
    table_rows: int = doc(4, "rows in the console completions table")
    routing_per_layer: bool = doc(False, "MoE: also log routing/changed_frac for every layer")
    entropy: bool = doc(True, "log entropy/mean, pi_theta's token entropy, every step (computed in the chunked LM head)")
    kl_reference: bool = doc(False, "log kl/ref, the KL to the starting weights, every step even with algo.kl_coef=0 "
                             "(runs the reference's forward)")
    no_signal_every: int = doc(10, "warn on stderr, at most once in this many rollouts, when every group of a "
                               "rollout had equal rewards (no advantage, so no gradient; 0 = never)")
    report_to: List[str] = doc([], "experiment trackers (TRL's names): any of tensorboard, wandb, trackio, mlflow "
                               "(extras gspo[NAME]), or none, or all (every one installed); each gets every step's "
                               "metrics, the completions and the config")
    project: str = doc("gspo", "wandb / trackio project and mlflow experiment the run (named output.name) is filed under")


@dataclass
class CheckpointConfig:
    every: int = doc(0, "save a checkpoint every N rollouts (0 = none by count: at the end, on SIGTERM/SIGINT and by "
                     "checkpoint.every_minutes)")
    every_minutes: float = doc(30.0, "also save one after the rollout in which this many minutes have passed since the "
                               "last (0 = off): what a killed process can lose")
    keep_last: int = doc(2, "checkpoints kept")
    max_bad_steps: int = doc(5, "stop after this many consecutive non-finite losses or gradient norms")


@dataclass
class OutputConfig:
    dir: str = doc("runs", "parent directory of run directories")
    name: str = doc("gspo", "run name: the run directory is dir/name")
    final_dtype: str = doc("auto", "dtype of final/'s weights: auto (the dtype the model.name_or_path checkpoint was "
                                   "saved in; float32 for the built-in tiny model) | float32 (as trained) | bfloat16 | "
                                   "float16")


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
    threads: int = doc(0, "torch CPU threads (0 = auto: 1 on machines with <= 4 cores, every core there for a "
                       "compute-bound model in sync mode (>= 0.75M weights in a decoder layer or the LM head); "
                       "else cores/2)")
    resume: str = doc("none", "none | auto (newest complete checkpoint of the run directory) | PATH to a checkpoint")

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir) / self.output.name
