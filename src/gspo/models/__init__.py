"""Loading policies (`load_policy`: any HF causal LM, local path or hub id, offline-safe), their
EOS ids and position ids, and the CPU attention path for grouped-query models. The trainer's
log-probabilities are computed in `gspo.models.logprobs`."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError

from gspo.config import ConfigError, ModelConfig
from gspo.models.modes import eval_mode, generation_mode, set_trainer_mode  # noqa: F401  (part of this package's API)
from gspo.models.sources import ModelError, check_source  # noqa: F401  (part of this package's API)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
def resolve_device(device: str | torch.device = ModelConfig.device) -> torch.device:
    """``"auto"`` → ``cuda`` when available, else ``cpu``; anything else is passed to torch. A
    name torch does not know, or an accelerator this torch cannot reach, is one `ConfigError`
    naming model.device, before any model loads."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"config field 'model.device': {device!r} is not a device: use auto, cpu, cuda or "
                          f"cuda:N ({str(e).splitlines()[0][:200]})") from None
    if dev.type == "meta":
        raise ConfigError("config field 'model.device': 'meta' tensors hold no data, so nothing can run on them; "
                          "use auto, cpu or cuda")
    module = getattr(torch, dev.type, None) if dev.type != "cpu" else None
    if dev.type != "cpu" and not (hasattr(module, "is_available") and module.is_available()):
        build = f"this torch {torch.__version__} sees no {dev.type} device"
        raise ConfigError(f"config field 'model.device': {device!r}, but {build}; use model.device=auto or cpu")
    if module is not None and dev.index is not None and hasattr(module, "device_count") \
            and dev.index >= module.device_count():
        raise ConfigError(f"config field 'model.device': {device!r}, but there are {module.device_count()} "
                          f"{dev.type} devices")
    return dev


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def load_policy(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = ModelConfig.dtype,
    device: str | torch.device = ModelConfig.device,
    trust_remote_code: bool = ModelConfig.trust_remote_code,
    tokenizer=None,
):
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``. `tokenizer`: the one
    `load_tokenizer` gave for the same path, loaded before the model so that the prompts are
    checked first; it is made ready here as a freshly loaded one is.

    `name_or_path` is a local directory (``save_pretrained`` format) or a Hub id. A missing
    local path raises `ModelError` before anything is tried; a Hub id that cannot be fetched
    (for instance with ``HF_HUB_OFFLINE=1`` and no cached copy) raises `ModelError` naming it.

    Tokenizer decisions: a tokenizer without a pad token gets ``pad_token = eos_token`` (safe
    here because rollouts carry explicit masks and find the end of a completion by its first
    EOS, never by the pad id); ``padding_side`` is set to ``"left"`` because prompts are
    left-padded for generation. The model's ``generation_config.pad_token_id`` is filled from
    the tokenizer when missing. The model is returned in eval mode, as ``from_pretrained``
    leaves it; `set_trainer_mode` gives it the mode of the trainer's passes.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.fspath(name_or_path)
    if name.startswith("~"):
        name = os.path.expanduser(name)
    check_source(name)
    if is_adapter_folder(name):
        return _load_adapter(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code, tokenizer=tokenizer)
    torch_dtype = _resolve_dtype(dtype)
    try:
        from transformers import AutoConfig

        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        saved_dtype = getattr(AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code), "dtype", None)
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
        model._gspo_saved_dtype = saved_dtype if isinstance(saved_dtype, torch.dtype) else None  # (`saved_dtype`)
    except (OSError, ValueError, SafetensorError) as e:  # hub / file errors are OSError subclasses
        raise _load_error("model", name, e) from e
    except pickle.UnpicklingError:
        raise _pickle_error("model", name) from None
    model.to(resolve_device(device))
    return model, _ready_tokenizer(tokenizer, model, name)


def is_adapter_folder(name: str) -> bool:
    """Whether `name` is a peft adapter folder (adapter_config.json, no config.json of a model)."""
    return not os.path.isfile(os.path.join(name, "config.json")) and os.path.isfile(os.path.join(name, "adapter_config.json"))


def _pickle_error(what: str, name: str) -> ModelError:
    """A `.bin` weights file that torch's weights-only loader refused: a pickle holding more than
    tensors, whose code gspo never runs."""
    return ModelError(f"could not load {what} {name!r}: its .bin weights file is a pickle holding more than "
                      "tensors, and gspo loads weights only (it never runs a pickle's code); in an environment "
                      "you trust, load it and save it again with save_pretrained (safetensors)")


