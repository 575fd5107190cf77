"""gspo.models.tiny, gspo.models and gspo.models.logprobs: tiny models round-trip; chunked log-probs equal the naive ones."""

import warnings

import pytest
import torch

import gspo.models.lm_head
from torch.utils._python_dispatch import TorchDispatchMode

from gspo.models.logprobs import naive_token_logprobs, token_logprobs
from gspo.models import ModelError, eos_token_ids, load_policy, position_ids_from_mask, resolve_device
from gspo.models.tiny import DEFAULT_CHARS, build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden_size=64, num_layers=2, seed=1)


@pytest.fixture(scope="module")
def gpt2(tok):
    """Absolute position embeddings: unlike RoPE, wrong position ids change its outputs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                     pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def _batch(vocab, n=5, p=6, t=7, seed=0):
    """[left-padded prompt | right-padded completion] with assorted padding, (N, P+T)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, p + t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # shorter prompt
    mask[2, p + 2 :] = 0  # completion of 2 tokens
    mask[3, :2] = 0
    mask[3, p + 5 :] = 0
    mask[4, p:] = 0  # empty completion
    return ids.masked_fill(mask == 0, 0), mask


# ----------------------------------------------------------------------------- gspo.models.tiny


def test_char_tokenizer_encodes_exactly(tok):
    s = "user: 12+3=15, x*y-2\n<a/b>"
    ids = tok(s)["input_ids"]
    assert len(ids) == len(s)  # one token per character, nothing added (no BOS / EOS)
    assert tok.decode(ids) == s  # no spaces inserted between tokens
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<unk>"]) == [0, 1, 2, 3]
    assert tok("?")["input_ids"] == [tok.unk_token_id]
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == s


def test_char_tokenizer_chat_template_and_round_trip(tok, tmp_path):
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "2+2"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "user: 2+2\nassistant: "
    history = msgs + [{"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(history, tokenize=False) == "user: 2+2\nassistant: 4<eos>\n"

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok) == 4 + len(DEFAULT_CHARS)
    s = "abc 0123:\n=+-*<>/"
    assert loaded(s)["input_ids"] == tok(s)["input_ids"]
    assert loaded.decode(loaded(s)["input_ids"]) == s
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text


def test_char_tokenizer_custom_chars():
    t = build_char_tokenizer("aab")  # duplicates dropped
    assert len(t) == 6 and t.decode(t("abba")["input_ids"]) == "abba"


@pytest.mark.parametrize("moe", [False, True])
def test_tiny_model_round_trip(tok, tmp_path, moe):
    from transformers import AutoModelForCausalLM

    m = build_tiny_model(tok, hidden_size=64, num_layers=2, moe=moe, seed=3)
    assert type(m).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    assert m.config.vocab_size == len(tok) and m.dtype == torch.float32
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tied
    for cfg in (m.config, m.generation_config):
        assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 2)
    if moe:
        assert m.config.num_experts == 8 and m.config.num_experts_per_tok == 2
    m.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, m(x).logits, rtol=0, atol=0)
    assert loaded.generation_config.pad_token_id == 0


def test_tiny_model_seeded_and_rng_untouched(tok):
    state = torch.random.get_rng_state()
    a, b = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=7), build_tiny_model(tok, hidden_size=64, num_layers=2, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, build_tiny_model(tok, hidden_size=64, num_layers=2, seed=8).lm_head.weight)


# ----------------------------------------------------------------------------- token_logprobs


def test_position_ids_restart_after_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


@pytest.mark.parametrize(
    "chunk_size,arch", [(1, "model"), (4, "model"), (512, "model"), (4, "gpt2")]
)
def test_chunked_equals_naive_in_value_and_gradient(request, tok, chunk_size, arch):
    model = request.getfixturevalue(arch)
    ids, mask = _batch(len(tok))
    t = 7
    model.zero_grad()
    ours = token_logprobs(model, ids, mask, t, temperature=0.8, chunk_size=chunk_size)
    (ours * torch.linspace(-1, 1, t)).sum().backward()  # a non-uniform upstream gradient
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    ref = naive_token_logprobs(model, ids, mask, t, temperature=0.8)
    (ref * torch.linspace(-1, 1, t)).sum().backward()

    assert ours.dtype == torch.float32 and ours.shape == (5, t)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert (ours[mask[:, -t:] == 0] == 0).all()  # padding is exactly 0
    assert (ours[mask[:, -t:] == 1] < 0).all()
    for k, p in model.named_parameters():
        assert torch.isfinite(grads[k]).all(), k
        torch.testing.assert_close(grads[k], p.grad, rtol=0, atol=1e-5, msg=k)
    model.zero_grad()



