"""Reward models and judges as reward functions (`gspo.rewards.models`), on tiny models written
with save_pretrained: scores against the model's own logits computed by hand, batching, the
judge's parsing on a saved model whose greedy answer is known, start-up errors, the runner's
deadline and error policies, and one `gspo train` through the CLI."""

from __future__ import annotations

import json
import math
import shutil
import string
from pathlib import Path

import pytest
import torch
import transformers as T

from artifacts import build_tokenizer
from gspo.cli import main
from gspo.models.tiny import build_char_tokenizer
from gspo.rewards import RewardConfigError, RewardError, RewardSpec, validate_specs
from gspo.rewards.models import Judge, RewardModel, fill_template, load_scorer
from gspo.rewards.runner import RewardRunner


def _save(directory: Path, model, tok) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def _dense(tok, **kw) -> dict:
    return dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


@pytest.fixture(scope="module")
def chat_rm(tmp_path_factory) -> Path:
    """A Qwen3 reward model with one logit, as TRL's RewardTrainer saves them, beside a ChatML
    tokenizer whose pad (<|endoftext|>) is not its EOS."""
    tok = build_tokenizer("qwen")
    torch.manual_seed(0)
    model = T.Qwen3ForSequenceClassification(T.Qwen3Config(**_dense(tok, head_dim=8, num_labels=1)))
    return _save(tmp_path_factory.mktemp("chat") / "rm", model, tok)


@pytest.fixture(scope="module")
def plain_rm(tmp_path_factory) -> Path:
    """A Llama classifier with three labels beside a GPT-2 tokenizer: no chat template, no pad
    token (batches are padded with EOS)."""
    tok = build_tokenizer("gpt2")
    torch.manual_seed(1)
    config = T.LlamaConfig(**_dense(tok), id2label={0: "bad", 1: "ok", 2: "good"}, label2id={"bad": 0, "ok": 1, "good": 2})
    return _save(tmp_path_factory.mktemp("plain") / "classifier", T.LlamaForSequenceClassification(config), tok)


ECHO_CHARS = string.digits + string.ascii_lowercase + " {}!?"


def _echo_judge(directory: Path, chat_template: str | None = None) -> Path:
    """A causal LM whose greedy answer repeats the last token of its input, written to disk.

    Embeddings and lm_head are the identity over the vocabulary (45 ids <= hidden 48) and the
    layer's attention and MLP outputs are zero, so the residual stream at the last position is
    that token's one-hot row; after the RMSNorm it is sqrt(48) * e_i, whose logits are
    sqrt(48) at id i and 0 elsewhere: the argmax is the last input token, at every step."""
    tok = build_char_tokenizer(ECHO_CHARS)  # <pad>=0 <eos>=1 <bos>=2 <unk>=3, then the characters
    tok.chat_template = chat_template
    V, H = len(tok), 48
    config = T.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                           pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = T.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(V, H))
        model.lm_head.weight.copy_(torch.eye(V, H))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return _save(directory, model, tok)


@pytest.fixture(scope="module")
def echo_judge(tmp_path_factory) -> Path:
    return _echo_judge(tmp_path_factory.mktemp("echo") / "judge")


def _logit(model, ids: list[int], label: int = 0) -> float:
    """A classifier's logit for one unpadded row, by hand: the decoder's last hidden state
    through the score head (no bias)."""
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]  # (H,)
        return float(model.score.weight[label] @ h)


def _reference(directory: Path):
    return (T.AutoTokenizer.from_pretrained(directory),
            T.AutoModelForSequenceClassification.from_pretrained(directory).eval())


def _as_messages(x, role):
    return [{"role": role, "content": x}] if isinstance(x, str) else list(x)


PROMPTS = ["2+2=", "Name a colour.", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
           "Why is the sky blue?", "x"]
COMPLETIONS = ["4", "Blue, or green, or a long list of other colours", [{"role": "assistant", "content": "Hello!"}],
               "Rayleigh scattering.", ""]


# ----------------------------------------------------------------------------- sequence classification


def test_reward_model_scores_are_the_models_logit_on_the_chat_rendered_conversation(chat_rm):
    rm = load_scorer(f"model:{chat_rm}", {"batch_size": 2})  # rows of unequal length share micro-batches
    assert isinstance(rm, RewardModel) and not rm.model.training
    got = rm(PROMPTS, COMPLETIONS)
    tok, ref = _reference(chat_rm)
    want = []
    for p, c in zip(PROMPTS, COMPLETIONS):
        text = tok.apply_chat_template(_as_messages(p, "user") + _as_messages(c, "assistant"), tokenize=False)
        want.append(_logit(ref, tok(text, add_special_tokens=False)["input_ids"]))
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(v, 4) for v in want}) == len(want)  # the rows are told apart


