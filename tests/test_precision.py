"""rollout.mixed_precision=bf16 | fp16: the sampler runs under autocast over the fp32 weights
while the trainer stays fp32, so the sampler's log-probs are near the trainer's but not equal,
and `rollout.old_logp=auto` then recomputes π_old with the trainer's own pass."""

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.models.logprobs import token_logprobs
from gspo.models.tiny import build_char_tokenizer, build_tiny_model
from gspo.train.run import hf_generator, resolve_old_logp

PROMPTS = [f"user: {a}+{b}=\nassistant: " for a in range(4) for b in range(4)]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden_size=128, num_layers=2, seed=5)  # the demo's shape


def sampler_gap(model, tok, precision: str) -> tuple[torch.Tensor, set]:
    """|sampler_logp − fp32 trainer logp| on every completion token, through the library's own
    `hf_generator`; and the dtypes the model's linear layers computed in while sampling."""
    over = [] if precision == "no" else [f"rollout.mixed_precision={precision}"]
    cfg = load_config(None, [*over, "rollout.max_new_tokens=12", "rollout.temperature=1.0"])
    dtypes = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: dtypes.add(out.dtype))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        r = hf_generator(cfg, model, tok).generate(PROMPTS, 4, seed=0)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        fp32 = token_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1], temperature=1.0)
    return (r.sampler_logp - fp32)[r.completion_mask.bool()].abs(), dtypes


def test_half_precision_samplers_differ_from_the_fp32_trainer_by_a_small_nonzero_gap(model, tok):
    """Measured on this model (hidden 128, 2 layers, 192 completions of <= 12 tokens): fp32
    ~1e-6 max (rounding); fp16 ~8e-4 max / 1.4e-4 mean; bf16 ~7e-3 max / 1.2e-3 mean. fp16 has
    10 mantissa bits to bf16's 7, so its gap is ~8x (2^3) smaller."""
    fp32, d32 = sampler_gap(model, tok, "no")
    fp16, d16 = sampler_gap(model, tok, "fp16")
    bf16, db16 = sampler_gap(model, tok, "bf16")
    assert d32 == {torch.float32} and d16 == {torch.float16} and db16 == {torch.bfloat16}  # autocast acted
    assert fp32.max() < 1e-5
    for gap in (fp16, bf16):
        assert 1e-5 < gap.max() < 0.1 and gap.mean() < 1e-2  # nonzero, and small
        assert gap.mean() > 10 * fp32.mean()  # more than the fp32 sampler's rounding
    assert fp16.mean() < bf16.mean() / 2 and fp16.max() < bf16.max()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay fp32


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_old_logp_auto_recomputes_pi_old_for_a_half_precision_sampler(precision):
    cfg = load_config(None, [f"rollout.mixed_precision={precision}"])
    assert resolve_old_logp(cfg, has_routers=False) == "trainer"  # not the trainer's numbers
    assert resolve_old_logp(load_config(None, []), has_routers=False) == "sampler"  # fp32: they are
    sampler = load_config(None, [f"rollout.mixed_precision={precision}", "rollout.old_logp=sampler"])
    assert resolve_old_logp(sampler, has_routers=False) == "sampler"  # asked for: paper section 5.4


@pytest.mark.parametrize("overrides", [
    ["rollout.mixed_precision=fp8"],
    ["rollout.mixed_precision=float16"],
    ["rollout.mixed_precision=fp16", "rollout.backend=vllm"],      # vLLM's precision is vllm.dtype
    ["rollout.mixed_precision=fp16", "model.dtype=bfloat16"],      # autocast needs fp32 weights
])
def test_invalid_sampler_precision_names_the_field(overrides):
    with pytest.raises(ConfigError, match="config field 'rollout.mixed_precision'"):
        load_config(None, overrides)


