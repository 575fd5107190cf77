"""The path a user's own checkpoint takes, on models written with save_pretrained and loaded
through the CLI's own code (`gspo.cli.main`, `gspo.train.run.build_policy`): the BOS in every pass,
the mode of every pass, ragged reward columns, reward files found by path. Each test here failed
before the fix it guards (issue 14)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from artifacts import plain_rows, write_jsonl, write_plain_jsonl
from gspo.rollout.hf import HFGenerator
from gspo.models import logprobs
from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.data import encode_texts, format_prompt, prompt_token_count

SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "schedule.rollouts=1",
         "schedule.num_minibatches=2", "logging.console=false", "data.num_prompts=16",          "eval.num_prompts=4", "schedule.skip_zero_advantage=false"]


def train(tmp_path: Path, model_dir: Path, *extra: str, name: str = "run") -> Path:
    rc = main(["train", f"model.name_or_path={model_dir}", *SMALL, f"output.dir={tmp_path}",
               f"output.name={name}", *extra])
    assert rc == 0
    return tmp_path / name


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- BOS


def _expected_prompt_ids(tok, text: str, chat: bool) -> list[int]:
    """Written out per style: a Llama/Gemma/Mistral tokenizer puts its BOS before plain text;
    a rendered chat template already starts with the BOS it wrote; Qwen and GPT-2 add nothing."""
    bare = tok(text, add_special_tokens=False)["input_ids"]
    adds_bos = tok.bos_token_id is not None and tok.bos_token_id != tok.eos_token_id  # (GPT-2: bos == eos, unused)
    return bare if chat or not adds_bos else [tok.bos_token_id] + bare


@pytest.mark.parametrize("family,chat", [("llama", False), ("llama", True), ("gemma2", False), ("gemma2", True),
                                         ("mistral", True), ("qwen3", False), ("gpt2", False)])
def test_bos_is_in_sampled_trained_and_evaluated_prompt_ids_exactly_once(tmp_path, saved, monkeypatch, family, chat):
    from transformers import AutoTokenizer

    model_dir = saved(family)
    tok = AutoTokenizer.from_pretrained(model_dir)
    seen: dict[str, list[list[int]]] = {"sampled": [], "trained": [], "evaluated": []}

    def real(ids, mask):  # the unpadded rows
        return [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(ids.tolist(), mask.tolist())]

    gen = HFGenerator.generate

    def spy_generate(self, prompts, group_size, **kw):
        ro = gen(self, prompts, group_size, **kw)
        if group_size > 1 or not seen["sampled"]:
            seen["sampled"] += real(ro.prompt_ids, ro.prompt_mask)
        return ro

    fwd = logprobs.LogprobModule.forward

    def spy_forward(self, input_ids, attention_mask, completion_len, *rest):
        P = input_ids.shape[1] - completion_len
        seen["trained"] += real(input_ids[:, :P], attention_mask[:, :P])
        return fwd(self, input_ids, attention_mask, completion_len, *rest)

    import transformers

    hf_generate = transformers.GenerationMixin.generate

    def spy_hf_generate(self, input_ids=None, attention_mask=None, **kw):
        seen["evaluated"] += real(input_ids, attention_mask)
        return hf_generate(self, input_ids=input_ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(HFGenerator, "generate", spy_generate)
    monkeypatch.setattr(logprobs.LogprobModule, "forward", spy_forward)
    monkeypatch.setattr(transformers.GenerationMixin, "generate", spy_hf_generate)
    extra = ["rollout.old_logp=trainer"]  # a pi_old pass over every row as well as the update's
    if chat:
        data = tmp_path / "chat.jsonl"
        write_jsonl(data, [{"messages": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)}
                           for i in range(8)])
        extra += [f"data.source={data}", "data.prompt_column=messages", f"data.eval_source={data}"]
    train(tmp_path, model_dir, *extra)

    rows = ([{"prompt": [{"role": "user", "content": f"{i}+{i}="}]} for i in range(8)] if chat else
            [{"prompt": f"{a}+{b}="} for a in range(100) for b in range(100)])
    expected = {tuple(_expected_prompt_ids(tok, format_prompt(r["prompt"], tok), chat)) for r in rows}
    for stage, ids in seen.items():
        assert ids, stage
        for row in ids:
            assert tuple(row) in expected, (stage, tok.convert_ids_to_tokens(row))
            if tok.bos_token_id is not None and tok.bos_token_id != tok.eos_token_id:
                assert row.count(tok.bos_token_id) == 1 and row[0] == tok.bos_token_id, (stage, row)
    # start-up filtering counts the prompt as the policy sees it
    assert prompt_token_count(rows[0]["prompt"], tok) == len(_expected_prompt_ids(
        tok, format_prompt(rows[0]["prompt"], tok), chat))


def test_encode_texts_keeps_a_bos_written_by_the_text_and_drops_an_appended_eos():
    from artifacts import build_tokenizer

    tok = build_tokenizer("llama")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    bare = tok("1+2=", add_special_tokens=False)["input_ids"]
    assert encode_texts(tok, ["1+2="]) == [[bos] + bare]
    assert encode_texts(tok, ["<s>[INST] hi [/INST]"])[0].count(bos) == 1
    tok._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])  # a tokenizer with add_eos_token
    assert encode_texts(tok, ["1+2="]) == [[bos] + bare]


# ----------------------------------------------------------------------------- modes


def _layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _saved_bytes_and_backward_calls(cfg):
    """Build the policy as `gspo train` does, run one trainer forward + backward; returns
    (bytes autograd saved for backward, decoder-layer forwards during backward)."""
    from gspo.train.run import build_policy

    model, tok = build_policy(cfg, torch.device("cpu"))
    trainer = logprobs.LogprobModule(model, temperature=1.0, chunk_size=512, share_prompt=True)
    ids = torch.randint(5, len(tok), (4, 40))
    mask = torch.ones_like(ids)
    phase = {"backward": False, "calls": 0}

    def count(*_):
        phase["calls"] += phase["backward"]

    for layer in _layers(model):  # (transformers checkpoints a layer's forward, inside its hooks: count its first child)
        next(layer.children()).register_forward_hook(count)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = trainer(ids, mask, 20).sum()
    phase["backward"] = True
    loss.backward()
    return sum(saved), phase["calls"]


def test_gradient_checkpointing_acts_on_a_loaded_checkpoint(saved):
    model_dir = saved("qwen3", num_hidden_layers=3)
    base = [f"model.name_or_path={model_dir}"]
    plain_bytes, plain_calls = _saved_bytes_and_backward_calls(load_config(None, base))
    gc_bytes, gc_calls = _saved_bytes_and_backward_calls(load_config(None, [*base, "model.gradient_checkpointing=true"]))
    assert plain_calls == 0
    assert gc_calls == 3  # every decoder layer runs again in backward
    assert gc_bytes < 0.6 * plain_bytes  # and the activations it kept for backward fell


def test_loaded_model_trains_in_eval_mode_checkpointing_layers_included(saved):
    from gspo.models import eval_mode
    from gspo.train.run import build_policy

    model_dir = saved("qwen3", attention_dropout=0.1)
    model, _ = build_policy(load_config(None, [f"model.name_or_path={model_dir}", "model.gradient_checkpointing=true",
                                               "lora.enabled=true"]), torch.device("cpu"))
    training = lambda: {m for m in model.modules() if m.training}  # noqa: E731
    assert _layers(model) and all(m.gradient_checkpointing is True for m in _layers(model))
    assert not training()  # (the layers still recompute: test_gradient_checkpointing_acts_on_a_loaded_checkpoint)
    ids = torch.randint(5, 50, (2, 12))
    logprobs.token_logprobs(model, ids, torch.ones_like(ids), 6).sum().backward()
    assert not training()  # not after a checkpointed forward + backward either
    with eval_mode(model):
        assert not training()
    assert not training()
    model, _ = build_policy(load_config(None, [f"model.name_or_path={model_dir}", "model.dropout=true"]),
                            torch.device("cpu"))
    assert all(m.training for m in model.modules())


def test_checkpointed_layers_with_a_dropout_of_their_own_run_without_it(tmp_path, saved):
    """OPT's decoder layer applies its dropout (0.1 in the checkpoint) itself, by its own training
    flag, which transformers also reads to decide to checkpoint the layer: under
    model.gradient_checkpointing the trainer's log-probs (pi_old, no grad; pi_theta, with grad)
    are the sampler's, and the gradient is the one without checkpointing. A deep copy of the
    policy (the KL reference) runs its own layers."""
    import copy

    from gspo.train.run import build_policy

    model_dir = saved("opt")
    run_dir = train(tmp_path, model_dir, "model.gradient_checkpointing=true", "rollout.old_logp=trainer",
                    "eval.enabled=false")
    first = records(run_dir)[0]
    assert first["mismatch/token_abs_max"] < 1e-5  # the pi_old pass ran no dropout
    assert abs(first["ratio/seq_min"] - 1) < 1e-6 and abs(first["ratio/seq_max"] - 1) < 1e-6  # nor the update

    cfg = [f"model.name_or_path={model_dir}"]
    plain, _ = build_policy(load_config(None, cfg), torch.device("cpu"))
    checkpointed, _ = build_policy(load_config(None, [*cfg, "model.gradient_checkpointing=true"]), torch.device("cpu"))
    ids = torch.randint(5, 50, (3, 16))
    grads = []
    for model in (plain, checkpointed):
        lp = logprobs.token_logprobs(model, ids, torch.ones_like(ids), 8)
        lp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    reference = copy.deepcopy(checkpointed)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
        assert not torch.allclose(logprobs.token_logprobs(reference, ids, torch.ones_like(ids), 8),
                                  logprobs.token_logprobs(checkpointed, ids, torch.ones_like(ids), 8))


@pytest.mark.parametrize("family,extra", [("qwen3", ["lora.enabled=true", "lora.r=4"]), ("gpt2", [])])
def test_dropout_in_the_config_leaves_the_on_policy_ratio_at_one(tmp_path, saved, family, extra):
    """Qwen3 with attention_dropout=0.1 under LoRA (the peft wrapper starts in training mode),
    GPT-2 with its own 0.1 dropouts: pi_theta on the first minibatch of every rollout is the
    sampler's pi_old exactly as far as float rounding goes, so no sequence is clipped there."""
    model_dir = saved(family, **({"attention_dropout": 0.1} if family == "qwen3" else {}))
    run_dir = train(tmp_path, model_dir, "schedule.rollouts=2", "eval.enabled=false", "optim.lr=1e-3", *extra)
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for first in recs[0::2]:  # the first minibatch of each rollout
        assert first["mismatch/token_abs_max"] < 1e-5
        assert abs(first["ratio/seq_min"] - 1) < 1e-6 and abs(first["ratio/seq_max"] - 1) < 1e-6
        assert first["clip/seq_frac"] == 0