def test_reward_model_batched_scores_equal_one_by_one(chat_rm, plain_rm):
    for name, kw in ((f"model:{chat_rm}", {}), (f"model:{plain_rm}", {"label": 2})):  # pad <|endoftext|>; pad = EOS
        one = load_scorer(name, {**kw, "batch_size": 1})(PROMPTS, COMPLETIONS)
        for bs in (2, 3, 16):
            assert load_scorer(name, {**kw, "batch_size": bs})(PROMPTS, COMPLETIONS) == pytest.approx(one, abs=1e-5)


def test_a_row_longer_than_the_models_positions_keeps_its_last_tokens(tmp_path, capsys):
    """GPT-2 has a position table: a row past it was an IndexError at the first rollout."""
    tok = build_tokenizer("gpt2")
    torch.manual_seed(2)
    config = T.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=16, num_labels=1,
                          pad_token_id=tok.eos_token_id)
    path = _save(tmp_path / "short-rm", T.GPT2ForSequenceClassification(config), tok)
    rm = load_scorer(f"model:{path}", {"batch_size": 2})
    prompts, completions = ["a long prompt " * 6, "hi"], ["and its completion " * 3, " there"]
    got = rm(prompts, completions)
    assert "longer than the reward model's 16 positions; such rows keep their leading special tokens and then their " \
           "last tokens" in capsys.readouterr().err
    _, ref = _reference(path)
    for value, p, c in zip(got, prompts, completions):
        ids = tok(p + c)["input_ids"][-16:]
        with torch.no_grad():
            assert value == pytest.approx(ref(input_ids=torch.tensor([ids])).logits[0, 0].item(), abs=1e-5)
    assert rm(prompts, completions) == pytest.approx(got, abs=1e-6)
    assert "longer than" not in capsys.readouterr().err  # said once


def test_a_cut_row_keeps_the_cls_token_an_encoder_pools(tmp_path):
    """A BERT reward model pools its first position: a row past its 16 positions kept its last 16
    tokens, [CLS] cut, and was scored on whatever word sat first. [CLS] stays, then the row's end."""
    words = [f"w{i}" for i in range(40)]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tok = T.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    torch.manual_seed(3)
    config = T.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=16, num_labels=1)
    path = _save(tmp_path / "bert-rm", T.BertForSequenceClassification(config), tok)
    prompt, completion = " ".join(words[:12]), " " + " ".join(words[12:20])
    got = load_scorer(f"model:{path}", {})([prompt], [completion])
    ids = tok(prompt + completion)["input_ids"]
    assert ids[0] == tok.cls_token_id and len(ids) > 16
    ref = T.AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([[ids[0], *ids[-15:]]])).logits[0, 0].item()
    assert got[0] == pytest.approx(want, abs=1e-5)


def test_without_a_chat_template_the_texts_are_concatenated_and_label_picks_the_logit(chat_rm, plain_rm):
    prompts, completions = ["2+2=", "Say hi."], ["4", " hi there"]
    tok, ref = _reference(plain_rm)
    for label in (2, "good"):
        got = load_scorer(f"model:{plain_rm}", {"label": label})(prompts, completions)
        assert got == pytest.approx([_logit(ref, tok(p + c)["input_ids"], 2) for p, c in zip(prompts, completions)],
                                    abs=1e-5)
    assert load_scorer(f"model:{plain_rm}", {"label": 0})(prompts, completions) == pytest.approx(
        [_logit(ref, tok(p + c)["input_ids"], 0) for p, c in zip(prompts, completions)], abs=1e-5)
    tok, ref = _reference(chat_rm)  # a chat template, turned off
    got = load_scorer(f"model:{chat_rm}", {"use_chat_template": False})(prompts, completions)
    assert got == pytest.approx([_logit(ref, tok(p + c)["input_ids"]) for p, c in zip(prompts, completions)], abs=1e-5)


# ----------------------------------------------------------------------------- judge