def test_a_bare_no_is_no_on_the_command_line_and_in_yaml(tmp_path):
    """YAML reads `no` as false; the mixed-precision settings take it as the value "no"."""
    from gspo.config import load_config

    cfg = load_config(None, ["rollout.mixed_precision=no", "model.mixed_precision=no"])
    assert (cfg.rollout.mixed_precision, cfg.model.mixed_precision) == ("no", "no")
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  mixed_precision: no\nrollout:\n  mixed_precision: no\n")
    cfg = load_config(f)
    assert (cfg.rollout.mixed_precision, cfg.model.mixed_precision) == ("no", "no")


# ----------------------------------------------------------------------------- half precision's speed


def test_half_precision_warnings_name_each_slow_setting_and_its_fix(monkeypatch):
    """On a CPU that emulates bf16 / fp16 (measured ~25x slower than fp32 on an AVX2 EPYC) every
    setting that asks for it gets one line naming the field and the value that avoids it; fp32
    settings, GPUs and CPUs with a matrix unit (slowdown < 2) get none."""
    import gspo.models as models

    slow = {torch.bfloat16: 25.0, torch.float16: 1.5}
    monkeypatch.setattr(models, "half_matmul_slowdown", lambda device_type, dtype: slow[dtype])
    settings = {"model.dtype": "bfloat16", "model.mixed_precision": "bf16", "rollout.mixed_precision": "fp16"}
    lines = models.half_precision_warnings(settings, torch.device("cpu"))
    assert len(lines) == 2  # fp16 at 1.5x is not worth a line
    assert lines[0].startswith("model.dtype=bfloat16: bfloat16 matrix products run 25x slower")
    assert lines[0].endswith("set model.dtype=float32")
    assert lines[1].startswith("model.mixed_precision=bf16: bf16") and lines[1].endswith("set model.mixed_precision=no")
    fp32 = {"model.dtype": "float32", "model.mixed_precision": "no", "rollout.mixed_precision": "no"}
    assert models.half_precision_warnings(fp32, torch.device("cpu")) == []


def test_the_slowdown_is_measured_on_the_cpu_only():
    from gspo.models import half_matmul_slowdown

    assert half_matmul_slowdown("cuda", torch.bfloat16) == 1.0 and half_matmul_slowdown("cpu", torch.float32) == 1.0
    assert 0 < half_matmul_slowdown("cpu", torch.bfloat16) < float("inf")


def test_a_run_asking_for_slow_bf16_says_so_before_it_trains(tmp_path, monkeypatch, capsys):
    import gspo.models as models
    from gspo.train.run import build_run

    monkeypatch.setattr(models, "half_matmul_slowdown", lambda device_type, dtype: 30.0)
    tiny = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=8", "rollout.prompts_per_step=4",
            "rollout.group_size=2", "rollout.max_new_tokens=4", f"output.dir={tmp_path}"]
    build_run(load_config(None, [*tiny, "model.mixed_precision=bf16"]))
    err = capsys.readouterr().err
    assert "warning: model.mixed_precision=bf16: bf16 matrix products run 30x slower than float32" in err
    build_run(load_config(None, [*tiny, "output.name=fp32"]))
    assert "slower than float32" not in capsys.readouterr().err


def test_float16_weights_are_refused_for_training_and_bfloat16_weights_get_a_warning():
    """A probe trained model.dtype=float16 weights with AdamW: they moved by up to 0.95 in 8 steps
    at lr 1e-6 (weights ~0.02) and the run exited 0; bfloat16 weights changed in 1.4% of their
    elements, the rest of each update rounded away, without a word."""
    from gspo.train.run import weight_dtype_notes

    with pytest.raises(ConfigError, match="config field 'model.dtype': float16 weights do not train here"):
        weight_dtype_notes(load_config(None, ["model.dtype=float16"]))
    (line,) = weight_dtype_notes(load_config(None, ["model.dtype=bfloat16"]))
    assert "rounded away" in line and "model.mixed_precision=bf16" in line
    for fine in (["model.dtype=float32"], ["model.dtype=float16", "lora.enabled=true"],
                 ["model.dtype=bfloat16", "lora.enabled=true"]):  # peft keeps the adapters in fp32
        assert weight_dtype_notes(load_config(None, fine)) == []
