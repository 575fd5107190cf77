"""Prompt sharing: a group's rows run their common prompt once, in the trainer's forward
(`token_logprobs(share_prompt=True)`), in the decode loop's prefill, and in the minibatch layout
that keeps groups together (`schedule.minibatch_by=group`)."""

import pytest
import torch
from archs import HYBRIDS, NAMES, build_arch

import gspo.models.logprobs
from gspo.models.logprobs import LogprobModule, naive_token_logprobs, prompt_share_plan, token_logprobs
from gspo.models import set_activation_checkpointing
from gspo.rollout.hf import decode
from gspo.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(name, tok):
    """A model in eval mode (no dropout) whose once-per-model LM-head check has run (so that it
    adds no body calls)."""
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, seed=0) if name == "qwen3" else build_arch(
        name, len(tok), tok)
    model.eval()
    with torch.no_grad():
        token_logprobs(model, torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), 1)
    return model


def _grouped_batch(vocab, k=3, G=4, p=9, t=6, seed=0):
    """k distinct left-padded prompts, each repeated G times, with completions of assorted
    lengths (one empty, one of a single token): (k*G, p+t) ids and mask."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, vocab, (k, p), generator=g)
    pmask = torch.ones_like(prompt)
    pmask[1, :3] = 0  # a shorter prompt
    pmask[2, :1] = 0
    ids = torch.cat([prompt.repeat_interleave(G, 0), torch.randint(4, vocab, (k * G, t), generator=g)], 1)
    mask = torch.cat([pmask.repeat_interleave(G, 0), torch.ones(k * G, t, dtype=torch.long)], 1)
    for i in range(k * G):
        mask[i, p + t - i % t :] = 0  # row i ends after t - i % t tokens (0 for some rows: empty)
    mask[1, p + 1 :] = 0  # a single-token completion
    return ids.masked_fill(mask == 0, 0), mask


def _body_calls(model):
    """Record the input shape of every decoder-body call."""
    calls = []
    body = gspo.models.logprobs._decoder_body(model)
    handle = body.register_forward_pre_hook(lambda m, a, kw: calls.append(tuple(kw.get("input_ids", a[0] if a else None).shape)),
                                            with_kwargs=True)
    return calls, handle


def _value_and_grad(model, ids, mask, t, **kw):
    model.zero_grad()
    fn = kw.pop("fn", token_logprobs)
    lp = fn(model, ids, mask, t, temperature=0.8, **kw)
    (lp * torch.linspace(-1, 1, t)).sum().backward()  # a non-uniform upstream gradient
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return lp.detach(), grads


@pytest.mark.parametrize("arch", ["qwen3", *NAMES])
def test_shared_prompt_equals_one_forward_in_value_and_gradient(tok, arch):
    """Each distinct prompt runs once (2 body calls: k prompts, then N completions without
    their last column), and log-probs and every parameter's gradient equal the full-logit
    reference. Sliding windows (mistral, gemma2) are shorter than the sequences."""
    model = _model(arch, tok)
    ids, mask = _grouped_batch(len(tok))
    t = 6
    calls, handle = _body_calls(model)
    try:
        ours, g_ours = _value_and_grad(model, ids, mask, t, share_prompt=True)
    finally:
        handle.remove()
    assert calls == [(3, 9), (12, t - 1)]  # 3 prompts (no column padded in all), then 12 rows x 5
    ref, g_ref = _value_and_grad(model, ids, mask, t, fn=naive_token_logprobs)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert (ours[mask[:, -t:] == 0] == 0).all()
    assert g_ours.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g_ours[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_check_fails_when_rows_see_the_wrong_prompt(tok):
    """Mutation check: expanding the prompt cache in the wrong row order must show."""
    model = _model("qwen3", tok)
    ids, mask = _grouped_batch(len(tok))
    ref = naive_token_logprobs(model, ids, mask, 6).detach()
    real = gspo.models.logprobs.prompt_groups

    def shifted(*a):
        first, inverse = real(*a)
        return first, (inverse + 1) % len(first)

    gspo.models.logprobs.prompt_groups = shifted
    try:
        with torch.no_grad():
            wrong = token_logprobs(model, ids, mask, 6, share_prompt=True)
    finally:
        gspo.models.logprobs.prompt_groups = real
    assert (wrong - ref).abs().max() > 1e-2


def test_plan_runs_each_prompt_once_only_when_it_pays(tok):
    ids, mask = _grouped_batch(len(tok))
    first, inverse, cut = prompt_share_plan(ids, mask, 6)
    assert sorted(first.tolist()) == [0, 4, 8] and first[inverse].tolist() == [0] * 4 + [4] * 4 + [8] * 4
    assert cut == 0
    distinct = ids.clone()
    distinct[:, 5] = torch.arange(12) + 4  # every prompt different
    assert prompt_share_plan(distinct, mask, 6) is None
    short = torch.cat([ids[:, 8:], ids[:, 8:].new_ones(12, 40)], 1)  # 1-token prompts, long completions
    assert prompt_share_plan(short, torch.ones_like(short), 46) is None  # saves under 1/8 of the tokens


def test_short_prompts_do_not_share_on_small_layers(tok):
    """model.share_prompt_min_work: the saved prompt tokens times one decoder layer's weights
    must reach it. A 64-wide 2-layer model (~40k weights a layer) at 3.2e7 needs ~800 saved
    tokens: 12 rows of 6-token prompts do not share, 12 rows of 200-token ones do; a wider layer
    needs fewer, and a MoE layer counts only the experts a token is routed to."""
    from gspo.models.logprobs import can_share_prompt, share_min_saved

    small = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=0)
    ids, mask = _grouped_batch(len(tok))  # 3 prompts x 4 rows, 6 completion tokens
    need = share_min_saved(small, 3.2e7)
    per_layer = sum(p.numel() for p in small.model.layers[0].parameters())
    assert need == -(-int(3.2e7) // per_layer) and 100 < need < 10_000
    assert can_share_prompt(small, ids, mask, 6) and not can_share_prompt(small, ids, mask, 6, 3.2e7)
    long_ids = torch.cat([torch.full((12, 200), 5), ids], 1)  # a 200-token instruction before each prompt
    long_mask = torch.cat([torch.ones(12, 200, dtype=mask.dtype), mask], 1)
    assert can_share_prompt(small, long_ids, long_mask, 6, 3.2e7)
    wide = build_tiny_model(tok, hidden_size=256, num_layers=2, seed=0)
    assert share_min_saved(wide, 3.2e7) * 4 < need  # ~8x the weights a layer (its MLP stays 128 wide)
    moe = build_tiny_model(tok, hidden_size=64, num_layers=2, moe=True, num_experts=8, num_experts_per_tok=2, seed=0)
    layer = moe.model.layers[0]
    experts = sum(p.numel() for n, p in layer.named_parameters() if "experts." in n)
    assert experts and share_min_saved(moe, 3.2e7) == -(-int(3.2e7) // int(
        sum(p.numel() for p in layer.parameters()) - experts * 3 / 4))


@pytest.mark.parametrize("case", ["distinct", "one-token", "checkpointing"])
def test_falls_back_or_skips_the_second_call(tok, case):
    """Distinct prompts and gradient checkpointing: one forward over [prompt | completion];
    one-token completions: the prompt call alone. The same numbers every time."""
    model = _model("qwen3", tok)
    t = 1 if case == "one-token" else 6
    ids, mask = _grouped_batch(len(tok), t=t)
    if case == "distinct":
        ids[:, 5] = torch.arange(len(ids)) + 4
    ref = naive_token_logprobs(model, ids, mask, t).detach()
    if case == "checkpointing":
        set_activation_checkpointing(model, True)
        model.train()
    calls, handle = _body_calls(model)
    try:
        lp = token_logprobs(model, ids, mask, t, share_prompt=True)
        lp.sum().backward()
    finally:
        handle.remove()
        set_activation_checkpointing(model, False)
        model.eval()
    torch.testing.assert_close(lp.detach(), ref, rtol=0, atol=1e-5)
    one = (ids.shape[0], ids.shape[1] - 1)  # one forward: every column but the last (it predicts nothing)
    assert calls == ([(3, 9)] if case == "one-token" else [one])


def test_a_decision_made_beforehand_is_followed(tok):
    """Under FSDP2 the rollout's plan decides for every forward, with every process, whether it
    shares (gspo.train.plan; tests/test_plan.py): the forward follows that decision, and with
    none it decides from its own rows (`can_share_prompt`)."""
    from gspo.models.logprobs import can_share_prompt

    model = _model("qwen3", tok)
    ids, mask = _grouped_batch(len(tok))
    assert can_share_prompt(model, ids, mask, 6)
    calls, handle = _body_calls(model)
    try:
        with torch.no_grad():
            LogprobModule(model, share_prompt=True)(ids, mask, 6, False)  # another process cannot share
            LogprobModule(model, share_prompt=True)(ids, mask, 6, True)
            LogprobModule(model, share_prompt=True)(ids, mask, 6)
    finally:
        handle.remove()
    assert calls == [(12, 14), (3, 9), (12, 5), (3, 9), (12, 5)]  # single forwards skip the last column


def test_logprob_module_passes_it_on(tok):
    model = _model("qwen3", tok)
    ids, mask = _grouped_batch(len(tok))
    calls, handle = _body_calls(model)
    try:
        with torch.no_grad():
            LogprobModule(model, share_prompt=True)(ids, mask, 6)
            LogprobModule(model, share_prompt=False)(ids, mask, 6)
    finally:
        handle.remove()
    assert calls == [(3, 9), (12, 5), (12, 14)]
    assert ids.shape == (12, 15)


def test_decode_prefills_each_prompt_once(tok, monkeypatch):
    """The prefill runs the distinct prompts and copies their cache to every row: the same
    samples and log-probs as a prefill of every row."""
    model = _model("qwen3", tok).eval()
    ids, mask = _grouped_batch(len(tok))
    ids, mask = ids[:, :9], mask[:, :9]  # the prompts
    calls, handle = _body_calls(model)

    def run():
        torch.manual_seed(3)
        with torch.no_grad():
            return decode(model, ids, mask, max_new_tokens=5, eos_token_ids=[1], pad_token_id=0)

    try:
        shared = run()
        prefill = calls[0]
        monkeypatch.setattr(gspo.models.logprobs, "prompt_groups",
                            lambda i, m, p: (torch.arange(len(i)), torch.arange(len(i))))
        calls.clear()
        every = run()
    finally:
        handle.remove()
    assert prefill == (3, 9) and calls[0] == (12, 9)
    assert torch.equal(shared[0], every[0])
    torch.testing.assert_close(shared[1], every[1], rtol=0, atol=1e-5)


def test_trainer_shares_unless_told_not_to(tmp_path):
    """On by default, MoE models that record routes included (the route record follows the split
    forward: tests/test_routing.py)."""
    from gspo.config import load_config
    from gspo.train.run import build_run

    base = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=8",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.enabled=false", "logging.console=false",
            f"output.dir={tmp_path}"]
    for extra, expected in ([[], True], [["model.share_prompt=false"], False], [["tiny.moe=true"], True]):
        ctx = build_run(load_config(None, [*base, *extra, f"output.name=r{len(extra)}{expected}"]))
        try:
            assert ctx.trainer.share_prompt is expected, extra
            assert (ctx.routes is not None) == ("tiny.moe=true" in extra)
        finally:
            ctx.close()


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_model_runs_every_row_whole_in_the_trainer(tok, name):
    """A cache layer with a recurrent state (a linear-attention or state-space mixer, alone or
    beside keys and values) is not shared: the trainer's call runs every row whole, with the
    numbers and the gradient of the plain forward (sharing used to raise on Falcon-H1, whose
    layers hold both kinds of state)."""
    model = _model(name, tok)
    ids, mask = _grouped_batch(len(tok))
    t = 6
    assert gspo.models.logprobs._share_plan(model, ids, mask, t) is None
    shared = token_logprobs(model, ids, mask, t, share_prompt=True, decided=None)
    shared.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = naive_token_logprobs(model, ids, mask, t)
    plain.sum().backward()
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