def test_judge_parses_the_first_number_of_its_greedy_answer(echo_judge):
    judge = load_scorer(f"judge:{echo_judge}", {"template": "{completion}", "max_new_tokens": 1, "batch_size": 4})
    assert isinstance(judge, Judge)
    completions = ["ab7", "3", "x", "9", "{prompt}", "10"]  # unequal lengths: left padding must keep each row's end
    prompts = ["q5"] * len(completions)
    assert judge.answers(judge.encode(prompts, completions)) == ["7", "3", "x", "9", "}", "0"]
    want = [7.0, 3.0, None, 9.0, None, 0.0]  # "x", "}": no number; "{prompt}" is not filled in from the prompt
    assert judge(prompts, completions) == want
    assert load_scorer(f"judge:{echo_judge}", {"template": "{completion}", "max_new_tokens": 1,
                                               "batch_size": 1})(prompts, completions) == want


def test_judge_range_regex_and_placeholders(echo_judge):
    two = {"template": "{completion}", "max_new_tokens": 2}
    completions = ["ab7", "x4"]  # answers "77" and "44"
    assert load_scorer(f"judge:{echo_judge}", two)(["", ""], completions) == [None, None]  # 77, 44 > max_score 10
    assert load_scorer(f"judge:{echo_judge}", {**two, "max_score": 100})(["", ""], completions) == [77.0, 44.0]
    assert load_scorer(f"judge:{echo_judge}", {**two, "regex": r"(\d)\d"})(["", ""], completions) == [7.0, 4.0]
    assert load_scorer(f"judge:{echo_judge}", {**two, "regex": r"(\d)", "min_score": 5})(["", ""], completions) == [7.0, None]
    # {prompt}: a text, or a message list's content; a conversational completion is its content
    judge = load_scorer(f"judge:{echo_judge}", {"template": "{completion} {prompt}", "max_new_tokens": 1})
    assert judge(["q1", [{"role": "user", "content": "what is 4"}]], ["zz", [{"role": "assistant", "content": "x"}]]) \
        == [1.0, 4.0]
    assert fill_template("{prompt}|{completion}", "{completion}", "b") == "{completion}|b"


def test_judge_uses_the_tokenizers_chat_template(tmp_path):
    # a chat template that renders the first character of the user turn only
    judge_dir = _echo_judge(tmp_path / "chat-judge", chat_template="{{ messages[0]['content'][:1] }}")
    completions = ["5 apples", "x5"]
    kw = {"template": "{completion}!", "max_new_tokens": 1}
    assert load_scorer(f"judge:{judge_dir}", kw)(["", ""], completions) == [5.0, None]
    assert load_scorer(f"judge:{judge_dir}", {**kw, "use_chat_template": False})(["", ""], completions) == [None, None]


# ----------------------------------------------------------------------------- start-up errors


