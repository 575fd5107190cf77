"""gspo.rollout: HFGenerator rollouts (shapes, masks, sampler log-probs) and Rollout slicing."""

import pytest
import torch
from archs import HYBRIDS, NAMES, build_arch

from gspo.models.logprobs import naive_token_logprobs, token_logprobs
from gspo.rollout import Generator, Rollout
from gspo.rollout.hf import HFGenerator
from gspo.models.tiny import build_char_tokenizer, build_tiny_model

PROMPTS = ["user: 1+2\nassistant: ", "ab", "user: 9*9=\nassistant: "]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """A tiny Qwen3 whose untied head has a bias towards EOS (p ≈ 0.13 per step), so that with
    8 new tokens roughly two thirds of completions end by EOS and one third by length."""
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=0)
    head = torch.nn.Linear(m.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 2.0
    m.lm_head = head
    return m


def _generate(model, tok, seed=0, prompts=PROMPTS, group_size=8, **kw):
    kw.setdefault("max_new_tokens", 8)
    torch.manual_seed(seed)
    return HFGenerator(model, tok, **kw).generate(prompts, group_size)


def test_shapes_masks_and_finish_reasons(model, tok):
    r = _generate(model, tok, batch_size=7)  # 24 rows in uneven chunks
    n, g, eos, pad = 24, 8, tok.eos_token_id, tok.pad_token_id
    assert isinstance(r, Rollout) and r.num_samples == n and r.group_size == g
    assert r.completion_ids.shape == r.completion_mask.shape == r.sampler_logp.shape
    assert r.completion_ids.shape[1] <= 8 and r.sampler_logp.dtype == torch.float32
    assert r.prompts == [p for p in PROMPTS for _ in range(g)]
    assert r.group_ids.tolist() == [i // g for i in range(n)]
    assert set(r.finish_reason) == {"eos", "length"}  # the EOS bias gives both

    # prompts: left-padded, exactly the tokenizer's encoding (no special tokens added)
    for i in range(n):
        enc = tok(r.prompts[i], add_special_tokens=False)["input_ids"]
        assert r.prompt_mask[i].sum() == len(enc)
        assert r.prompt_ids[i, -len(enc) :].tolist() == enc
        assert (r.prompt_ids[i, : -len(enc)] == pad).all()
    assert r.prompt_mask[:, -1].all()

    for i in range(n):
        m, ids, lp = r.completion_mask[i], r.completion_ids[i], r.sampler_logp[i]
        k = int(m.sum())
        assert m[:k].all() and not m[k:].any()  # a prefix of ones
        assert (ids[k:] == pad).all() and (lp[k:] == 0).all() and (lp[:k] < 0).all()
        real = ids[:k].tolist()
        if r.finish_reason[i] == "eos":
            assert real[-1] == eos and eos not in real[:-1]  # up to and including first EOS
            assert r.completions[i] == tok.decode(real[:-1], skip_special_tokens=True)
        else:
            assert k == 8 and eos not in real
            assert r.completions[i] == tok.decode(real, skip_special_tokens=True)
    assert r.completion_lengths.tolist() == r.completion_mask.sum(1).tolist()
    assert torch.equal(r.input_ids, torch.cat([r.prompt_ids, r.completion_ids], 1))
    assert torch.equal(r.attention_mask, torch.cat([r.prompt_mask, r.completion_mask], 1))


@pytest.mark.parametrize("moe", [False, True])
def test_sampler_logp_equals_trainer_logp(tok, moe):
    """The sampler's log-probs and the trainer's π_old recomputation must agree (GSPO.md)."""
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, moe=moe, seed=5)
    r = _generate(m, tok, temperature=0.7, batch_size=5)
    t = r.completion_ids.shape[1]
    with torch.no_grad():
        trainer = token_logprobs(m, r.input_ids, r.attention_mask, t, temperature=0.7, chunk_size=9)
    torch.testing.assert_close(r.sampler_logp, trainer, rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine", ["gspo", "hf"])
def test_bf16_sampling_runs_under_autocast_with_a_small_measured_gap(tok, engine):
    """rollout.mixed_precision=bf16: the sampler's forwards run in bf16 over the fp32 weights
    (the log-probs then differ from an fp32 trainer pass, by bf16's rounding and no more), and
    the weights themselves stay fp32."""
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=5)
    r = _generate(m, tok, temperature=0.7, engine=engine, autocast_dtype=torch.bfloat16)
    t = r.completion_ids.shape[1]
    with torch.no_grad():
        fp32 = token_logprobs(m, r.input_ids, r.attention_mask, t, temperature=0.7, chunk_size=9)
    gap = (r.sampler_logp - fp32)[r.completion_mask.bool()].abs()
    assert 1e-4 < gap.max() < 0.5 and gap.mean() < 0.05
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_bf16_sampling_settings(tmp_path):
    from gspo.config import ConfigError, load_config
    from gspo.train.run import resolve_old_logp

    cfg = load_config(None, ["rollout.mixed_precision=bf16"])
    assert resolve_old_logp(cfg, has_routers=False) == "trainer"  # not the trainer's numbers any more
    assert resolve_old_logp(load_config(None, []), has_routers=False) == "sampler"
    with pytest.raises(ConfigError, match="config field 'rollout.mixed_precision'"):
        load_config(None, ["rollout.mixed_precision=bf16", "rollout.backend=vllm"])
    with pytest.raises(ConfigError, match="config field 'rollout.mixed_precision'"):
        load_config(None, ["rollout.mixed_precision=fp8"])


def test_top_k_top_p_filter_sampling_not_logp(model, tok):
    """Top-k restricts which tokens are drawn, yet sampler_logp is still the unfiltered
    log_softmax(logits / T): the sum over a top-2 support would be ~log(1) if renormalised."""
    temp = 1.3
    r = _generate(model, tok, temperature=temp, top_k=2, top_p=0.95)
    t = r.completion_ids.shape[1]
    with torch.no_grad():
        unfiltered = naive_token_logprobs(model, r.input_ids, r.attention_mask, t, temperature=temp)
        logits = model(r.input_ids, attention_mask=r.attention_mask).logits
    torch.testing.assert_close(r.sampler_logp, unfiltered, rtol=0, atol=1e-5)
    # every sampled token is one of the two most likely at its step ...
    step_logits = logits[:, -t - 1 : -1]  # (N, T, V)
    rank = (step_logits > step_logits.gather(-1, r.completion_ids[..., None])).sum(-1)  # (N, T)
    assert (rank[r.completion_mask.bool()] < 2).all()
    # ... and its log-prob is not renormalised over those two (that would be > log(0.5) for one)
    assert (r.sampler_logp[r.completion_mask.bool()] < -1.0).float().mean() > 0.5


def test_recorded_logp_equals_generate_output_logits(model, tok):
    """engine="hf": the logits processor sees the same raw logits that `output_logits=True` returns."""
    gen = HFGenerator(model, tok, temperature=0.9, top_k=4, max_new_tokens=6, engine="hf")
    torch.manual_seed(1)
    r = gen.generate(["ab", "user: 3\nassistant: "], 2)
    ids, mask = r.prompt_ids, r.prompt_mask
    torch.manual_seed(1)
    model.eval()
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=gen._generation_config(gen.max_new_tokens),
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    comp = out.sequences[:, ids.shape[1] :]
    assert torch.equal(comp.masked_fill(r.completion_mask == 0, 0), r.completion_ids)
    raw = torch.stack(out.logits, 1).float() / 0.9  # (N, T, V)
    ref = torch.log_softmax(raw, -1).gather(-1, comp[..., None]).squeeze(-1)
    torch.testing.assert_close(r.sampler_logp, ref * r.completion_mask, rtol=0, atol=1e-6)


def test_seeded_rollouts_are_reproducible(model, tok):
    a, b = _generate(model, tok, seed=3), _generate(model, tok, seed=3)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.sampler_logp, b.sampler_logp)
    assert a.completions == b.completions and a.finish_reason == b.finish_reason
    assert not torch.equal(_generate(model, tok, seed=4).completion_ids, a.completion_ids)