@pytest.mark.parametrize("dtype,factor", [(torch.float32, 1.0), (torch.float32, 1 / 0.7), (torch.bfloat16, 2.5)])
def test_picked_log_softmax_backward_equals_autograd(dtype, factor):
    """The written-out backward of log_softmax(factor·z)[y] equals autograd's, for fp32 and
    bf16 logits, with a temperature/scale factor, repeated targets and a zero upstream gradient."""
    from gspo.models.lm_head import _PickedLogSoftmax

    g = torch.Generator().manual_seed(0)
    z = (torch.randn(9, 37, generator=g) * 4).to(dtype)
    y = torch.tensor([0, 36, 5, 5, 5, 17, 0, 30, 12])
    up = torch.randn(9, generator=g)
    up[3] = 0.0
    a = z.clone().requires_grad_()
    got = _PickedLogSoftmax.apply(a, y, factor)
    assert torch.equal(a.detach(), z)  # the input logits are left as they were
    (got * up).sum().backward()
    b = z.clone().requires_grad_()
    ref = torch.log_softmax(b.float() * factor, -1).gather(-1, y[:, None]).squeeze(-1)
    (ref * up).sum().backward()
    assert got.dtype == torch.float32 and a.grad.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)  # |log-probs| up to ~50
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=tol)
    assert (a.grad[3] == 0).all()
    again = _PickedLogSoftmax.apply(z.clone().requires_grad_(), y, factor).sum()
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):  # its saved exponentials are spent
        again.backward()

def test_no_grad_pass(model, tok):
    ids, mask = _batch(len(tok))
    with torch.no_grad():
        out = token_logprobs(model, ids, mask, 7, chunk_size=3)
    assert not out.requires_grad
    ref = naive_token_logprobs(model, ids, mask, 7).detach()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["model", "gpt2"])
def test_left_padding_changes_nothing(request, arch):
    model = request.getfixturevalue(arch)
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    ids = torch.tensor([prompt + completion])
    padded = torch.tensor([[0, 0, 0] + prompt + completion])
    padded_mask = torch.tensor([[0, 0, 0] + [1] * 7])
    with torch.no_grad():
        a = token_logprobs(model, ids, torch.ones_like(ids), 3)
        b = token_logprobs(model, padded, padded_mask, 3)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_temperature_scales_logits(model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        logits = model(ids).logits[0, 2:5].float()  # positions predicting tokens 3..5
        expected = torch.log_softmax(logits / 2.0, -1).gather(-1, ids[0, 3:, None]).squeeze(-1)
        got = token_logprobs(model, ids, torch.ones_like(ids), 3, temperature=2.0)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(got, token_logprobs(model, ids, torch.ones_like(ids), 3)[0])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, torch.ones_like(ids), 3, temperature=0.0)


def test_empty_completion(model):
    ids = torch.tensor([[5, 6, 7]])
    assert token_logprobs(model, ids, torch.ones_like(ids), 0).shape == (1, 0)


class _VocabTensorSizes(TorchDispatchMode):
    """Largest numel of any op output that `is_vocab_wide`."""

    def __init__(self, is_vocab_wide):
        super().__init__()
        self.is_vocab_wide, self.largest = is_vocab_wide, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and self.is_vocab_wide(o):
                self.largest = max(self.largest, o.numel())
        return out


