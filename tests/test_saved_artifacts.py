"""Checkpoints as users bring them: tiny models of six families and tokenizers in each family's
style, saved with ``save_pretrained`` (tests/artifacts.py) and run through the CLI's own path:
`gspo train model.name_or_path=DIR`, its final/ reloaded by transformers, `gspo eval` on it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import artifacts
from gspo.train.checkpoint import load_model_state
from gspo.cli import main
from gspo.config import load_config
from gspo.train.evaluate import greedy_completions
from gspo.models import eos_token_ids, load_policy
from gspo.data import format_prompt
from gspo.train.run import build_run

RUN = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "schedule.rollouts=1",
       "schedule.num_minibatches=2", "eval.enabled=true", "eval.num_prompts=4",        "logging.console=false"]
# exact_answer first (eval accuracy), then a reward that tells random completions apart, so
# the update passes have rows with a nonzero advantage to run
REWARDS = "rewards.functions=[{name: exact_answer}, {name: 'artifacts:signal_reward'}]"
# the family's checkpoint as saved, with overrides (GPT-2's config has dropout 0.1 of its own)
OVERRIDES = {"llama": {"attention_dropout": 0.1}}


def train(model_dir: Path, out: Path, *extra: str) -> Path:
    rc = main(["train", f"model.name_or_path={model_dir}", *RUN, REWARDS, f"output.dir={out}", "output.name=x", *extra])
    assert rc == 0
    return out / "x"


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cli_eval(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["eval", *map(str, args)]) == 0
    return json.loads(capsys.readouterr().out)


def logits(model, tok) -> torch.Tensor:
    enc = tok(["12+7=", "3*4-5="], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**enc).logits


# ----------------------------------------------------------------------------- the CLI on each family


@pytest.mark.parametrize("family", artifacts.FAMILIES)
def test_train_and_eval_a_saved_checkpoint(family, saved, tmp_path, capsys):
    src = saved(family, **OVERRIDES.get(family, {}))
    run_dir = train(src, tmp_path, "data.source=arithmetic")
    recs = records(run_dir)
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert "eval/accuracy" in recs[0] and "eval/accuracy" in recs[-1]
    # the sampler's log-probs (pi_old here, dense fp32) are the trainer's own numbers on the
    # loaded checkpoint (BOS, soft-capping, sliding windows, GQA, dropout switched off) ...
    assert steps[0]["mismatch/token_abs_max"] < 1e-4
    # ... so the first, on-policy minibatch has ratios of exactly 1
    if steps[0]["ratio/seq_min"] is not None:
        assert steps[0]["ratio/seq_min"] == pytest.approx(1.0, abs=1e-5)
        assert steps[0]["ratio/seq_max"] == pytest.approx(1.0, abs=1e-5)

    final = run_dir / "final"
    model, tok = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    source_model, source_tok = AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src)
    # the tokenizer comes back as it was: same ids (BOS included), template and EOS ids
    assert tok("12+7=")["input_ids"] == source_tok("12+7=")["input_ids"]
    assert tok.chat_template == source_tok.chat_template
    assert eos_token_ids(model, tok) == eos_token_ids(source_model, source_tok)
    # ... and so do its pad token, padding side and generation-config pad id: gspo's own sampling
    # choices (EOS as pad, left padding) were written into final/ (pad = EOS hides every EOS
    # from a later supervised run's loss)
    assert (tok.pad_token, tok.padding_side) == (source_tok.pad_token, source_tok.padding_side)
    assert model.generation_config.pad_token_id == source_model.generation_config.pad_token_id
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    before = logits(source_model, tok)
    # final/ holds the trained weights: those of the last checkpoint, not the ones it started from
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    load_model_state(source_model, ckpt / "model.safetensors")
    torch.testing.assert_close(logits(model, tok), logits(source_model, tok), rtol=0, atol=0)
    assert not torch.equal(logits(model, tok), before)

    m = cli_eval(capsys, final, "arithmetic", "--num-prompts", "4")
    assert m["eval/num_prompts"] == 4 and 0 <= m["eval/accuracy"] <= 1


def test_a_lora_run_with_evaluation_keeps_the_checkpoints_generation_config(saved, tmp_path):
    """peft's `generate` copies the wrapper's generation config into the model it wraps; the
    clean one that sampling and greedy evaluation run under must not stay there and be saved
    with the merged model: final/ keeps the checkpoint's EOS list, pad and sampling defaults."""
    src = saved("qwen3")
    run_dir = train(src, tmp_path, "data.source=arithmetic", "lora.enabled=true", "lora.r=4")
    want = json.loads((Path(src) / "generation_config.json").read_text())
    got = json.loads((run_dir / "final" / "generation_config.json").read_text())
    assert isinstance(want["eos_token_id"], list) and len(want["eos_token_id"]) == 2
    for k in ("eos_token_id", "pad_token_id", "temperature", "top_p", "top_k", "repetition_penalty"):
        assert got.get(k) == want.get(k), k
    assert (run_dir / "final" / "adapter").is_dir()
    # folders of a run that are not a model folder: one error each, naming where the model is
    from gspo.models import ModelError

    step = next((run_dir / "checkpoints").glob("step-*"))
    for path, says in [(run_dir, f"is a gspo run directory, not a model folder; its model is {run_dir / 'final'}"),
                       (step, "is a gspo training checkpoint, not a model folder")]:
        with pytest.raises(ModelError, match=re.escape(says)):
            load_policy(path, device="cpu")
    # the adapters alone (final/adapter; final/ itself with lora.merge_final=false) load onto the
    # base their adapter_config.json names, merged: the weights of the merged final/
    merged, _ = load_policy(run_dir / "final", device="cpu")
    got, tok = load_policy(run_dir / "final" / "adapter", device="cpu")
    want = merged.state_dict()
    assert type(got) is type(merged) and got.state_dict().keys() == want.keys()
    assert max((v - want[k]).abs().max().item() for k, v in got.state_dict().items()) < 1e-6
    assert tok.padding_side == "left" and tok.pad_token is not None
    cfg = json.loads((run_dir / "final" / "adapter" / "adapter_config.json").read_text())
    assert max((merged.state_dict()[k] - v).abs().max().item()  # the adapters did move the base
               for k, v in AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"]).state_dict().items()) > 0
    (run_dir / "final" / "adapter" / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": None}))
    with pytest.raises(ModelError, match="names no base model"):
        load_policy(run_dir / "final" / "adapter", device="cpu")
    (run_dir / "final" / "adapter" / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ModelError, match="is a LoRA adapter on the base model .*gone.*, which did not load"):
        load_policy(run_dir / "final" / "adapter", device="cpu")


TEMPLATE_START = {"llama": "<s>[INST] ", "mistral": "<s>[INST] ", "gemma2": "<bos><start_of_turn>user\n",
                  "qwen3": "<|im_start|>system\n"}


@pytest.mark.parametrize("family", list(TEMPLATE_START))
def test_chat_jsonl_run(family, saved, tmp_path, capsys):
    """Messy chat rows (system turns, history, stray whitespace, non-ASCII, int answers) through
    templates that write BOS themselves (llama, mistral with [INST] as special tokens, gemma with
    <end_of_turn> as a second EOS) and ChatML (qwen)."""
    data = artifacts.write_chat_jsonl(tmp_path / "chat.jsonl")
    run_dir = train(saved(family), tmp_path, f"data.source={data}", f"data.eval_source={data}",
                    "data.prompt_column=messages")
    recs = records(run_dir)
    assert "eval/accuracy" in recs[0] and all(math.isfinite(r["loss"]) for r in recs if "loss" in r)
    row = json.loads(next((run_dir / "completions").glob("*.jsonl")).read_text().splitlines()[0])
    assert row["prompt"].startswith(TEMPLATE_START[family])
    m = cli_eval(capsys, run_dir / "final", data, "data.prompt_column=messages", "--num-prompts", "4")
    assert m["eval/num_prompts"] == 4


def test_chat_data_for_a_tokenizer_without_a_template_is_one_error(saved, tmp_path, capsys):
    data = artifacts.write_chat_jsonl(tmp_path / "chat.jsonl")
    rc = main(["train", f"model.name_or_path={saved('gpt2')}", *RUN, f"data.source={data}", "data.prompt_column=messages",
               f"output.dir={tmp_path}", "output.name=x"])
    assert rc == 2 and "chat_template" in capsys.readouterr().err


def test_plain_jsonl_with_ragged_columns(saved, tmp_path, capsys):
    """Rows whose extra columns come and go ("level" missing from row 0, "source" from row 3)
    reach a reward that takes them, in training (rows 0 and 1) and in evaluation (rows 0-3)."""
    data = artifacts.write_plain_jsonl(tmp_path / "plain.jsonl")
    rewards = ("rewards.functions=[{name: exact_answer}, {name: 'artifacts:signal_reward'}, "
               "{name: 'artifacts:needs_ragged_columns', weight: 0.0}]")
    run_dir = train(saved("llama"), tmp_path, f"data.source={data}", f"data.eval_source={data}",
                    "data.shuffle=false", rewards)
    assert "eval/accuracy" in records(run_dir)[-1]
    m = cli_eval(capsys, run_dir / "final", data, rewards, "--num-prompts", "4")
    assert m["eval/num_prompts"] == 4


def test_eval_takes_the_configs_dataset_and_refuses_bad_counts(saved, tmp_path, capsys):
    """`gspo eval MODEL --config C` evaluates C's data.source (a dataset named on the command line
    wins); counts below their minimum are one error naming the flag, before the model loads."""
    data = artifacts.write_plain_jsonl(tmp_path / "plain.jsonl")
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(f"data:\n  source: {data}\neval:\n  num_prompts: 3\nrewards:\n  functions:\n"
                   f"    - name: exact_answer\n")
    m = cli_eval(capsys, saved("llama"), "--config", cfg)
    assert m["eval/num_prompts"] == 3  # the file's rows, not the built-in task's 100
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"data:\n  source: {tmp_path / 'nowhere.jsonl'}\n")
    assert main(["eval", str(saved("llama")), "--config", str(missing)]) == 2
    assert "nowhere.jsonl" in capsys.readouterr().err
    long = tmp_path / "long.jsonl"  # prompts past data.max_prompt_tokens are dropped, as in training
    long.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in ["1+0=", "9" * 400, "0+1="]))
    m = cli_eval(capsys, saved("llama"), long, "data.max_prompt_tokens=64")
    assert m["eval/num_prompts"] == 2
    for flag, value in (("--num-prompts", "0"), ("--pass-k", "-1"), ("--max-new-tokens", "0")):
        assert main(["eval", str(saved("llama")), flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err


# ----------------------------------------------------------------------------- loading and special tokens


@pytest.mark.parametrize("family", artifacts.FAMILIES)
def test_load_policy_fills_pad_and_lists_every_eos(family, saved):
    src = saved(family)
    source_tok = AutoTokenizer.from_pretrained(src)
    gen_eos = AutoModelForCausalLM.from_pretrained(src).generation_config.eos_token_id
    model, tok = load_policy(src, device="cpu")
    assert not model.training  # from disk, a checkpoint starts in eval mode
    if source_tok.pad_token is None:  # llama, mistral, gpt2
        assert tok.pad_token == tok.eos_token and tok.pad_token_id == tok.eos_token_id
    else:
        assert tok.pad_token == source_tok.pad_token
    assert tok.padding_side == "left"
    assert model.generation_config.pad_token_id == tok.pad_token_id
    gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    want = list(dict.fromkeys(gen_eos + [tok.eos_token_id]))
    assert eos_token_ids(model, tok) == want
    if family in ("gemma2", "qwen3"):  # several EOS ids: <eos> + <end_of_turn>, <|im_end|> + <|endoftext|>
        assert len(want) == 2


BOS_CASES = [("llama", "plain"), ("llama", "chat"), ("mistral", "plain"), ("mistral", "chat"),
             ("gemma2", "plain"), ("gemma2", "chat"), ("qwen3", "chat"), ("gpt2", "plain")]


@pytest.mark.parametrize("family,kind", BOS_CASES)
def test_prompt_ids_hold_the_tokenizers_bos_once(family, kind, saved, tmp_path):
    """The ids the sampler, the trainer (the rollout's ids) and the evaluation feed the policy
    are the tokenizer's own: plain text gets the BOS a Llama/Mistral/Gemma tokenizer adds; a chat
    template that writes BOS keeps its one; qwen and gpt2 get no BOS at all."""
    src = saved(family)
    data = ["data.source=arithmetic"]
    if kind == "chat":
        data = [f"data.source={artifacts.write_chat_jsonl(tmp_path / 'chat.jsonl')}", "data.prompt_column=messages"]
    cfg = load_config(None, [f"model.name_or_path={src}", *RUN, *data, f"output.dir={tmp_path}", "output.name=x"])
    ctx = build_run(cfg)
    try:
        tok, bos = ctx.tokenizer, ctx.tokenizer.bos_token_id
        texts = [format_prompt(r["prompt"], ctx.tokenizer) for r in ctx.prompts.rows[:4]]

        def want(text: str) -> list[int]:
            plain = tok(text, add_special_tokens=False)["input_ids"]
            return plain if bos is not None and plain[:1] == [bos] else tok(text)["input_ids"]

        if family in ("llama", "mistral", "gemma2"):
            assert all(want(t)[0] == bos and want(t)[1] != bos for t in texts)
        ro = ctx.generator.generate(texts, 2)
        sampled = [ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist() for i in range(0, ro.num_samples, 2)]
        assert sampled == [want(t) for t in texts]

        seen = []
        generate = ctx.policy.generate

        def spy(**kw):
            seen.extend(ids[m.bool()].tolist() for ids, m in zip(kw["input_ids"], kw["attention_mask"]))
            return generate(**kw)

        ctx.policy.generate = spy
        greedy_completions(ctx.policy, tok, texts, max_new_tokens=2)
        assert seen == [want(t) for t in texts]
    finally:
        ctx.close()


def test_greedy_evaluation_is_the_argmax_whatever_the_checkpoint_ships(saved):
    """A checkpoint's generation_config (Qwen ships repetition_penalty=1.05; here one strong enough
    to change a random model's choices, and a no-repeat n-gram size) must not steer greedy
    evaluation: it is the argmax of the policy's logits at every step, as the trainer sees them."""
    src = saved("qwen3", generation={"repetition_penalty": 100.0, "no_repeat_ngram_size": 2})
    model, tok = load_policy(src, device="cpu")
    prompts, n = ["12+7=", "3+3=", "45+1="], 8
    eos = eos_token_ids(model, tok)
    want = []
    with torch.no_grad():
        for p in prompts:
            ids, out = tok(p, return_tensors="pt")["input_ids"], []  # (1, P); qwen adds no BOS
            for _ in range(n):
                nxt = int(model(ids).logits[0, -1].argmax())
                if nxt in eos:
                    break
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            want.append(tok.decode(out, skip_special_tokens=True))
    assert greedy_completions(model, tok, prompts, max_new_tokens=n) == want
    assert model.generation_config.repetition_penalty == 100.0  # the checkpoint's own, set back


@pytest.mark.parametrize("extra", [["lora.enabled=true"], ["algo.kl_coef=0.01"]])
def test_a_resume_on_base_weights_other_than_the_runs_is_refused(tmp_path, extra, capsys):
    """LoRA checkpoints hold the adapters only, and the KL reference is the starting weights: a
    base folder rewritten since the run began (same shapes, other weights) is one error naming
    model.name_or_path; the same weights saved again (in bf16 as well) resume."""
    from gspo.models import weights_fingerprint

    base = artifacts.save_model(tmp_path / "base", "qwen3", seed=0)
    run = train(base, tmp_path, *extra)
    artifacts.save_model(tmp_path / "base", "qwen3", seed=1)
    capsys.readouterr()
    args = ["train", f"model.name_or_path={base}", *RUN, REWARDS, f"output.dir={tmp_path}", "output.name=x", *extra,
            "schedule.rollouts=2", "resume=auto"]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "config field 'model.name_or_path'" in err and "not the ones this run started from" in err
    artifacts.save_model(tmp_path / "base", "qwen3", seed=0)
    assert main(args) == 0 and (run / "checkpoints" / "step-4").is_dir()
    m = AutoModelForCausalLM.from_pretrained(base)
    fp32 = weights_fingerprint(m.parameters())
    assert weights_fingerprint(m.to(torch.bfloat16).parameters()) == fp32  # a bf16 load of the same weights
    with torch.no_grad():
        next(m.parameters())[0, 0] += 1.0
    assert weights_fingerprint(m.parameters()) != fp32


def test_a_tokenizer_larger_than_the_embedding_or_missing_is_one_error_at_load(saved, tmp_path):
    """Tokens added without resize_token_embeddings raised IndexError in the first evaluation;
    a model folder without tokenizer files got transformers' advice to install sentencepiece."""
    import shutil

    from gspo.models import ModelError

    src = saved("llama")
    grown = tmp_path / "grown"
    shutil.copytree(src, grown)
    tok = AutoTokenizer.from_pretrained(grown)
    rows = AutoModelForCausalLM.from_pretrained(grown).get_input_embeddings().num_embeddings
    tok.add_tokens([f"<new_{i}>" for i in range(rows - len(tok) + 3)])
    tok.save_pretrained(grown)
    with pytest.raises(ModelError, match=rf"has {rows + 3} tokens but the model's embedding has {rows} rows"):
        load_policy(grown, device="cpu")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(Path(src) / f, bare / f)
    with pytest.raises(ModelError, match="holds no tokenizer files"):
        load_policy(bare, device="cpu")


def test_gspo_eval_pass_at_k_is_the_same_for_the_same_seed(saved, tmp_path, capsys):
    """pass@k's samples were drawn unseeded: 0.0, 0.25, 0.125 on one model and config."""
    data = artifacts.write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)}
                                                        for i in range(8)])
    (tmp_path / "coin.py").write_text("def coin(prompts, completions, **kw):\n"
                                      "    return [float(sum(map(ord, c)) % 3 == 0) for c in completions]\n")
    args = [saved("qwen3"), data, "--pass-k", "2", "--num-prompts", "8", "rollout.temperature=2.0",
            f"rewards.functions=[{{name: '{tmp_path / 'coin.py'}:coin'}}]"]
    runs = [cli_eval(capsys, *args, f"seed={seed}")["eval/pass@2"] for seed in (0, 0, 1, 2, 3)]
    assert runs[0] == runs[1], runs
    assert len(set(runs)) > 1, runs  # (and the seed does act on the samples)