def test_checkpoint_sampling_defaults_do_not_leak(model, tok):
    """Sampling settings stored in the model's generation config (a near-greedy min_p, a
    repetition penalty) must not act: the rollout equals the one from a clean config."""
    ref = _generate(model, tok, seed=2)
    saved = model.generation_config
    model.generation_config = saved.__class__.from_dict(saved.to_dict())
    model.generation_config.min_p = 0.9
    model.generation_config.repetition_penalty = 5.0
    try:
        gc = model.generation_config
        got = _generate(model, tok, seed=2)
        assert model.generation_config is gc  # restored
    finally:
        model.generation_config = saved
    assert torch.equal(got.completion_ids, ref.completion_ids)


def test_eval_mode_during_sampling_then_restored(model, tok):
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(mod.training))
    model.train()
    try:
        _generate(model, tok, prompts=["ab"], group_size=2, max_new_tokens=3)
    finally:
        hook.remove()
    assert seen and not any(seen) and model.training
    model.eval()


def test_protocol_and_validation(model, tok):
    gen = HFGenerator(model, tok)
    assert isinstance(gen, Generator)
    gen.sync_weights(model)  # no-op
    for bad in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_k": -1}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            HFGenerator(model, tok, **bad)
    with pytest.raises(ValueError, match="group_size"):
        gen.generate(["ab"], 0)