def test_logits_never_materialised_for_whole_batch(tok, monkeypatch):
    """No single op output, and nothing saved for backward, holds more than one chunk of
    [tokens × vocab] values (the naive reference breaks both, so the test can fail)."""
    monkeypatch.setattr(gspo.models.lm_head, "_UNCHECKPOINTED_LOGITS_BYTES", 0)  # as for a real vocabulary
    # hidden_size 32 so no activation width coincides with the vocabulary size (51).
    m = build_tiny_model(tok, hidden_size=32, num_layers=2, intermediate_size=64)
    v, chunk = len(tok), 8
    ids = torch.randint(4, v, (6, 20))  # 6 × 12 = 72 completion tokens
    mask = torch.ones_like(ids)
    token_logprobs(m, ids[:1], mask[:1], 12)  # the one-time head check runs outside the count

    def is_vocab_wide(x):  # logits-like, not the transposed (H, V) head weight
        return x.dim() >= 2 and x.shape[-1] == v and x.shape[-2] != 32

    for fn, lean in ((token_logprobs, True), (naive_token_logprobs, False)):
        saved = []

        def pack(x):
            saved.append(x.numel() if is_vocab_wide(x) else 0)
            return x

        mode = _VocabTensorSizes(is_vocab_wide)
        with mode:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                out = fn(m, ids, mask, 12, chunk_size=chunk)
            out.sum().backward()  # the backward recomputes one chunk at a time
        assert (mode.largest <= chunk * v) == lean, (fn.__name__, mode.largest)
        assert (sum(saved) <= chunk * v) == lean, (fn.__name__, sum(saved))


def test_moe_chunked_equals_naive(tok):
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, moe=True, seed=2)
    ids, mask = _batch(len(tok), seed=1)
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(m, ids, mask, 7, chunk_size=5),
            naive_token_logprobs(m, ids, mask, 7), rtol=0, atol=1e-5,
        )


def test_bfloat16_chunked_equals_naive(tok):
    m = build_tiny_model(tok, hidden_size=64, num_layers=2).to(torch.bfloat16)
    ids, mask = _batch(len(tok))
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(m, ids, mask, 7, chunk_size=4),
            naive_token_logprobs(m, ids, mask, 7), rtol=0, atol=1e-2,
        )


def test_unrecognised_logit_transform_falls_back_to_naive(tok):
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=4)
    plain_forward = m.forward

    def scaled_forward(*args, **kwargs):  # an architecture that rescales its logits
        out = plain_forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    m.forward = scaled_forward
    ids, mask = _batch(len(tok))
    with pytest.warns(UserWarning, match="falling back"):
        got = token_logprobs(m, ids, mask, 7)
    torch.testing.assert_close(got, naive_token_logprobs(m, ids, mask, 7), rtol=0, atol=1e-6)


def test_the_head_check_under_dropout_neither_fails_nor_draws_from_the_rng(tok):
    """model.dropout=true: the trainer's forwards run in training mode with dropout on. The
    once-per-model check of the LM head must still pass (no fallback to full logits) and must
    not draw from the global RNG, or a resumed run (which checks one rollout later) would
    sample differently from the run it continues."""
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=4)
    for mod in m.modules():
        if hasattr(mod, "attention_dropout"):
            mod.attention_dropout = 0.5
    m.train()
    ids, mask = _batch(len(tok))
    with torch.no_grad():  # dropout really acts in training mode: two forwards differ
        assert not torch.equal(m(input_ids=ids, attention_mask=mask).logits, m(input_ids=ids, attention_mask=mask).logits)
    from gspo.models.logprobs import _head_matches_forward, _logit_transform

    before = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "falling back to full-logit log-probs"
        assert _head_matches_forward(m, m.get_output_embeddings(), *_logit_transform(m), ids, mask)
    assert torch.equal(torch.get_rng_state(), before)
    assert m.training and all(mod.training for mod in m.modules())  # each module's mode restored