def _load_error(what: str, name: str, e: BaseException) -> ModelError:
    """One `ModelError` for a model or tokenizer that did not load: offline without a cache, a
    missing folder, a damaged file (a truncated safetensors file's header)."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    hint = " (HF_HUB_OFFLINE is set and no cached copy was found)" if offline and not os.path.isdir(name) else ""
    if not os.path.exists(name):  # `runs/x` reads as a Hub id too
        hint += f"; nor is there a local folder {os.path.abspath(name)}"
    return ModelError(f"could not load {what} {name!r}{hint}: {e}")


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = ModelConfig.trust_remote_code):
    """The tokenizer `load_policy` pairs with the model at `name_or_path`, as saved, loaded
    without the model (a run checks its prompts with it before the weights load): a LoRA
    adapter folder's own where it has one, else its base model's. Pass it to `load_policy`."""
    from transformers import AutoTokenizer

    name = os.fspath(name_or_path)
    if name.startswith("~"):
        name = os.path.expanduser(name)
    check_source(name)
    if is_adapter_folder(name):
        base = _adapter_base(name)
        if not any(Path(name, f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            try:
                return load_tokenizer(base, trust_remote_code=trust_remote_code)
            except ModelError as e:
                raise ModelError(f"model path {name!r} is a LoRA adapter on the base model {base!r}, whose "
                                 f"tokenizer did not load: {e}") from None
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise _load_error("the tokenizer of model", name, e) from e


def _ready_tokenizer(tokenizer, model, name: str):
    """The pad token (the EOS where there is none), left padding, and the pad id in the model's
    generation config where it lacks one (`load_policy`'s tokenizer decisions; `as_brought`
    undoes them for a saved model). A tokenizer with more tokens than the model's embedding
    has rows is refused: its last ids would index past the table in the first forward."""
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    rows = getattr(embed, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise ModelError(f"model {name!r}: its tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                         f"{rows} rows, so ids {rows}..{len(tokenizer) - 1} have none (tokens added without "
                         f"model.resize_token_embeddings): resize the embeddings and save the model again")
    gen = getattr(model, "generation_config", None)
    tokenizer._gspo_brought = {"pad_token": tokenizer.pad_token, "padding_side": tokenizer.padding_side,
                               "gen_pad": None if gen is None else gen.pad_token_id}
    if tokenizer.pad_token is None:
        stops = eos_token_ids(model, tokenizer)  # the tokenizer's EOS, else the generation config's
        if tokenizer.eos_token is None and not stops:
            raise ModelError(f"tokenizer of {name!r} has neither a pad nor an eos token, and its generation_config "
                             "names no eos_token_id")
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(stops[0])
    tokenizer.padding_side = "left"
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def saved_dtype(model) -> torch.dtype | None:
    """The dtype the checkpoint `load_policy` loaded `model` from was saved in (its config's),
    whatever dtype it was loaded in; None for a model built here (the tiny one)."""
    return getattr(base_model(model), "_gspo_saved_dtype", None)


@contextmanager
def as_brought(tokenizer, model):
    """The tokenizer's pad token and padding side, and the model's generation-config pad id, as
    the checkpoint had them, for the block (`gspo.train.run_state.save_final` writes final/ in
    it): gspo's own choices for sampling (`_ready_tokenizer`) stay out of the user's model."""
    brought = getattr(tokenizer, "_gspo_brought", None)
    gen = getattr(model, "generation_config", None)
    if brought is None:
        yield
        return
    now = (tokenizer.pad_token, tokenizer.padding_side, None if gen is None else gen.pad_token_id)
    tokenizer.pad_token, tokenizer.padding_side = brought["pad_token"], brought["padding_side"]
    if gen is not None:
        gen.pad_token_id = brought["gen_pad"]
    try:
        yield
    finally:
        tokenizer.pad_token, tokenizer.padding_side = now[0], now[1]
        if gen is not None:
            gen.pad_token_id = now[2]


def _load_adapter(path: str, tokenizer=None, **load):
    """A LoRA adapter folder (a run's final/ with lora.merge_final=false, or final/adapter, or a
    user's PEFT adapter): the base model its adapter_config.json names (base_model_name_or_path),
    loaded as `load_policy` loads any model (an adapter folder too), with the adapter merged in
    and every weight trainable; the tokenizer is the adapter folder's where it has one (gspo
    writes it there), else the base's. An adapter that cannot be merged (prompt tuning) or does
    not fit its base's shapes is one `ModelError`."""
    config = json.loads(Path(path, "adapter_config.json").read_text())
    base = _adapter_base(path)
    try:
        import peft
    except ImportError:
        raise ModelError(f"model path {path!r} is a LoRA adapter: loading it onto its base needs peft "
                         f"(pip install 'gspo[lora]')") from None
    _check_mergeable(path, config.get("peft_type"))
    given = tokenizer  # (`load_tokenizer`'s, this folder's or its base's)
    try:
        model, tokenizer = load_policy(base, tokenizer=tokenizer, **load)
    except ModelError as e:
        raise ModelError(f"model path {path!r} is a LoRA adapter on the base model {base!r}, which did not "
                         f"load: {e}") from None
    from gspo.models.lora import tied_embeddings

    tied = tied_embeddings(model)
    try:
        model = peft.PeftModel.from_pretrained(model, path)
    except RuntimeError as e:  # torch's "size mismatch for ...": the adapter was trained on another model
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:300])
        first = first.rstrip(".")
        raise ModelError(f"model path {path!r} is a LoRA adapter that does not fit the base model its "
                         f"adapter_config.json names ({base!r}): {first}; set base_model_name_or_path to the "
                         f"model it was trained on") from None
    except pickle.UnpicklingError:
        raise _pickle_error("LoRA adapter", path) from None
    adapted = [n for n, m in model.named_modules() if any(getattr(m, "base_layer", None) is t for t in tied)]
    if adapted:
        raise ModelError(f"model path {path!r} is a LoRA adapter on {adapted[0].removeprefix('base_model.model.')}, "
                         f"whose weight its base {base!r} ties to the other end of the model (tie_word_embeddings): "
                         f"merged, the adapter would change both, which is not the model it was trained as")
    model = model.merge_and_unload()
    model.requires_grad_(True)  # peft froze the base; a full fine-tuning run trains it (LoRA freezes it again)
    # the model is base + this adapter: a LoRA run on it names this folder as its adapters' base
    # (peft records `name_or_path`), which loads recursively, not the bare base
    model.name_or_path = model.config._name_or_path = path
    if given is None and any(Path(path, f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = _ready_tokenizer(AutoTokenizer.from_pretrained(path, trust_remote_code=load["trust_remote_code"]),
                                     model, path)
    model.eval()
    return model, tokenizer


def _adapter_base(path: str) -> str:
    """The base model a LoRA adapter folder's adapter_config.json names (one `ModelError` if none)."""
    base = json.loads(Path(path, "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ModelError(f"model path {path!r} is a LoRA adapter whose adapter_config.json names no base model "
                         f"(base_model_name_or_path; a run of the built-in tiny model has none): train with "
                         f"lora.merge_final=true for a whole model in final/")
    return base


def _check_mergeable(path: str, peft_type: str | None) -> None:
    """Refuse a PEFT adapter that cannot be merged into its base's weights (prompt tuning, prefix
    tuning, P-tuning: virtual tokens, not a weight update): gspo trains and samples plain models."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    tuner = PEFT_TYPE_TO_TUNER_MAPPING.get(str(peft_type or "LORA").upper())
    if tuner is None or not hasattr(tuner, "merge_and_unload"):
        raise ModelError(f"model path {path!r} is a PEFT adapter of type {peft_type} (adapter_config.json's "
                         f"peft_type), which cannot be merged into its base's weights; gspo loads adapters that "
                         f"can (LoRA, DoRA, IA3, ...): merge it elsewhere, or start from its base model")


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS (an int or a list) and the
    tokenizer's ``eos_token_id``, deduplicated in that order."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(gen_eos, int):
        gen_eos = [gen_eos]
    for i in list(gen_eos or []) + [getattr(tokenizer, "eos_token_id", None)]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each row's first real token, so a left-padded prompt
    sees the same rotary positions as the unpadded one. (N, L) → (N, L) long."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------- half precision's speed

HALF_SLOWDOWN_WARN = 2.0  # warn when a half-precision matmul runs this many times slower than fp32


@functools.lru_cache(maxsize=None)
def half_matmul_slowdown(device_type: str, dtype: torch.dtype) -> float:
    """How many times longer a `dtype` matmul takes than the same fp32 one on this machine's CPU,
    measured (a 256-square product, best of 3 each, on the threads in force): a CPU with a bf16
    matrix unit (AMX, AVX-512 BF16, Arm's BF16 extensions) runs bf16 ~2-4x faster, one without
    emulates it, ~25x slower on an AVX2 EPYC. Measured rather than read from the CPU's flags,
    since what counts is what torch's kernels make of them. 1.0 off the CPU (GPUs that lack
    bf16 are refused by torch itself)."""
    if device_type != "cpu" or dtype == torch.float32:
        return 1.0

    def best(dt: torch.dtype) -> float:
        x = torch.ones(256, 256, dtype=dt)
        times = []
        for _ in range(4):  # the first call warms up
            t = time.perf_counter()
            torch.mm(x, x)
            times.append(time.perf_counter() - t)
        return min(times[1:])

    with torch.inference_mode():
        return best(dtype) / max(best(torch.float32), 1e-9)


def half_precision_warnings(settings: dict[str, str], device: torch.device) -> list[str]:
    """One line for each setting ({field: value}, e.g. {"model.mixed_precision": "bf16"}) whose
    half precision runs slower than fp32 on `device`; settings at fp32 cost nothing to check."""
    lines = []
    for name, value in settings.items():
        dtype = _DTYPES.get(value)
        if dtype not in (torch.bfloat16, torch.float16):
            continue
        slow = half_matmul_slowdown(device.type, dtype)
        if slow >= HALF_SLOWDOWN_WARN:
            lines.append(f"{name}={value}: {value} matrix products run {slow:.0f}x slower than float32 on this CPU "
                         f"(it has no {value} matrix unit, such as AMX), so this run would be faster at float32: "
                         f"set {name}={'float32' if name == 'model.dtype' else 'no'}")
    return lines


def base_model(model):
    """The transformers model inside a PEFT wrapper (LoRA layers stay injected in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# ----------------------------------------------------------------------------- transformers' names
# Each release in pyproject's tested range is called by its own names, never by a deprecated alias.
_TRANSFORMERS = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", importlib.metadata.version("transformers")).groups())
# 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40).
CACHE_KWARG = "cache" if _TRANSFORMERS >= (5, 24) else "past_key_values"
# 5.23 renamed gradient checkpointing to activation checkpointing (the old names warn, and go in v6).
_ACTIVATION_CHECKPOINTING = _TRANSFORMERS >= (5, 23)


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")  # learned absolute positions' module names


def position_limit(model) -> int | None:
    """The longest sequence `model` can run at all, where that is a hard limit: the size of a
    learned table of absolute positions (GPT-2's ``wpe``, OPT's and BioGPT's ``embed_positions``,
    GPT-BigCode, GPT-Neo), past which its embedding lookup fails. None for relative positions
    (RoPE, ALiBi), which run at any length (past the trained one, at the model's own risk)."""
    base = base_model(model)
    table = any(isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
                for name, m in base.named_modules())
    if not table:
        return None
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(limit) if limit else None


def trained_length(config) -> int | None:
    """The longest sequence a RoPE model's config says it handles: max_position_embeddings, or
    with a context-extending RoPE scaling (YaRN, dynamic NTK, linear, ...: `rope_scaling` or
    transformers 5's `rope_parameters` with a `factor`) its original length times the factor,
    where that is more (Qwen2.5's YaRN x4 over 32768 positions: 131072). None where it says nothing."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    scaling = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if isinstance(factor, (int, float)) and factor > 1:
        n = max(n, int((scaling.get("original_max_position_embeddings") or n) * factor))
    return n


def takes_dynamic_cache(model) -> bool:
    """Whether `model`'s forward takes a transformers DynamicCache. A family with a cache class of
    its own (MiniMax-Text's linear-attention state) refuses any other and builds its own when it
    is given none, as transformers' ``generate`` lets it."""
    supports = getattr(type(base_model(model)), "_supports_default_dynamic_cache", None)
    return not callable(supports) or bool(supports())


def holds_recurrent_state(cache_layer) -> bool:
    """Whether a layer of a transformers cache holds a recurrent state (the conv and recurrent
    states of a linear-attention or state-space layer, alone or beside keys and values), whose
    rows transformers' ``batch_select_indices`` does not select."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # (a transformers release without hybrid caches)
        return False
    return isinstance(cache_layer, LinearAttentionCacheLayerMixin)


def set_activation_checkpointing(model, enabled: bool) -> None:
    """Recompute each layer's activations in the backward pass (non-reentrant), or stop. A MoE's
    router hooks act in the recomputation as they acted in the forward
    (`gspo.models.routing.recompute_contexts`)."""
    from gspo.models.routing import recompute_contexts

    kwargs = {"use_reentrant": False, "context_fn": recompute_contexts}
    if _ACTIVATION_CHECKPOINTING and enabled:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif _ACTIVATION_CHECKPOINTING:
        model.activation_checkpointing_disable()
    elif enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


def is_activation_checkpointing(model) -> bool:
    """Whether a layer of the transformers model inside `model` (PEFT-wrapped or not) recomputes
    its activations in the backward pass."""
    name = "is_activation_checkpointing" if _ACTIVATION_CHECKPOINTING else "is_gradient_checkpointing"
    return bool(getattr(base_model(model), name, False))


def weights_fingerprint(tensors) -> str:
    """A short hash of some weights, from up to 4096 evenly spaced values of each tensor, rounded
    to bf16 (so that the same checkpoint loaded in fp32 or bf16 gives the same hash): what a
    resumed run checks the weights its checkpoints do not hold against (LoRA's base, the KL
    reference)."""
    h = hashlib.sha256()
    for t in tensors:
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096]
        h.update(str(tuple(t.shape)).encode())
        h.update(sample.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


from gspo.models.attention import use_cpu_gqa_attention  # noqa: E402,F401  (part of this package's API)