def _wrong_head(tmp_path: Path, causal: Path) -> Path:
    """A causal LM checkpoint whose config claims a classifier: its score head is not in the file."""
    d = tmp_path / "no-head"
    shutil.copytree(causal, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _no_tokenizer(tmp_path: Path, rm: Path) -> Path:
    d = tmp_path / "no-tok"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(rm / f, d / f)
    return d


def test_bad_reward_model_inputs_are_one_error_at_start_up(tmp_path, saved, chat_rm, plain_rm, echo_judge):
    causal = saved("qwen3")
    cases = [
        (f"model:{tmp_path}/missing", {}, ["no such directory"]),
        (f"model:{causal}", {}, ["Qwen3ForCausalLM", "not a sequence-classification", f"judge:{causal}"]),
        (f"judge:{chat_rm}", {}, ["Qwen3ForSequenceClassification", f"model:{chat_rm}"]),
        (f"model:{plain_rm}", {}, ["3 labels", "kwargs.label"]),
        (f"model:{plain_rm}", {"label": 3}, ["kwargs.label=3", "out of range"]),
        (f"model:{plain_rm}", {"label": "great"}, ["'great'", "bad, ok, good"]),
        (f"model:{chat_rm}", {"batch_size": 0}, ["kwargs.batch_size", "int >= 1"]),
        (f"model:{chat_rm}", {"colour": 1}, ["unknown kwargs 'colour'", "batch_size"]),
        (f"model:{chat_rm}", {"template": "{completion}"}, ["unknown kwargs 'template'"]),  # a judge's option
        (f"model:{chat_rm}", {"dtype": "fp8"}, ["kwargs.dtype"]),
        (f"model:{chat_rm}", {"trust_remote_code": "yes"}, ["kwargs.trust_remote_code"]),
        (f"judge:{echo_judge}", {"template": "Rate {prompt}"}, ["kwargs.template", "{completion}"]),
        (f"judge:{echo_judge}", {"regex": "("}, ["kwargs.regex"]),
        (f"judge:{echo_judge}", {"min_score": 5, "max_score": 1}, ["kwargs.min_score"]),
        (f"model:{_wrong_head(tmp_path, causal)}", {}, ["no weights for score.weight", "at random",
                                                        "AutoModelForSequenceClassification"]),
        (f"model:{_no_tokenizer(tmp_path, chat_rm)}", {}, ["tokenizer"]),
    ]
    for name, kwargs, parts in cases:
        with pytest.raises(RewardConfigError) as e:
            validate_specs([{"name": name, "kwargs": kwargs}])
        assert all(p in str(e.value) for p in parts), (name, kwargs, str(e.value))


def test_gspo_train_names_the_field_of_a_bad_reward_model_before_the_policy_loads(tmp_path, capsys):
    rc = main(["train", *SMALL, f"output.dir={tmp_path}", "output.name=bad",
               f"rewards.functions=[{{name: exact_answer}}, {{name: 'model:{tmp_path}/nope'}}]"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "rewards.functions[1].name" in err and "no such directory" in err, err
    assert not (tmp_path / "bad" / "config.yaml").exists()  # written only once the policy has loaded


# ----------------------------------------------------------------------------- in the runner


def test_runner_loads_once_and_weighs_a_reward_model_with_a_function(chat_rm):
    spec = RewardSpec(f"model:{chat_rm}", weight=0.5)
    other = RewardSpec("gspo_test_rewards:count_ones", weight=2.0)
    (_, loaded, _), = validate_specs([spec])  # start-up validation, as build_run does
    prompts, completions = ["a", "b", "c"], ["1", "121", "hello"]
    with RewardRunner([spec, other], timeout_s=60) as runner:
        assert runner._functions[0][0] is loaded  # not loaded a second time
        res = runner.score(prompts, completions, {"answer": ["1", "2", "3"]})
    scores = loaded(prompts, completions)
    ones = [1.0, 2 / 3, 0.0]
    assert res.per_function["rm"] == pytest.approx(scores) and res.per_function["count_ones"] == pytest.approx(ones)
    assert res.rewards.tolist() == pytest.approx([0.5 * s + 2.0 * o for s, o in zip(scores, ones)], abs=1e-6)
    with RewardRunner([spec]) as runner:
        assert runner.num_workers == 0  # nothing for a worker to run


def test_runner_deadline_and_on_error_apply_to_a_reward_model(chat_rm):
    spec = RewardSpec(f"model:{chat_rm}", kwargs={"batch_size": 2})
    validate_specs([spec])
    with RewardRunner([spec], timeout_s=1e-9, on_error="skip") as runner:  # past it after the first micro-batch
        res = runner.score(PROMPTS, COMPLETIONS)
    assert all(math.isnan(v) for v in res.per_function["rm"]) and res.stats["reward/timeouts"] == len(PROMPTS)
    assert "timed out" in res.errors[0] and "stopped after a micro-batch" in res.errors[0]
    with RewardRunner([spec], timeout_s=1e-9) as runner, pytest.raises(RewardError, match="timed out"):
        runner.score(PROMPTS, COMPLETIONS)
    prompts, completions = ["a", "b", "c"], ["fine", 5, "also fine"]  # 5 is no completion: that sample fails alone
    good = spec._loaded[1](["a", "c"], ["fine", "also fine"])
    with RewardRunner([spec], on_error="zero") as runner:
        res = runner.score(prompts, completions)
    assert res.per_function["rm"] == pytest.approx([good[0], 0.0, good[1]]) and res.stats["reward/errors"] == 1
    with RewardRunner([spec]) as runner, pytest.raises(RewardError, match="raised on sample 1"):
        runner.score(prompts, completions)


# ----------------------------------------------------------------------------- end to end

SMALL = ["tiny.hidden_size=32", "tiny.num_layers=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "schedule.rollouts=1", "schedule.num_minibatches=1", "logging.console=false",
         "data.num_prompts=8", "eval.enabled=false", "logging.completions_every=1"]


def test_gspo_train_with_a_saved_reward_model(tmp_path, chat_rm):
    rc = main(["train", *SMALL, f"output.dir={tmp_path}", "output.name=run",
               f"rewards.functions=[{{name: 'model:{chat_rm}', kwargs: {{batch_size: 3}}}}]"])
    assert rc == 0
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(rec["reward/rm/mean"]) and rec["reward/missing"] == 0
    rows = [json.loads(x) for f in sorted((tmp_path / "run" / "completions").glob("*.jsonl"))
            for x in f.read_text().splitlines()]
    assert len(rows) == 4
    rm = load_scorer(f"model:{chat_rm}")  # the same model, loaded afresh, on the logged texts
    want = rm([r["prompt"] for r in rows], [r["completion"] for r in rows])
    assert [r["reward"] for r in rows] == pytest.approx(want, abs=1e-5)


def test_a_reward_model_path_in_a_config_file_is_found_beside_it(tmp_path, monkeypatch):
    """`model:rm` in a config file names the folder beside the file, from any working directory,
    as a data file does; a hub id (nothing on disk) is left as it is."""
    from gspo.config import load_config

    (tmp_path / "exp" / "rm").mkdir(parents=True)
    cfg_file = tmp_path / "exp" / "run.yaml"
    cfg_file.write_text("rewards:\n  functions:\n    - {name: 'model:rm'}\n    - {name: 'judge:org/judge-7b'}\n")
    monkeypatch.chdir(tmp_path)
    names = [f.name for f in load_config(cfg_file).rewards.functions]
    assert names == [f"model:{(tmp_path / 'exp' / 'rm').resolve()}", "judge:org/judge-7b"]


def test_a_judge_regex_with_alternatives_reads_the_group_that_matched():
    """`(\\d+)/10|score=(\\d+)` on "7/10" read its first group, and "score=7" scored None."""
    import re

    from gspo.rewards.models import parse_score

    rx = re.compile(r"score=(\d+)|(\d+)/10")
    assert parse_score("7/10", rx, 0, 10) == 7.0 and parse_score("score=3", rx, 0, 10) == 3.0
    assert parse_score("none", rx, 0, 10) is None and parse_score("9", re.compile(r"\d"), 0, 10) == 9.0


def test_a_judge_with_a_position_table_reads_what_fits_and_refuses_an_answer_that_cannot(tmp_path, capsys):
    """A GPT-2 judge of 48 positions given a longer filled template stopped the run with an
    IndexError after the first rollout; an answer budget past its positions is refused at load."""
    tok = build_tokenizer("gpt2")
    torch.manual_seed(4)
    config = T.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=48)
    path = _save(tmp_path / "short-judge", T.GPT2LMHeadModel(config), tok)
    with pytest.raises(RewardConfigError, match=r"kwargs.max_new_tokens=48 leaves no room .* 48 learned positions"):
        load_scorer(f"judge:{path}", {"max_new_tokens": 48})
    judge = load_scorer(f"judge:{path}", {"max_new_tokens": 8})
    scores = judge(["a long prompt " * 20], ["and its completion " * 5])
    assert scores == [None] or isinstance(scores[0], float)  # (a random judge: a score or none, no IndexError)
    assert "is longer than the 40 positions the judge has beside its answer" in capsys.readouterr().err


def test_a_reward_models_template_that_refuses_the_data_is_one_error_before_the_policy_loads(chat_rm, tmp_path,
                                                                                            capsys):
    """A Gemma-style template that takes no system turn, given data with one: the run stopped
    with exit 1 once the first rollout was sampled; now exit 2 at start-up, naming the entry."""
    import json as _json

    rm = tmp_path / "no-system-rm"
    shutil.copytree(chat_rm, rm)
    tok = T.AutoTokenizer.from_pretrained(rm)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}")
    tok.save_pretrained(rm)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(_json.dumps({"prompt": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)})
                            + "\n" for i in range(16)))
    capsys.readouterr()
    assert main(["train", f"data.source={data}", f"rewards.functions=[{{name: 'model:{rm}'}}]",
                 "schedule.rollouts=1", f"output.dir={tmp_path}", "output.name=run"]) == 2
    err = capsys.readouterr().err
    assert "config field 'rewards.functions[0].name'" in err and "System role not supported" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_reward_model_device_it_cannot_run_on_is_refused_when_it_loads(chat_rm):
    """kwargs.device=meta loaded, then failed on every call; cuda:N past the devices was a raw
    traceback (where CUDA is: a machine without it says so, as before)."""
    with pytest.raises(RewardConfigError, match=r"kwargs.device='meta' cannot run a model"):
        load_scorer(f"model:{chat_rm}", {"device": "meta"})
    says = "this process sees" if torch.cuda.is_available() else "no CUDA device is available"
    with pytest.raises(RewardConfigError, match=rf"kwargs.device='cuda:99'.*{says}"):
        load_scorer(f"model:{chat_rm}", {"device": "cuda:99"})
