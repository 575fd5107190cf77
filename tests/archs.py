"""Small decoder models of several families, built from configs (no hub access), for the tests
that check gspo's forward and decoding paths on more than the tiny Qwen3."""

from __future__ import annotations

import transformers as T

NAMES = ("llama", "mistral", "gemma2", "gpt2")
# hybrids: Qwen3.5 has a linear-attention layer whose cache is a conv and a recurrent state (no
# keys/values) beside an attention layer; in Falcon-H1 every layer runs a state-space mixer and
# attention side by side, so each cache layer holds both kinds of state
HYBRIDS = ("qwen3_5", "falcon_h1")


def build_arch(name: str, vocab: int, tok):
    """A random 2-layer model of family `name` (see NAMES) over the tokenizer `tok`."""
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if name == "gpt2":  # learned positions, no grouped-query attention
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=128, **ids))
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, **ids)
    if name == "qwen3_5":  # Qwen3.5's text model: a gated-delta-net layer, then a full-attention one
        return T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(
            head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, **common))
    if name == "falcon_h1":
        return T.FalconH1ForCausalLM(T.FalconH1Config(head_dim=8, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1,
                                                      mamba_d_state=16, mamba_d_ssm=64, **common))
    if name == "llama4":  # Llama 4's text model: a MoE whose router subclasses nn.Linear and returns two tensors
        return T.Llama4ForCausalLM(T.Llama4TextConfig(head_dim=8, intermediate_size_mlp=64, num_local_experts=4,
                                                      num_experts_per_tok=1, interleave_moe_layer_step=1, **common))
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common))
    if name == "mistral":  # sliding-window attention shorter than the sequences
        return T.MistralForCausalLM(T.MistralConfig(sliding_window=8, **common))
    if name == "gemma2":  # + logit soft-capping, sliding and full layers alternating
        return T.Gemma2ForCausalLM(T.Gemma2Config(head_dim=8, sliding_window=8, **common))
    raise ValueError(name)