def _hand_rollout():
    pad = 0
    prompt_ids = torch.tensor(
        [[pad, pad, 5, 6], [pad, 7, 8, 9], [pad, pad, 5, 6], [pad, pad, 7, 7]]
    )
    completion_ids = torch.tensor(
        [[10, 1, pad, pad], [11, 12, 13, pad], [1, pad, pad, pad], [9, pad, pad, pad]]
    )
    completion_mask = (completion_ids != pad).long()
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=(prompt_ids != pad).long(),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        sampler_logp=-0.5 * completion_mask.float(),
        finish_reason=["eos", "length", "eos", "length"],
        group_size=2,
        prompts=["a", "a", "b", "b"],
        completions=["x", "yzw", "", "v"],
    )


def test_trim_and_select():
    r = _hand_rollout()
    t = r.trim()  # prompt column 0 and completion column 3 are padding in every row
    assert t.prompt_ids.shape == (4, 3) and t.completion_ids.shape == (4, 3)
    assert t.prompt_ids[:, 0].tolist() == [0, 7, 0, 0]
    assert t.group_ids.tolist() == [0, 0, 1, 1]

    s = r.select([2, 0])  # rows 2 and 0: prompt columns 0-1 and completion columns 2-3 are padding
    assert s.prompt_ids.tolist() == [[5, 6], [5, 6]]
    assert s.completion_ids.tolist() == [[1, 0], [10, 1]]
    assert s.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert s.sampler_logp.tolist() == [[-0.5, 0.0], [-0.5, -0.5]]
    assert s.finish_reason == ["eos", "eos"] and s.prompts == ["b", "a"]
    assert s.completions == ["", "x"]
    assert s.group_ids.tolist() == [1, 0] and s.group_size == 2
    assert s.completion_lengths.tolist() == [1, 2]
    assert s.input_ids.shape == (2, 4)
    assert torch.equal(r.select(torch.tensor([1])).completion_ids, torch.tensor([[11, 12, 13]]))


def test_select_feeds_token_logprobs(model, tok):
    """A trimmed minibatch gives the same log-probs as the rows of the full batch."""
    r = _generate(model, tok, group_size=4)
    t = r.completion_ids.shape[1]
    with torch.no_grad():
        full = token_logprobs(model, r.input_ids, r.attention_mask, t)
        mb = r.select([4, 5, 6, 7])  # the "ab" group: short prompt, trimmed
        part = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_ids.shape[1])
    assert mb.prompt_ids.shape[1] == 2
    torch.testing.assert_close(part, full[4:8, : part.shape[1]], rtol=0, atol=1e-5)
    assert (full[4:8, part.shape[1] :] == 0).all()


def test_pad_equal_to_eos(model):
    """A tokenizer without a pad token (load_policy then pads with EOS): masks come from the
    first EOS, so EOS-valued padding is still masked out."""
    t = build_char_tokenizer()
    t.pad_token = None
    r = _generate(model, t, prompts=["ab", "user: 1\nassistant: "], group_size=8)
    eos = t.eos_token_id
    assert "eos" in r.finish_reason
    for i in range(r.num_samples):
        k = int(r.completion_lengths[i])
        assert (r.completion_ids[i, k:] == eos).all() and not r.completion_mask[i, k:].any()
        assert (r.completion_ids[i, : k - 1] != eos).all()
    assert (r.prompt_ids[r.prompt_mask == 0] == eos).all()


def test_seeded_chunks_do_not_depend_on_the_split(model, tok):
    """With a seed, rows [8, 16) sampled as the second half of one call (chunks of 8) or alone
    at offset 8 (as a second process would) are the same; the global RNG is left alone."""
    gen = HFGenerator(model, tok, max_new_tokens=8, batch_size=8)
    prompts = ["user: 1+2\nassistant: ", "ab", "user: 9*9=\nassistant: ", "xy"]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    whole = gen.generate(prompts, 4, seed=77)
    assert torch.equal(torch.get_rng_state(), before)
    second = gen.generate(prompts[2:], 4, seed=77, offset=8)
    t = second.completion_ids.shape[1]
    assert torch.equal(whole.completion_ids[8:, :t], second.completion_ids)
    assert whole.completions[8:] == second.completions
    torch.testing.assert_close(whole.sampler_logp[8:, :t], second.sampler_logp)
    other = gen.generate(prompts, 4, seed=78)
    assert other.completions != whole.completions


