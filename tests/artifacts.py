"""Saved artifacts as users bring them: tokenizers in each family's style and tiny random models,
written with ``save_pretrained`` to a directory that ``AutoTokenizer`` / ``AutoModelForCausalLM``
(and so ``gspo train model.name_or_path=DIR``) load. Nothing touches the network.

What a checkpoint from disk has that a model built in the test process has not: it starts in
eval mode, its tokenizer may add a BOS to plain text, may have no pad token (pad == eos once
gspo fills it), its generation_config may list several EOS ids and ship sampling defaults, and
its chat template may write the BOS itself.

Tokenizer styles (`save_tokenizer(dir, style)`):

=========  =====================  =========================  ==============  =====================
style      model                  BOS added to plain text    pad             EOS (tokenizer)
=========  =====================  =========================  ==============  =====================
llama      sentencepiece-like     ``<s>`` (post-processor)   none            ``</s>``
mistral    sentencepiece-like     ``<s>`` (post-processor)   none            ``</s>``
gemma      sentencepiece-like     ``<bos>`` (post-processor) ``<pad>``       ``<eos>``
qwen       byte-level BPE         none (no BOS token)        <|endoftext|>   ``<|im_end|>``
gpt2       byte-level BPE         none (bos = eos)           none            ``<|endoftext|>``
=========  =====================  =========================  ==============  =====================

"sentencepiece-like": a character vocabulary (printable ASCII, ``▁`` for the space) with byte
fallback (``<0x00>``..``<0xFF>``), so any text encodes without ``<unk>``; llama and mistral
prepend ``▁`` to the text (Llama-2's dummy prefix), gemma does not. "byte-level": GPT-2's 256
byte symbols, no merges. Chat templates: llama (Llama-2 ``<s>[INST] ... [/INST]``, a BOS before
every user turn), mistral (one ``<s>``, then ``[INST]``/``[/INST]`` as special control tokens),
gemma (``<bos>`` then ``<start_of_turn>role\\n...<end_of_turn>\\n``, ``model`` for the
assistant), qwen (ChatML with a default system turn when none is given), gpt2 (none). Every
template folds a system message into the next user turn except qwen's, which keeps it.

Models (`save_model(dir, family)`): qwen3, qwen3_moe (4 experts, top-2), qwen3_5 (Qwen3.5's hybrid
text model: a gated-delta-net linear-attention layer, whose cache is a conv and a recurrent
state, then a full-attention layer), llama, mistral
(sliding window 16), gemma2 (soft-capping, sliding window 16), gpt2 (learned positions, its
dropout 0.1); hidden 32, 2 layers, 4 heads over 2 KV heads where the family has GQA, 256
positions. generation_config: EOS lists for qwen ([<|im_end|>, <|endoftext|>]) and gemma
([<eos>, <end_of_turn>]), and the sampling defaults of the families' instruct checkpoints (qwen:
temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05; llama: temperature 0.6, top-p
0.9; gemma: cache_implementation "hybrid"). Data: `write_chat_jsonl`, `write_plain_jsonl`.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import torch
import transformers as T
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

STYLES = ("llama", "mistral", "gemma", "qwen", "gpt2")
FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "llama", "gemma2", "mistral", "gpt2")
DEFAULT_STYLE = {"qwen3": "qwen", "qwen3_moe": "qwen", "qwen3_5": "qwen", "llama": "llama", "gemma2": "gemma",
                 "mistral": "mistral", "gpt2": "gpt2", "opt": "gpt2", "minimax": "qwen"}

# ------------------------------------------------------------------------------------ templates
# (written as single lines: transformers renders templates with trim_blocks=True; "\\n" is a
# newline inside a Jinja string literal)

LLAMA_TEMPLATE = (
    "{% set ns = namespace(sys='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = '<<SYS>>\\n' + m['content'] | trim + '\\n<</SYS>>\\n\\n' %}"
    "{% elif m['role'] == 'user' %}{{ bos_token + '[INST] ' + ns.sys + m['content'] | trim + ' [/INST]' }}"
    "{% set ns.sys = '' %}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = m['content'] + '\\n\\n' %}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + ns.sys + m['content'] + '[/INST]' }}{% set ns.sys = '' %}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = m['content'] | trim + '\\n\\n' %}"
    "{% else %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (ns.sys if role == 'user' else '') + m['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{% if role == 'user' %}{% set ns.sys = '' %}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ------------------------------------------------------------------------------------ tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 bytes to printable unicode characters (byte-level BPE symbols)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _sentencepiece_like(specials: list[str], *, dummy_prefix: bool) -> Tokenizer:
    """Specials first (ids 0..), then the 256 byte-fallback tokens, then ``▁`` and every printable
    ASCII character but the space (which the normalizer turns into ``▁``)."""
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁" + "".join(c for c in string.printable if c not in " \r\x0b\x0c"):
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    space = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), space]) if dummy_prefix else space
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if dummy_prefix else []))
    return tok


def _byte_level() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _add_bos(tok: Tokenizer, bos: str) -> None:
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, bos_id)])


def build_tokenizer(style: str) -> T.PreTrainedTokenizerFast:
    """The tokenizer of `style` (see the module docstring), not yet saved."""
    if style in ("llama", "mistral"):
        tok = _sentencepiece_like(["<unk>", "<s>", "</s>"], dummy_prefix=True)  # Llama's ids 0, 1, 2
        if style == "mistral":  # Mistral v3's control tokens
            tok.add_special_tokens([AddedToken("[INST]", special=True), AddedToken("[/INST]", special=True)])
        _add_bos(tok, "<s>")
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        template = LLAMA_TEMPLATE if style == "llama" else MISTRAL_TEMPLATE
    elif style == "gemma":
        tok = _sentencepiece_like(["<pad>", "<eos>", "<bos>", "<unk>"], dummy_prefix=False)  # Gemma's ids 0..3
        tok.add_special_tokens([AddedToken("<start_of_turn>", special=True), AddedToken("<end_of_turn>", special=True)])
        _add_bos(tok, "<bos>")
        names = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
        template = GEMMA_TEMPLATE
    elif style == "qwen":
        tok = _byte_level()
        tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
        names = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
        template = CHATML_TEMPLATE
    elif style == "gpt2":
        tok = _byte_level()
        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
        names = dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")
        template = None
    else:
        raise ValueError(f"unknown tokenizer style {style!r}; styles: {', '.join(STYLES)}")
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, clean_up_tokenization_spaces=False,
                                     model_max_length=1024, **names)


def save_tokenizer(directory: str | os.PathLike, style: str) -> Path:
    """Write the tokenizer of `style` to `directory` with ``save_pretrained``; returns the directory."""
    directory = Path(directory)
    build_tokenizer(style).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------ models

# Sampling defaults and EOS lists as the families' instruct checkpoints ship them; gspo's sampler
# and greedy evaluation must not be steered by them.
_GENERATION = {
    "qwen": dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "llama": dict(do_sample=True, temperature=0.6, top_p=0.9),
    "gemma": dict(cache_implementation="hybrid"),
    "mistral": {},
    "gpt2": {},
}


def _eos_list(style: str, tok) -> int | list[int]:
    ids = {"qwen": ["<|im_end|>", "<|endoftext|>"], "gemma": ["<eos>", "<end_of_turn>"]}.get(style)
    return tok.convert_tokens_to_ids(ids) if ids else tok.eos_token_id


def _config(family: str, vocab: int, special: dict, overrides: dict):
    dense = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, **special)
    if family == "qwen3":
        return T.Qwen3Config(**{**dense, "head_dim": 8, "tie_word_embeddings": True, **overrides})
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**{**dense, "head_dim": 8, "tie_word_embeddings": True, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                                   "norm_topk_prob": True, **overrides})
    if family == "qwen3_5":  # a hybrid: a linear-attention layer (conv + recurrent state), then full attention
        return T.Qwen3_5TextConfig(**{**dense, "head_dim": 8, "tie_word_embeddings": True,
                                      "layer_types": ["linear_attention", "full_attention"],
                                      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                                      "linear_value_head_dim": 8, **overrides})
    if family == "llama":
        return T.LlamaConfig(**{**dense, **overrides})
    if family == "mistral":  # a sliding window shorter than a chat prompt
        return T.MistralConfig(**{**dense, "sliding_window": 16, **overrides})
    if family == "gemma2":  # logit soft-capping, sliding and global layers alternating
        return T.Gemma2Config(**{**dense, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 16, **overrides})
    if family == "minimax":  # MiniMax-Text: lightning (linear) attention, then full attention; a cache class of its own
        return T.MiniMaxConfig(**{**dense, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "layer_types": ["linear_attention", "full_attention"], **overrides})
    if family == "opt":  # OPT's decoder layers apply their dropout (0.1 here) themselves, not as a module
        return T.OPTConfig(**{"vocab_size": vocab, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "max_position_embeddings": 256, "word_embed_proj_dim": 32,
                              "dropout": 0.1, **special, **overrides})
    if family == "gpt2":  # learned positions, no GQA; GPT-2's own dropout 0.1 defaults kept
        return T.GPT2Config(**{"vocab_size": vocab, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256,
                               **special, **overrides})
    raise ValueError(f"unknown model family {family!r}; families: {', '.join(FAMILIES)}")


def save_model(directory: str | os.PathLike, family: str, tokenizer_dir: str | os.PathLike | None = None, *,
               style: str | None = None, seed: int = 0, generation: dict | None = None, **overrides) -> Path:
    """Write a tiny random `family` model (fp32 safetensors, config, generation_config) and its
    tokenizer to `directory`; returns the directory.

    The tokenizer is loaded from `tokenizer_dir` when given, else built in `style` (default:
    `DEFAULT_STYLE[family]`). The vocabulary is the tokenizer's size; the config holds its
    bos/eos/pad ids (None where it has none) and generation_config the same, with the style's EOS
    list (qwen: [<|im_end|>, <|endoftext|>], gemma: [<eos>, <end_of_turn>]) and its checkpoint's
    sampling defaults, updated by `generation` (e.g. ``{"repetition_penalty": 100.0}``).
    `overrides` go to the model config (e.g. ``attention_dropout=0.1``, or ``vocab_size=320`` for an
    embedding padded past the tokenizer, as Qwen's are); `seed` seeds the weights."""
    directory = Path(directory)
    if tokenizer_dir is not None:
        tok = T.AutoTokenizer.from_pretrained(tokenizer_dir)
        style = style or "custom"
    else:
        style = style or DEFAULT_STYLE[family]
        tok = build_tokenizer(style)
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = _config(family, len(tok), special, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = T.GenerationConfig(**{**special, "eos_token_id": _eos_list(style, tok),
                                                     **_GENERATION.get(style, {}), **(generation or {})})
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------ data


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def chat_rows(n: int = 16) -> list[dict]:
    """Chat rows ({"messages", "answer", "id"}) as datasets come: some with a system turn, some
    multi-turn with an earlier assistant answer, contents with stray whitespace and non-ASCII
    text, messages with extra keys, answers that are ints. Every row has the same keys."""
    rows = []
    for i in range(n):
        a, b = 3 + i, 7 * i % 50
        q = f"{a}+{b}="
        kind = i % 4
        if kind == 0:
            msgs = [{"role": "user", "content": q}]
        elif kind == 1:
            msgs = [{"role": "system", "content": "  Réponds avec un nombre — seulement.\n"},
                    {"role": "user", "content": f"  {q}\n"}]
        elif kind == 2:
            msgs = [{"role": "user", "content": "1+1=", "name": "alice"},
                    {"role": "assistant", "content": "2"},
                    {"role": "user", "content": q, "name": "alice"}]
        else:
            msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": f"What is {a} + {b}?"}]
        rows.append({"messages": msgs, "answer": a + b if i % 2 else str(a + b), "id": i})
    return rows


def write_chat_jsonl(path: str | os.PathLike, n: int = 16) -> Path:
    """`chat_rows(n)` as JSONL (use ``data.prompt_column=messages``)."""
    return write_jsonl(path, chat_rows(n))


def plain_rows(n: int = 16) -> list[dict]:
    """Plain-text rows {"prompt": "a+b=", "answer": "c", ...} with ragged extra columns: "level"
    is missing from row 0 and present on every other row; "source" is on every row but row 3."""
    rows = []
    for i in range(n):
        a, b = 2 * i, 11 + i
        row = {"prompt": f"{a}+{b}=", "answer": str(a + b), "source": "synthetic"}
        if i:
            row["level"] = 1 + i % 3
        if i == 3:
            del row["source"]
        rows.append(row)
    return rows


def write_plain_jsonl(path: str | os.PathLike, n: int = 16) -> Path:
    """`plain_rows(n)` as JSONL."""
    return write_jsonl(path, plain_rows(n))


def signal_reward(prompts, completions, **columns) -> list[float]:
    """A reward that differs between random completions (a checksum of the text in [0, 1]), so a
    run of a random model has nonzero advantages and its update passes run. Reference it as
    ``artifacts:signal_reward``."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(sum(map(ord, text)) % 101 / 100)
    return out


def needs_ragged_columns(prompts, completions, level=None, source=None, **columns) -> list[float]:
    """0 for every completion; raises unless both of `plain_rows`' ragged columns ("level", "source")
    reach it as columns (a list per column, None where a row lacks the key). Reference it as
    ``artifacts:needs_ragged_columns``."""
    if level is None or source is None:
        raise ValueError(f"ragged columns did not reach the reward: level={level!r}, source={source!r}")
    if len(level) != len(completions) or len(source) != len(completions):
        raise ValueError(f"{len(level)} level / {len(source)} source values for {len(completions)} completions")
    return [0.0] * len(completions)
