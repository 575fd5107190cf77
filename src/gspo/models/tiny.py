"""Tiny built-in tokenizer and models for tests and the offline demo.

Nothing here touches the network: the tokenizer is built from a string of characters and the
models from a config with random (seeded) weights. Both save with ``save_pretrained`` and load
back with the ``Auto*`` classes, so they exercise the same code path as a real checkpoint.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from gspo.config import Config, TinyConfig

# Characters used by the built-in arithmetic / string tasks and the chat template.
DEFAULT_CHARS = "0123456789+-*=abcdefghijklmnopqrstuvwxyz:, \n<>/"

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"

# Renders "role: content\n" per message (after a "system: tools a,b" line when tools are given);
# assistant turns end with EOS, as the model's own
# generations do. The generation prompt is "assistant: ". `{{ '\n' }}` rather than a literal
# newline because transformers renders chat templates with trim_blocks=True.
CHAT_TEMPLATE = (
    "{% if tools %}system: tools {% for t in tools %}{{ (t.function or t).name }}"
    "{% if not loop.last %},{% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character of `chars` is one token.

    Ids: ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<unk>``=3, then the characters in the order
    given (duplicates dropped). Characters not in `chars` encode to ``<unk>``.
    Nothing is added automatically when encoding (no BOS, no EOS), so ``encode(s)`` is exactly
    the characters of ``s`` and ``decode(encode(s)) == s`` for any ``s`` over `chars`; the
    special-token strings ("<eos>" …) in text encode as the special tokens, as with any HF
    tokenizer. ``pad_token != eos_token``.
    """
    vocab: dict[str, int] = {tok: i for i, tok in enumerate((PAD, EOS, BOS, UNK))}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    # BPE with no merges over a character vocabulary splits text into single characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # prompts are left-padded for generation
    )


def build_tiny_model(
    tokenizer,
    *,
    hidden_size: int = TinyConfig.hidden_size,
    num_layers: int = TinyConfig.num_layers,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    moe: bool = TinyConfig.moe,
    num_experts: int = TinyConfig.num_experts,
    num_experts_per_tok: int = TinyConfig.experts_per_tok,
    seed: int = Config.seed,
    max_position_embeddings: int = 128,
) -> PreTrainedModel:
    """A randomly initialised Qwen3 (or Qwen3-MoE when ``moe=True``) causal LM in fp32.

    The vocabulary, pad/eos/bos ids come from `tokenizer` and are set both in the model config
    and in ``model.generation_config``. Input and output embeddings are tied. Initialisation is
    seeded by `seed` without touching torch's global RNG state. With ``moe=True`` every layer is
    sparse (``decoder_sparse_step=1``), each expert has `intermediate_size` hidden units and the
    top-k routing weights are renormalised (``norm_topk_prob=True``, as in Qwen3-30B-A3B).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) and "
            f"num_heads by num_kv_heads ({num_kv_heads})"
        )
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,  # Qwen3Config defaults to 128 otherwise
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    if moe:
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=intermediate_size,
            moe_intermediate_size=intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
        )
        cls = Qwen3MoeForCausalLM
    else:
        config = Qwen3Config(**common, intermediate_size=intermediate_size)
        cls = Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model = model.to(torch.float32)
    gc = model.generation_config
    gc.pad_token_id = tokenizer.pad_token_id
    gc.eos_token_id = tokenizer.eos_token_id
    gc.bos_token_id = tokenizer.bos_token_id
    return model