def _filtered(p: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution top-k, then top-p, leave of probabilities p (V,), renormalised."""
    want = p.clone()
    if top_k:
        want[torch.argsort(p, descending=True)[top_k:]] = 0
    if top_p < 1:
        srt, order = torch.sort(want, descending=True)
        cum_before = (srt / srt.sum()).cumsum(0) - srt / srt.sum()
        want[order[cum_before >= top_p]] = 0
    return want / want.sum()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.8)])
def test_sample_tokens_draws_from_the_filtered_distribution(top_k, top_p):
    """Empirical frequencies of 40k draws match softmax(logits / T) after top-k then top-p
    (renormalised), and the returned log-probs are of the unfiltered distribution."""
    from gspo.rollout.sampling import sample_tokens

    temp = 0.8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = torch.softmax(logits / temp, -1)
    want = _filtered(p, top_k, top_p)
    torch.manual_seed(0)
    n = 40_000
    tokens, lp = sample_tokens(logits.expand(n, -1), temp, top_k, top_p)
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    assert (freq[want == 0] == 0).all()  # filtered tokens are never drawn
    assert (freq - want).abs().sum() / 2 < 0.015  # total variation (sampling noise ~0.005)
    torch.testing.assert_close(lp, torch.log(p)[tokens], rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (40, 1.0), (0, 0.9)])
def test_sample_tokens_over_several_cdf_blocks(top_k, top_p):
    """A 150-token vocabulary spans two full blocks of the two-level inverse CDF and a remainder:
    frequencies match the filtered softmax, tokens of weight 0 (logit -inf, some at block
    edges) are never drawn, and large logits (~300) neither underflow nor overflow."""
    from gspo.rollout.sampling import _CDF_BLOCK, sample_tokens

    vocab = 150
    assert 2 * _CDF_BLOCK < vocab < 3 * _CDF_BLOCK
    g = torch.Generator().manual_seed(3)
    logits = 300.0 + torch.randn(vocab, generator=g) * 1.5
    dead = torch.tensor([0, 63, 64, 127, 128, 149, 70, 100])  # block edges and the last token
    logits[dead] = float("-inf")
    p = torch.softmax(logits, -1)
    want = _filtered(p, top_k, top_p)
    torch.manual_seed(0)
    n = 60_000
    tokens, lp = sample_tokens(logits.expand(n, -1), 1.0, top_k, top_p)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    assert (freq[want == 0] == 0).all()
    assert (freq[dead] == 0).all()
    assert (freq - want).abs().sum() / 2 < 0.03  # total variation (sampling noise ~0.015)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[tokens], rtol=0, atol=2e-5)


def test_inverse_cdf_picks_the_token_under_the_uniform():
    """The two-level draw returns the token whose cumulative-weight interval holds u·total, in
    the first block, a middle block and the remainder block (checked against a one-level
    float64 inverse CDF with the same uniforms)."""
    from gspo.rollout.sampling import _inverse_cdf

    g = torch.Generator().manual_seed(0)
    w = torch.rand(500, 150, generator=g) ** 4  # (rows, V): uneven weights
    w[:, ::7] = 0.0
    torch.manual_seed(5)
    got, total = _inverse_cdf(w)
    torch.manual_seed(5)
    cdf = w.double().cumsum(-1)
    u = torch.rand(500, 1, dtype=torch.float64) * cdf[:, -1:]
    want = torch.searchsorted(cdf, u, right=True).squeeze(1)
    torch.testing.assert_close(total, cdf[:, -1], rtol=1e-6, atol=0)
    assert (got == want).float().mean() > 0.99  # equal up to float32 block-sum rounding at edges
    assert set((want // 64).tolist()) == {0, 1, 2}
    assert (w.gather(1, got[:, None]) > 0).all()


@pytest.mark.parametrize("arch", NAMES + HYBRIDS)
def test_decode_on_other_architectures(tok, arch):
    """gspo's decode loop (KV cache, last-position head, rows leaving the batch at EOS) on other
    decoder families: sampler log-probs equal the trainer's recomputation. On a hybrid the rows
    that leave and a group's copies of its prompt are selected in the recurrent states too."""
    from gspo.models import use_cpu_gqa_attention

    torch.manual_seed(0)
    m = build_arch(arch, len(tok), tok).eval()
    use_cpu_gqa_attention(m)
    eos = tok.convert_tokens_to_ids(list("abcdefgh"))  # several "EOS" ids: rows end at varied steps
    torch.manual_seed(1)
    r = HFGenerator(m, tok, max_new_tokens=12, temperature=0.8, eos_token_ids=eos).generate(PROMPTS, 6)
    assert set(r.finish_reason) == {"eos", "length"}
    with torch.no_grad():
        lp = token_logprobs(m, r.input_ids, r.attention_mask, r.completion_ids.shape[1], temperature=0.8)
    torch.testing.assert_close(r.sampler_logp, lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_hybrid_models_left_padding_leaves_its_rows_as_they_are_alone(tok, arch):
    """A linear-attention layer carries a recurrent state through every position, pads included:
    each row of a left-padded batch gets the log-probs it gets alone, unpadded, in the trainer's
    forward and in the sampler's (so pi_old, pi_theta and the policy are one distribution)."""
    torch.manual_seed(0)
    m = build_arch(arch, len(tok), tok).eval()
    torch.manual_seed(1)
    r = HFGenerator(m, tok, max_new_tokens=6, temperature=1.0).generate(PROMPTS, 2)
    t = r.completion_ids.shape[1]
    with torch.no_grad():
        batch = token_logprobs(m, r.input_ids, r.attention_mask, t)
        for i in range(r.input_ids.shape[0]):
            keep = r.attention_mask[i].bool()
            keep[-t:] = True  # the completion's columns (padding after EOS is scored 0 either way)
            alone = token_logprobs(m, r.input_ids[i, keep][None], r.attention_mask[i, keep][None], t)
            torch.testing.assert_close(batch[i], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(r.sampler_logp, batch, rtol=0, atol=1e-5)
    assert (r.attention_mask[:, : r.input_ids.shape[1] - t] == 0).any()  # some rows were padded


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt2"])
def test_the_preallocated_kv_cache_samples_what_dynamic_cache_samples(tok, arch, monkeypatch):
    """decode writes keys/values into buffers allocated once (rollout._preallocated_cache)
    instead of concatenating the cache at every step: the same tokens and log-probs, with
    rows leaving the batch at varied steps."""
    import gspo.rollout.hf as rollout_mod

    torch.manual_seed(0)
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=3) if arch == "qwen3" else \
        build_arch(arch, len(tok), tok).eval()
    eos = tok.convert_tokens_to_ids(list("abcdefgh"))  # several "EOS" ids: rows end at varied steps
    outs, caches = {}, []
    real = rollout_mod._preallocated_cache
    monkeypatch.setattr(rollout_mod, "_preallocated_cache", lambda *a: caches.append(real(*a)) or caches[-1])
    for pre in (True, False):
        monkeypatch.setattr(rollout_mod, "PREALLOCATE_CACHE", pre)
        torch.manual_seed(1)
        outs[pre] = HFGenerator(m, tok, max_new_tokens=12, temperature=1.3, eos_token_ids=eos).generate(PROMPTS, 6)
    assert set(outs[True].finish_reason) == {"eos", "length"}
    assert torch.equal(outs[True].completion_ids, outs[False].completion_ids)
    torch.testing.assert_close(outs[True].sampler_logp, outs[False].sampler_logp, rtol=0, atol=1e-6)
    assert caches and all(type(x).__name__ == "BufferLayer" for x in caches[0].layers)


def test_distinct_prompts_in_any_order_keep_their_own_cache(tok, model):
    """Every prompt distinct (a multi-turn episode's contexts, group_size=1) and not in sorted
    order: each row decodes from its own prompt's keys and values (the prefill's cache holds the
    distinct prompts in sorted order and must be put back in the rows' order even when nothing
    is shared), so the sampler's log-probs are the trainer's at every step."""
    prompts = ["user: 9+9=", "1+2=", "user: 5*5=\nassistant: ", "3+4="]  # not in sorted order
    torch.manual_seed(0)
    r = HFGenerator(model, tok, max_new_tokens=8, temperature=1.0).generate(prompts, 1)
    with torch.no_grad():
        lp = token_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1])
    torch.testing.assert_close(r.sampler_logp, lp, rtol=0, atol=1e-5)