def test_softcapped_logits_match(tok):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    m = Gemma2ForCausalLM(cfg)
    ids, mask = _batch(len(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the head check must pass: no fallback
        got = token_logprobs(m, ids, mask, 7, chunk_size=4)
    torch.testing.assert_close(got, naive_token_logprobs(m, ids, mask, 7), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, tok, model):
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_load_policy_round_trip(saved_dir, model):
    loaded, t = load_policy(saved_dir, device="cpu")
    assert t.padding_side == "left" and t.pad_token_id == 0 and t.eos_token_id == 1
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    bf16, _ = load_policy(str(saved_dir), dtype="bfloat16", device="cpu")
    assert bf16.dtype == torch.bfloat16


def test_load_policy_without_pad_token_uses_eos(tmp_path, model):
    t = build_char_tokenizer()
    t.pad_token = None
    assert t.pad_token is None
    t.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    _, loaded = load_policy(tmp_path, device="cpu")
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == loaded.eos_token_id


@pytest.mark.parametrize("path", ["/no/such/model", "./missing-model", "../a/b/c", "bad name"])
def test_load_policy_missing_path(path):
    with pytest.raises(ModelError, match="does not exist"):
        load_policy(path)


def test_load_policy_file_and_dtype_errors(tmp_path, saved_dir):
    f = tmp_path / "model.bin"
    f.write_text("x")
    with pytest.raises(ModelError, match="is a file"):
        load_policy(f)
    with pytest.raises(ModelError, match="dtype"):
        load_policy(saved_dir, dtype="int3")


def test_load_policy_offline_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="gspo-tests/not-a-cached-model.*nor is there a local folder"):
        load_policy("gspo-tests/not-a-cached-model")  # (a missing runs/x looks the same)


def test_eos_token_ids(model, tok):
    assert eos_token_ids(model, tok) == [1]
    m = build_tiny_model(tok, hidden_size=64, num_layers=2)
    m.generation_config.eos_token_id = [7, 1, 7, 9]
    assert eos_token_ids(m, tok) == [7, 1, 9]
    m.generation_config.eos_token_id = None
    assert eos_token_ids(m, tok) == [1]


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_small_logits_skip_recompute_with_equal_values_and_gradients(tok, monkeypatch):
    """Below the size threshold the head is not checkpointed; values and gradients are the
    checkpointed path's."""
    ids, mask = _batch(len(tok), seed=3)
    results = []
    for limit in (0, 1 << 30):
        monkeypatch.setattr(gspo.models.lm_head, "_UNCHECKPOINTED_LOGITS_BYTES", limit)
        m = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=4)
        out = token_logprobs(m, ids, mask, 5, chunk_size=7)
        out.sum().backward()
        results.append((out.detach(), m.lm_head.weight.grad.clone(), m.model.layers[0].mlp.up_proj.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("moe", [False, True])
def test_cpu_gqa_attention_gives_the_same_numbers(tok, moe):
    """SDPA with grouped key/value heads (enable_gqa) equals transformers' repeat_kv path:
    log-probs, gradients, and sampling through the KV cache."""
    from gspo.models import use_cpu_gqa_attention
    from gspo.rollout.hf import HFGenerator

    ids, mask = _batch(len(tok), seed=6)
    got = []
    for switch in (False, True):
        m = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=7, moe=moe)
        assert m.config.num_key_value_heads < m.config.num_attention_heads
        if switch:
            assert use_cpu_gqa_attention(m) and m.config._attn_implementation != "sdpa"
        out = token_logprobs(m, ids, mask, 5)
        out.sum().backward()
        torch.manual_seed(0)
        r = HFGenerator(m, tok, max_new_tokens=6).generate(["ab", "user: 1+2\nassistant: "], 3)
        got.append((out.detach(), m.model.layers[0].self_attn.k_proj.weight.grad, r.sampler_logp))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def _qwen3(vocab: int, hidden: int = 128, tie: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        tie_word_embeddings=tie))


@pytest.mark.parametrize("tie", [False, True])
def test_a_large_vocabulary_makes_a_small_model_compute_bound(monkeypatch, tie):
    """The thread default counts the LM head: hidden 128 with 32,000 tokens multiplies each
    token by 4.1M head weights (0.1M a layer), so on a 2-core machine it gets both cores; the
    same body with 1,000 tokens (0.13M head weights) keeps one."""
    from gspo.config import Config
    from gspo.models.logprobs import layer_weights
    from gspo.train.threads import COMPUTE_BOUND_LAYER_WEIGHTS, compute_weights, threads_for_model

    big, small = _qwen3(32_000, tie=tie), _qwen3(1_000, tie=tie)
    layer = layer_weights(small, active=False)
    # one layer: q 128x128, k and v 128x64, o 128x128, MLP 3 x 128x128, norms 2x128 + q/k 2x32
    assert layer == 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 128 + 2 * 128 + 2 * 32
    assert compute_weights(big) == 128 * 32_000 >= COMPUTE_BOUND_LAYER_WEIGHTS > layer
    assert compute_weights(small) == 128 * 1_000 < COMPUTE_BOUND_LAYER_WEIGHTS  # the head, still under
    before = torch.get_num_threads()
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        for model, cfg, want in [(small, Config(), 1), (big, Config(), 2),
                                 (big, Config(threads=1), 1),  # set by the user: kept
                                 (big, _async(Config()), 1)]:  # async: a core a process
            torch.set_num_threads(1)
            assert threads_for_model(cfg, model) == want == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _async(cfg):
    cfg.rollout.mode = "async"
    return cfg