def test_lora_dropout_without_model_dropout_is_refused():
    with pytest.raises(ConfigError, match="lora.dropout"):
        load_config(None, ["lora.enabled=true", "lora.dropout=0.1"])
    load_config(None, ["lora.enabled=true", "lora.dropout=0.1", "model.dropout=true"])


# ----------------------------------------------------------------------------- rewards


RECORDER = textwrap.dedent('''
    import json, os

    def record(prompts, completions, **columns):
        """Writes the columns it was handed (one file per call), scores by completion length."""
        out = os.environ["GSPO_TEST_COLUMNS"]
        with open(out, "a") as f:
            f.write(json.dumps({k: v for k, v in columns.items() if k != "trainer_state"}) + "\\n")
        return [len(c) % 3 / 2 for c in completions]
''')


def _columns_seen(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_reward_file_in_the_working_directory_gets_every_column_of_every_row(tmp_path, saved, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_rewards.py").write_text(RECORDER)
    data = write_plain_jsonl(work / "data.jsonl", n=4)  # 'level' missing from row 0, 'source' from row 3
    monkeypatch.chdir(work)
    monkeypatch.setenv("GSPO_TEST_COLUMNS", str(tmp_path / "cols.jsonl"))
    train(tmp_path, saved("qwen3"), f"data.source={data}", "data.shuffle=false", "rollout.prompts_per_step=4",
          "eval.enabled=false", 'rewards.functions=[{name: "my_rewards:record"}]')
    (call,) = _columns_seen(tmp_path / "cols.jsonl")
    G = 2
    assert call["level"] == [None] * G + [2] * G + [3] * G + [1] * G  # row 0 lacks it: None there, kept elsewhere
    assert call["source"] == ["synthetic"] * (3 * G) + [None] * G  # row 3 lacks it
    assert call["answer"] == [a for a in ["11", "14", "17", "20"] for _ in range(G)]


def test_reward_files_beside_the_config_and_by_path(tmp_path, saved, monkeypatch):
    conf_dir, work = tmp_path / "conf", tmp_path / "elsewhere"
    (conf_dir / "lib").mkdir(parents=True)
    work.mkdir()
    (conf_dir / "beside.py").write_text(RECORDER)
    (conf_dir / "lib" / "by_path.py").write_text(RECORDER.replace("def record", "def score"))
    write_plain_jsonl(conf_dir / "data.jsonl", n=8)
    cfg_file = conf_dir / "run.yaml"
    cfg_file.write_text(textwrap.dedent("""
        data: {source: data.jsonl}
        rewards:
          functions:
            - {name: "beside:record", weight: 0.5}
            - {name: "lib/by_path.py:score", weight: 0.5}
    """))
    monkeypatch.chdir(work)
    monkeypatch.setenv("GSPO_TEST_COLUMNS", str(tmp_path / "cols.jsonl"))
    cfg = load_config(cfg_file, [])
    assert [f.name for f in cfg.rewards.functions] == [f"{(conf_dir / 'beside.py').resolve()}:record",
                                                       f"{(conf_dir / 'lib' / 'by_path.py').resolve()}:score"]
    assert cfg.data.source == str((conf_dir / "data.jsonl").resolve())  # data beside the config too
    rc = main(["train", str(cfg_file), f"model.name_or_path={saved('qwen3')}", *SMALL, "eval.enabled=false",
               f"output.dir={tmp_path}", "output.name=run"])
    assert rc == 0
    assert len(_columns_seen(tmp_path / "cols.jsonl")) == 2  # both functions ran
    rec = records(tmp_path / "run")[0]
    assert "reward/record/mean" in rec and "reward/score/mean" in rec


def test_a_runs_config_means_the_same_from_another_directory_and_gspo_eval_takes_the_data_named(
        tmp_path, saved, monkeypatch, capsys):
    """The model, data and reward module found from the working directory are written to
    RUN/config.yaml as absolute paths, so that `gspo eval RUN/final --config RUN/config.yaml`
    works from anywhere (it said 'dataset path ... does not exist'); it reads the held-out data
    alone, and a dataset named on its command line is the one evaluated (the config's
    data.eval_source was taken instead)."""
    import shutil

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    shutil.copytree(saved("qwen3"), work / "ckpt")
    (work / "anchored_rewards.py").write_text(RECORDER)  # (a name no other test imports)
    write_plain_jsonl(work / "train.jsonl", n=8)
    write_jsonl(work / "held.jsonl", [dict(r, tag="held") for r in plain_rows(4)])
    write_jsonl(work / "other.jsonl", [dict(r, tag="other") for r in plain_rows(4)])
    cols = tmp_path / "cols.jsonl"
    monkeypatch.setenv("GSPO_TEST_COLUMNS", str(cols))
    monkeypatch.chdir(work)
    assert main(["train", "model.name_or_path=ckpt", *SMALL, "data.source=train.jsonl", "data.eval_source=held.jsonl",
                 "eval.enabled=false", 'rewards.functions=[{name: "anchored_rewards:record"}]', f"output.dir={tmp_path}",
                 "output.name=run"]) == 0
    run = tmp_path / "run"
    stored = load_config(run / "config.yaml", [])
    assert stored.model.name_or_path == str((work / "ckpt").resolve())
    assert (stored.data.source, stored.data.eval_source) == (str((work / "train.jsonl").resolve()),
                                                             str((work / "held.jsonl").resolve()))
    assert stored.rewards.functions[0].name == f"{(work / 'anchored_rewards.py').resolve()}:record"
    (work / "train.jsonl").unlink()  # evaluation needs the held-out data only
    monkeypatch.chdir(elsewhere)
    for data, tag in ((None, "held"), (str(work / "other.jsonl"), "other")):
        cols.unlink(missing_ok=True)
        assert main(["eval", str(run / "final"), *([data] if data else []), "--config", str(run / "config.yaml"),
                     "--num-prompts", "2"]) == 0
        assert _columns_seen(cols)[-1]["tag"] == [tag, tag]
    # the run's folder too: a resume from another directory continues it (it started a new run in
    # ./runs, without a word); one that has nothing to do leaves its config.yaml as it was
    assert stored.output.dir == str(tmp_path)
    write_plain_jsonl(work / "train.jsonl", n=8)
    before = (run / "config.yaml").read_text()
    assert main(["train", str(run / "config.yaml"), "resume=auto", "optim.lr=0.5"]) == 0
    assert "already finished" in capsys.readouterr().out and (run / "config.yaml").read_text() == before
    assert main(["train", str(run / "config.yaml"), "resume=auto", "schedule.rollouts=2"]) == 0
    assert "resumed from" in capsys.readouterr().out and not (elsewhere / "runs").exists()
    assert load_config(run / "config.yaml", []).schedule.rollouts == 2


def test_an_unknown_reward_file_or_module_is_one_error_naming_the_entry(tmp_path, capsys):
    for name in ("no_such_module:fn", "missing/file.py:fn"):
        rc = main(["train", *SMALL, f"output.dir={tmp_path}", "output.name=bad",
                   f'rewards.functions=[{{name: exact_answer}}, {{name: "{name}"}}]'])
        assert rc == 2
        err = capsys.readouterr().err
        assert "rewards.functions[1].name" in err and name.split(":")[0] in err, err
        assert not (tmp_path / "bad" / "config.yaml").exists()  # stopped before any model loaded


def test_the_gspo_console_script_finds_a_reward_file_in_the_working_directory(tmp_path, saved):
    """As a user runs it: the `gspo` console script (whose sys.path holds its bin folder, not the
    working directory, unlike `python -m`), from the folder that holds my_rewards.py."""
    import os
    import subprocess
    import sys

    script = Path(sys.executable).parent / "gspo"
    if not script.exists():
        pytest.skip("no gspo console script beside this interpreter")
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_rewards.py").write_text(RECORDER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["GSPO_TEST_COLUMNS"] = str(tmp_path / "cols.jsonl")
    p = subprocess.run([str(script), "train", f"model.name_or_path={saved('qwen3')}", *SMALL, "eval.enabled=false",
                        f"output.dir={tmp_path}", "output.name=run", 'rewards.functions=[{name: "my_rewards:record"}]'],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(_columns_seen(tmp_path / "cols.jsonl")) == 1 and records(tmp_path / "run")[0]["reward/record/mean"] >= 0


def test_too_few_prompts_for_one_rollout_is_one_error_before_the_model_loads(tmp_path, capsys):
    """A dataset with fewer rows than rollout.prompts_per_step stops at start-up naming the file
    and the field; so does one whose rows mostly run past data.max_prompt_tokens (after the
    tokenizer, which counts them, has loaded)."""
    data = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    rc = main(["train", *SMALL, f"data.source={data}", "rollout.prompts_per_step=2", f"output.dir={tmp_path}",
               "output.name=bad", "model.name_or_path=/nonexistent/model"])
    err = capsys.readouterr().err
    assert rc == 2 and "one.jsonl: 1 prompts, fewer than one rollout's rollout.prompts_per_step=2" in err, err
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1+1=", "answer": "2"}] + [{"prompt": "9" * 80}] * 3)
    rc = main(["train", *SMALL, f"data.source={long}", "rollout.prompts_per_step=2", "data.max_prompt_tokens=16",
               f"output.dir={tmp_path}", "output.name=long"])
    err = capsys.readouterr().err
    assert rc == 2 and "1 prompts of 16 tokens or fewer (data.max_prompt_tokens=16), fewer than" in err, err


def test_a_model_with_a_cache_class_of_its_own_is_sent_to_generate(tmp_path, saved, capsys):
    """MiniMax-Text keeps its linear-attention state in a cache class of its own: gspo's decode loop
    is refused at start-up with the setting that works, and transformers' generate then samples.
    The trainer's calls run every row whole (no shared prompt), and pi_old is a trainer pass (a
    MoE whose routes the sampler does not record), so the first minibatch is on-policy; the
    sampler's gap on left-padded rows (transformers' lightning attention, ~1e-3) is logged."""
    model_dir = saved("minimax")
    capsys.readouterr()
    assert main(["train", f"model.name_or_path={model_dir}", *SMALL, f"output.dir={tmp_path}", "output.name=a"]) == 2
    err = capsys.readouterr().err
    assert "'rollout.decode'" in err and "rollout.decode=generate" in err and "Traceback" not in err
    run_dir = train(tmp_path, model_dir, "rollout.decode=generate", "model.share_prompt_min_work=0",
                    "eval.enabled=false", name="b")
    first = next(r for r in records(run_dir) if "loss" in r)
    assert first["mismatch/token_abs_max"] < 1e-2
    assert abs(first["ratio/seq_min"] - 1) < 1e-6 and abs(first["ratio/seq_max"] - 1) < 1e-6


def test_a_chat_prompt_that_ends_with_an_assistant_turn_is_continued_as_trl_does(tmp_path, saved, monkeypatch, capsys):
    """The last assistant turn is rendered open (continue_final_message, no new generation
    prompt: it used to be closed and followed by a second assistant turn, so an answer in the
    data sat in the context); reward functions get the prompt without it and the whole turn."""
    from transformers import AutoTokenizer

    from gspo.data import reward_view

    model = saved("qwen3")
    tok = AutoTokenizer.from_pretrained(model)
    msgs = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "The answer is"}]
    text = format_prompt(msgs, tok)
    assert text == tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert text.endswith("The answer is") and text.count("<|im_start|>assistant") == 1
    assert reward_view(msgs, " 4") == (msgs[:1], [{"role": "assistant", "content": "The answer is 4"}])
    assert reward_view(msgs[:1], "4") == (msgs[:1], [{"role": "assistant", "content": "4"}])
    assert reward_view("2+2=", "4") == ("2+2=", "4")
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": "Sum:"}],
             "answer": str(i + 1)} for i in range(4)]
    data = write_jsonl(tmp_path / "prefill.jsonl", rows)
    (tmp_path / "seen_rewards.py").write_text(textwrap.dedent('''
        import json, os

        def seen(prompts, completions, **kw):
            with open(os.environ["GSPO_TEST_SEEN"], "a") as f:
                f.write(json.dumps({"prompts": prompts, "completions": completions}) + "\\n")
            return [1.0] * len(completions)
    '''))
    monkeypatch.setenv("GSPO_TEST_SEEN", str(tmp_path / "seen.jsonl"))
    train(tmp_path, model, f"data.source={data}", "eval.enabled=false",
          f'rewards.functions=[{{name: "{tmp_path / "seen_rewards.py"}:seen"}}]')
    assert "4 of 4 prompts (data.source" in capsys.readouterr().err
    call = json.loads((tmp_path / "seen.jsonl").read_text().splitlines()[0])
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in call["prompts"])
    assert all(c[0]["role"] == "assistant" and c[0]["content"].startswith("Sum:") for c in call["completions"])


def test_a_column_named_like_a_built_in_rewards_option_is_refused_at_start_up(tmp_path, saved, capsys):
    """A `pattern` column reached `format` as its pattern (a list) and the run stopped after the
    first rollout's sampling; code_tests' limits (memory_mb, timeout_s) could be raised by data."""
    rows = [dict(r, pattern="x") for r in plain_rows(8)]
    data = write_jsonl(tmp_path / "pattern.jsonl", rows)
    rc = main(["train", f"model.name_or_path={saved('qwen3')}", *SMALL, f"output.dir={tmp_path}", "output.name=p",
               f"data.source={data}", "rewards.functions=[{name: format}]"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"data.source {data}: column 'pattern' has the name of an option of the reward 'format'" in err
    assert not (tmp_path / "p" / "config.yaml").exists()  # before the model loaded