def test_a_bfloat16_checkpoint_comes_back_in_bfloat16_unless_asked_otherwise(saved, tmp_path, capsys):
    """final/ was always float32 (the training precision), twice the size of a bf16 checkpoint;
    output.final_dtype=auto writes the checkpoint's own dtype: the trained weights, rounded."""
    from safetensors.torch import load_file

    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(saved("qwen3")).to(torch.bfloat16).save_pretrained(src)
    AutoTokenizer.from_pretrained(saved("qwen3")).save_pretrained(src)
    runs = {}
    for name, extra in (("auto", []), ("fp32", ["output.final_dtype=float32"])):
        rc = main(["train", f"model.name_or_path={src}", *RUN, REWARDS, f"output.dir={tmp_path}", f"output.name={name}",
                   "eval.enabled=false", "optim.lr=1e-2", *extra])
        assert rc == 0
        runs[name] = tmp_path / name
    assert "final/: weights written in bfloat16, the dtype the checkpoint was saved in" in capsys.readouterr().err
    auto = load_file(runs["auto"] / "final" / "model.safetensors")
    as_trained = load_file(runs["fp32"] / "final" / "model.safetensors")
    assert {t.dtype for t in auto.values()} == {torch.bfloat16} and {t.dtype for t in as_trained.values()} == {torch.float32}
    assert json.loads((runs["auto"] / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    for k, t in as_trained.items():  # the same training (float32 weights); final/ rounds them
        torch.testing.assert_close(auto[k], t.to(torch.bfloat16), rtol=0, atol=0, msg=k)
    model = AutoModelForCausalLM.from_pretrained(runs["auto"] / "final")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_evaluation_drops_a_stop_token_the_tokenizer_keeps_as_text_as_training_does(saved):
    """Phi-3's early `<|end|>` was an added token not marked special, listed as an EOS in
    generation_config: training's rewards never saw it, evaluation's got '...<|end|>'. Here the
    stop token is an ordinary character the model writes first, so every completion is empty."""
    model, tok = load_policy(saved("qwen3"), device="cpu")
    prompts = ["12+7=", "3+3="]
    with torch.no_grad():
        first = [int(model(tok(p, return_tensors="pt")["input_ids"]).logits[0, -1].argmax()) for p in prompts]
    assert not set(first) & set(tok.all_special_ids)  # plain text: skip_special_tokens keeps it
    model.generation_config.eos_token_id = [*eos_token_ids(model, tok), *first]
    assert greedy_completions(model, tok, prompts, max_new_tokens=4) == ["", ""]


def test_a_tokenizer_without_eos_or_pad_pads_with_the_generation_configs_eos(saved, tmp_path):
    """Some base checkpoints' tokenizers name no EOS while generation_config lists the stop ids:
    it was refused as having 'neither a pad nor an eos token'."""
    import shutil

    import transformers as T

    src = tmp_path / "no-eos"
    shutil.copytree(saved("qwen3"), src)
    tok = T.AutoTokenizer.from_pretrained(src)
    tok.eos_token, tok.pad_token = None, None
    tok.save_pretrained(src)
    model, tok = load_policy(src, device="cpu")
    stops = eos_token_ids(model, tok)
    assert stops and tok.pad_token_id == stops[0] and tok.convert_ids_to_tokens(stops[0]) == "<|im_end|>"


def _damaged_copy(src: Path, dst: Path) -> Path:
    """`src` with its weights file cut to 8 bytes, as an interrupted copy leaves it."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:8])
    return dst


@pytest.mark.parametrize("command", ["train", "eval"])
def test_prompts_a_tokenizer_cannot_render_are_refused_before_the_model_loads(saved, tmp_path, capsys, command):
    """Chat prompts for a tokenizer with no chat template were refused only after the weights
    loaded: with a damaged weights file, the run never got to say so. GPT-2's has no template."""
    model = _damaged_copy(saved("gpt2"), tmp_path / "gpt2")
    data = artifacts.write_chat_jsonl(tmp_path / "chat.jsonl")
    argv = (["train", f"model.name_or_path={model}", f"data.source={data}", *RUN, f"output.dir={tmp_path}"]
            if command == "train" else ["eval", str(model), str(data), "--num-prompts", "2"]) + ["data.prompt_column=messages"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "chat_template" in err and "safetensors" not in err.lower(), err[-1500:]


def test_a_damaged_weights_file_is_one_error_naming_the_model(saved, tmp_path, capsys):
    """A truncated model.safetensors raised safetensors' own error: a traceback, exit 1."""
    model = _damaged_copy(saved("qwen3"), tmp_path / "qwen3")
    data = artifacts.write_plain_jsonl(tmp_path / "plain.jsonl")
    assert main(["train", f"model.name_or_path={model}", f"data.source={data}", *RUN, f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"could not load model {str(model)!r}" in err and "Traceback" not in err, err[-1500:]


def test_a_reward_needing_a_column_few_rows_have_gets_none_in_every_call(saved, tmp_path):
    """A call whose rows all lacked the column got no such keyword: a reward that needs it
    (`y` here, which the start-up check saw in one row) raised mid-run."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), **({"y": [i]} if i == 5 else {})} for i in range(8)]
    data = artifacts.write_jsonl(tmp_path / "ragged.jsonl", rows)
    (tmp_path / "needy.py").write_text("def needy(prompts, completions, y, **kw):\n"
                                       "    assert len(y) == len(completions)\n"
                                       "    return [0.0 if v is None else 1.0 for v in y]\n")
    assert main(["train", f"model.name_or_path={saved('qwen3')}", f"data.source={data}", *RUN,
                 f"rewards.functions=[{tmp_path / 'needy.py'}:needy]", "schedule.rollouts=3",
                 f"output.dir={tmp_path}", "output.name=x"]) == 0


def test_every_completion_cut_and_masked_out_is_said_and_its_sequence_metrics_are_null(saved, tmp_path, capsys):
    """algo.mask_truncated=true with every completion cut trained nothing with no word, while
    ratio/seq_* read 1.0 and clip/seq_frac 0.0 over no sequence."""
    run = train(saved("qwen3"), tmp_path, "rollout.max_new_tokens=2", "algo.mask_truncated=true",
                "logging.no_signal_every=1", "eval.enabled=false")
    steps = [r for r in records(run) if "loss" in r]
    assert all(r["completion/truncated_frac"] == 1.0 and r["tokens/minibatch"] == 0 for r in steps)
    assert all(r["ratio/seq_mean"] is None and r["clip/seq_frac"] is None for r in steps)
    assert "every completion ran to rollout.max_new_tokens, and algo.mask_truncated=true" in capsys.readouterr().err


def test_empty_frac_counts_completions_that_were_their_eos_alone():
    """It compared |y| (which counts the EOS) with 0, so it read 0 when every completion was empty."""
    from types import SimpleNamespace

    from gspo.train.distributed import Dist
    from gspo.train.step_metrics import rollout_metrics

    ro = SimpleNamespace(model_lengths=torch.tensor([1, 3, 1, 4]), finish_reason=["eos", "eos", "length", "length"],
                         completions=["", "ab", "a", "abc"],
                         truncated=torch.tensor([False, False, True, True]), episode_stats=None)
    rewards = SimpleNamespace(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), stats={})
    m = rollout_metrics(Dist(), ro, rewards, {})
    assert m["completion/empty_frac"] == 0.25 and m["completion/len_mean"] == 2.25
