"""DAPO's data controls: dynamic sampling (rollout.dynamic_sampling, gspo.train.dynamic) and the
soft overlong penalty (rewards.overlong_penalty, gspo.rewards.shaping).

Unit tests on scripted rounds (rewards chosen by hand, so which groups have signal is known),
simulated processes in threads for the cross-process agreement, and `gspo train` runs through
the CLI's own path: the kept groups and the penalty in a run's logs, an exact resume, and two
torchrun processes (gloo) agreeing on the rounds with one of them at the cap."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.rewards.runner import RewardResult
from gspo.rewards.shaping import length_limit, overlong_buffer, overlong_penalty
from gspo.rollout import Rollout, concat_rollouts
from gspo.train import dynamic, score
from simulated_ranks import SimulatedRanks
from test_resume import assert_same_run, gspo_train

nan = math.nan


# ---------------------------------------------------------------- the overlong penalty


def test_overlong_penalty_hand_values():
    # L_max = 10, L_cache = 4: free up to 10 - 4 = 6 tokens, then -1/4 per token down to -1 at 10
    lengths = torch.tensor([0, 6, 7, 8, 9, 10, 12])
    pen = overlong_penalty(lengths, max_len=10, buffer=4, coef=1.0)
    # 7: (6 - 7) / 4 = -0.25; 8: -2/4 = -0.5; 9: -0.75; 10: -4/4 = -1; 12 (beyond L_max): -1
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    # the factor scales it: 0.5 * -0.25 = -0.125
    assert overlong_penalty(lengths, max_len=10, buffer=4, coef=0.5).tolist()[2] == -0.125
    # a buffer of the whole limit: (0 - 5) / 10 = -0.5 at 5 tokens
    assert overlong_penalty(torch.tensor([5]), max_len=10, buffer=10, coef=1.0).tolist() == [-0.5]
    for bad in (0, 11):
        with pytest.raises(ValueError, match="buffer"):
            overlong_penalty(lengths, max_len=10, buffer=bad, coef=1.0)


def test_length_limit_and_default_buffer():
    one = load_config(None, ["rollout.max_new_tokens=64"]).rollout
    assert length_limit(one) == 64
    tools = SimpleNamespace(tools=["m:f"], environment="", max_new_tokens=32, max_turns=3, max_episode_tokens=0)
    assert length_limit(tools) == 96  # max_turns x max_new_tokens
    tools.max_episode_tokens = 50
    assert length_limit(tools) == 50
    assert overlong_buffer(0, 64) == 12 and overlong_buffer(0, 3) == 1 and overlong_buffer(5, 64) == 5  # 64 // 5 = 12


@pytest.mark.parametrize("overrides, field", [
    (["rewards.overlong_penalty=1.0", "rollout.max_new_tokens=8", "rewards.overlong_buffer=9"],
     "rewards.overlong_buffer"),
    (["rewards.overlong_penalty=-1"], "rewards.overlong_penalty"),
    (["rewards.overlong_buffer=-1"], "rewards.overlong_buffer"),
    (["rollout.dynamic_sampling_max_rounds=0"], "rollout.dynamic_sampling_max_rounds"),
    (["rollout.dynamic_sampling_max_rounds=3"], "rollout.dynamic_sampling_max_rounds': is the round budget"),
    (["rollout.dynamic_sampling=true", "rollout.mode=async"], "rollout.dynamic_sampling"),
])
def test_config_rules_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_config_accepts_the_edges():
    load_config(None, ["rewards.overlong_penalty=1.0", "rollout.max_new_tokens=8", "rewards.overlong_buffer=8"])
    with pytest.raises(ConfigError, match="rewards.overlong_buffer"):  # penalty off: a buffer would do nothing,
        load_config(None, ["rewards.overlong_buffer=999"])  # and is refused as SAPO's temperatures are elsewhere
    load_config(None, ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_rounds=1"])


def _rollout(B: int, G: int, *, P: int = 3, T: int = 4, tag: int = 0, lengths=None) -> Rollout:
    """B·G rows; every token id and text is `tag`, so a row's round can be read back."""
    N = B * G
    lengths = torch.full((N,), T) if lengths is None else torch.as_tensor(lengths)
    cmask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (N, T)
    return Rollout(prompt_ids=torch.full((N, P), 10 + tag), prompt_mask=torch.ones(N, P, dtype=torch.long),
                   completion_ids=cmask * (20 + tag), completion_mask=cmask,
                   sampler_logp=-cmask.float() * (tag + 1),
                   finish_reason=["length" if n == T else "eos" for n in lengths],
                   group_size=G, prompts=[f"p{tag}.{i // G}" for i in range(N)],
                   completions=[f"c{tag}.{i}" for i in range(N)])


def test_score_adds_the_penalty_and_missing_stays_missing():
    cfg = load_config(None, ["rewards.overlong_penalty=1.0", "rollout.max_new_tokens=4", "rewards.overlong_buffer=2",
                             "rollout.group_size=2"])

    class Rewards:
        def score(self, prompts, completions, columns):
            return RewardResult(torch.tensor([1.0, nan, 0.5, 0.0]), {"f": [1.0, nan, 0.5, 0.0]},
                                {"reward/f/mean": 0.5})

    run = SimpleNamespace(cfg=cfg, chat=False, rewards=Rewards(), prompts=SimpleNamespace(columns=[]))
    ro = _rollout(2, 2, lengths=[2, 4, 3, 4])
    res = score(run, [{"prompt": "a"}, {"prompt": "b"}], ro)
    # free up to 4 - 2 = 2 tokens: 2 -> 0; 3 -> (2 - 3) / 2 = -0.5; 4 -> -1
    assert res.per_function["overlong_penalty"] == [0.0, -1.0, -0.5, -1.0]
    # 1 + 0 = 1; NaN stays NaN; 0.5 - 0.5 = 0; 0 - 1 = -1
    assert torch.allclose(res.rewards, torch.tensor([1.0, nan, 0.0, -1.0]), equal_nan=True)
    assert res.stats["reward/overlong_penalty/mean"] == -0.625  # (0 - 1 - 0.5 - 1) / 4


# ---------------------------------------------------------------- dynamic sampling on scripted rounds


def _result(rewards: list[float]) -> RewardResult:
    r = torch.tensor(rewards, dtype=torch.float32)
    ok = r[~r.isnan()]
    return RewardResult(r, {"f": list(rewards)}, {"reward/mean": ok.mean().item() if len(ok) else nan,
                                                 "reward/errors": 1.0, "reward/time_s": 0.5})


def _draw(script: list[list[float]], G: int, calls: list | None = None):
    """draw(k) of `sample_with_signal`: round k's rewards are script[k]; rows and ids carry k."""
    def draw(k):
        if calls is not None:
            calls.append(k)
        B = len(script[k]) // G
        batch = [{"prompt": f"p{k}.{g}", "round": k, "group": g} for g in range(B)]
        return batch, _rollout(B, G, tag=k, T=3 + k), _result(script[k]), {"time/generate": 1.0, "time/score": 0.25}
    return draw


def _sample(draw, need, max_rounds=4, all_reduce=None):
    return dynamic.sample_with_signal(draw, need=need, group_size=2, max_rounds=max_rounds, adv_scale="group",
                                      adv_eps=1e-6, all_reduce=all_reduce or (lambda v, op="sum": list(v)), pad_id=0)


def test_signal_is_group_advantages_rule():
    # groups of 2: equal; unequal; all missing; one valid reward only; unequal
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, nan, nan, 0.5, nan, 0.2, 0.3])
    assert dynamic.group_signal(r, 2, scale="group", eps=1e-6).tolist() == [False, True, False, False, True]
    assert dynamic.group_signal(r, 2, scale="none", eps=1e-6).tolist() == [False, True, False, False, True]


def test_keeps_the_first_groups_with_signal_in_draw_order():
    G, need = 2, 3
    script = [[1, 1, 0, 1, nan, nan, 0.5, nan],  # round 0: only group 1 has signal (all-missing, one-valid: none)
              [0, 0, 1, 0, 0.2, 0.3, 1, 1],      # round 1: groups 1 and 2 -> 3 kept: stop
              [0, 1, 0, 1, 0, 1, 0, 1]]          # never drawn
    calls = []
    batch, ro, rewards, times = _sample(_draw(script, G, calls), need)
    assert calls == [0, 1]
    assert [(b["round"], b["group"]) for b in batch] == [(0, 1), (1, 1), (1, 2)]
    assert rewards.rewards.tolist() == pytest.approx([0, 1, 1, 0, 0.2, 0.3])
    assert rewards.per_function["f"] == pytest.approx([0, 1, 1, 0, 0.2, 0.3])
    assert times == {"time/generate": 2.0, "time/score": 0.5, "dynamic/rounds": 2, "dynamic/groups_drawn": 8,
                     "dynamic/groups_kept": 3, "dynamic/signal_frac": 3 / 8}
    # the batch's means are recomputed over its rows, the failure counts and times summed over rounds
    assert rewards.stats["reward/mean"] == pytest.approx(2.5 / 6) and rewards.stats["reward/errors"] == 2.0
    assert rewards.stats["reward/missing"] == 0.0 and rewards.stats["reward/f/mean"] == pytest.approx(2.5 / 6)
    # the rollout: whole groups of the rounds they came from, padded to the widest (T = 3 + round)
    assert ro.num_samples == 6 and ro.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert ro.completions == ["c0.2", "c0.3", "c1.2", "c1.3", "c1.4", "c1.5"]
    assert ro.completion_ids.shape == (6, 4) and ro.completion_lengths.tolist() == [3, 3, 4, 4, 4, 4]
    assert ro.completion_ids[0].tolist() == [20, 20, 20, 0] and ro.prompt_ids[:, 0].tolist() == [10, 10, 11, 11, 11, 11]
    from gspo import algo
    adv, _ = algo.group_advantages(rewards.rewards, G, scale="group", eps=1e-6)
    assert (adv.view(-1, G) != 0).any(-1).all()  # every kept group carries signal


def test_a_first_round_with_signal_everywhere_is_the_plain_rollout():
    script = [[0, 1, 1, 0, 0.5, 0.25]]
    calls = []
    draw = _draw(script, 2, calls)
    batch, ro, rewards, times = _sample(draw, 3)
    plain_batch, plain, plain_rewards, _ = draw(0)
    assert calls == [0, 0] and times["dynamic/rounds"] == 1 and times["dynamic/groups_kept"] == 3
    assert batch == plain_batch and torch.equal(rewards.rewards, plain_rewards.rewards)
    for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logp", "group_ids"):
        assert torch.equal(getattr(ro, f), getattr(plain, f)), f


def test_the_cap_fills_the_batch_with_groups_without_signal():
    # need 3; 1 group with signal in round 0, none in round 1; max 2 rounds
    script = [[1, 1, 0, 1, 0, 0], [nan, nan, 2, 2, 1, 1], [0, 1, 0, 1, 0, 1]]
    calls = []
    batch, ro, rewards, times = _sample(_draw(script, 2, calls), 3, max_rounds=2)
    assert calls == [0, 1]  # the cap: round 2 would have had signal, it is never drawn
    # the one group with signal, then the first groups without it, in draw order: (0,0), (0,2)
    assert [(b["round"], b["group"]) for b in batch] == [(0, 0), (0, 1), (0, 2)]
    assert ro.num_samples == 6  # exactly prompts_per_step groups
    assert times["dynamic/groups_kept"] == 1 and times["dynamic/groups_drawn"] == 6 and times["dynamic/rounds"] == 2
    from gspo import algo
    adv, _ = algo.group_advantages(rewards.rewards, 2, scale="group", eps=1e-6)
    assert (adv.view(-1, 2) != 0).any(-1).tolist() == [False, True, False]  # fillers: advantage 0


def test_processes_agree_on_the_rounds():
    """Two simulated processes (threads) whose all-reduces meet as Dist.all_reduce's would:
    rank 0 has its groups in round 0, rank 1 only after three rounds; both draw three, keep
    exactly `need` groups each, and make the same number of collective calls."""
    n, need = 2, 2
    scripts = [[[0, 1, 0, 1]] * 4,                                      # rank 0: 2 of 2 at once
               [[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 0, 1], [0, 1, 0, 1]]]  # rank 1: 0, 1, then 2 of 2
    ranks = SimulatedRanks(n)

    def one(r):
        def all_reduce(values, op="sum"):
            return [max(c) if op == "max" else sum(c) for c in zip(*ranks.exchange(r, list(values)))]
        rounds = []
        return _sample(_draw(scripts[r], 2, rounds), need, all_reduce=all_reduce), rounds

    out, calls = ranks.run(one), ranks.calls
    assert calls[0] == calls[1] == 4  # a "short anywhere?" check after each round, one sum of the metrics
    for r in range(n):
        (batch, ro, _, times), rounds = out[r]
        assert rounds == [0, 1, 2] and len(batch) == need and ro.num_samples == need * 2
        # over both processes: 2 x 3 rounds x 2 groups drawn; rank 0 keeps 2, rank 1 keeps 2
        assert times["dynamic/groups_drawn"] == 12 and times["dynamic/groups_kept"] == 4
    assert [b["round"] for b in out[1][0][0]] == [1, 2]


@pytest.mark.parametrize("failing_round", [0, 1, 2])
def test_a_round_that_raises_on_one_process_stops_every_process_there(failing_round):
    """Rank 1's round `failing_round` raises (a reward that raised): both ranks make the same
    collective calls up to it and raise there, rank 1 its own error and rank 0 ProcessFailed, so
    neither waits in a collective for the other. Round 2 is the last the cap allows, where no
    "short anywhere?" check followed the round before this agreement was added."""
    n, need = 2, 2
    script = [[1, 1, 1, 1]] * 3  # no signal anywhere: every rank wants all three rounds
    ranks = SimulatedRanks(n)

    def one(r):
        def all_reduce(values, op="sum"):
            return [max(c) if op == "max" else sum(c) for c in zip(*ranks.exchange(r, list(values)))]
        draw = _draw(script, 2)

        def failing(k):
            if r == 1 and k == failing_round:
                raise RuntimeError("the reward service is down")
            return draw(k)
        try:
            _sample(failing, need, max_rounds=3, all_reduce=all_reduce)
        except Exception as e:  # what each rank raised
            return e
        return None

    out = ranks.run(one)
    assert isinstance(out[0], dynamic.ProcessFailed)
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "the reward service is down"
    assert ranks.calls == [failing_round + 1] * 2  # one agreement per round, none after the fault


def test_each_round_has_its_own_seed_and_prompts():
    """produce's rounds (`sample_and_score`): round 0 samples from the plain rollout's seed,
    round k from chunk_seed(seed, rollout, k); each takes the prompt stream's next batch."""
    from gspo.data import PromptStream
    from gspo.rollout import chunk_seed
    from gspo.train.loop import TrainerState, sample_and_score

    cfg = load_config(None, ["rollout.group_size=2", "rollout.prompts_per_step=2", "seed=7"])
    seeds = []

    class Generator:
        def generate(self, prompts, G, *, seed, offset):
            seeds.append((seed, offset))
            return _rollout(len(prompts), G)

    class Rewards:
        def score(self, prompts, completions, columns):
            return _result([0.0] * len(completions))

    run = SimpleNamespace(cfg=cfg, chat=False, rewards=Rewards(), generator=Generator(), tools=None, tokenizer=None,
                          device="cpu", dist=SimpleNamespace(rank=0),
                          prompts=PromptStream([{"prompt": f"q{i}"} for i in range(6)], 2, seed=7, shuffle=False))
    state = TrainerState(rollout=5)
    batches = [sample_and_score(run, state, k)[0] for k in range(3)]
    assert seeds == [(chunk_seed(7, 5), 0), (chunk_seed(7, 5, 1), 0), (chunk_seed(7, 5, 2), 0)]
    assert len({s for s, _ in seeds}) == 3
    assert [[r["prompt"] for r in b] for b in batches] == [["q0", "q1"], ["q2", "q3"], ["q4", "q5"]]


def test_concat_rollouts_pads_and_keeps_optional_fields():
    a, b = _rollout(1, 2, P=2, T=2, tag=0), _rollout(1, 2, P=3, T=4, tag=1, lengths=[4, 1])
    b.loss_mask = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 0]])
    a.episode_stats, b.episode_stats = {"episode/turns_mean": 1.0}, {"episode/turns_mean": 2.0}
    a.policy_version, b.policy_version = torch.tensor([3, 3]), torch.tensor([4, 4])
    ro = concat_rollouts([a, b], pad_id=7)
    assert ro.prompt_ids.tolist() == [[7, 10, 10], [7, 10, 10], [11, 11, 11], [11, 11, 11]]  # left-padded
    assert ro.prompt_mask.tolist()[0] == [0, 1, 1]
    assert ro.completion_ids.tolist()[:2] == [[20, 20, 7, 7]] * 2  # right-padded
    assert ro.sampler_logp.tolist()[0] == [-1.0, -1.0, 0.0, 0.0]
    assert ro.loss_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0]]  # a's: its completion mask
    assert ro.model_lengths.tolist() == [2, 2, 3, 1]
    assert ro.group_ids.tolist() == [0, 0, 1, 1] and ro.policy_version.tolist() == [3, 3, 4, 4]
    assert ro.episode_stats == {"episode/turns_mean": 1.5} and ro.turns is None
    with pytest.raises(ValueError, match="whole groups"):
        concat_rollouts([a, _rollout(1, 3)], pad_id=0)


# ---------------------------------------------------------------- gspo train, through the CLI


def half_signal(prompts, completions, **kwargs):
    """The share of '1's on prompts that start with an even digit; 0.5 on the others, whose
    groups then have signal only from the overlong penalty (none when all four are cut)."""
    out = []
    for p, c in zip(prompts, completions):
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(0.5 if p[:1] in "13579" else text.count("1") / max(len(text), 1))
    return out


DYNAMIC = ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_rounds=3", "schedule.rollouts=2",
           "eval.enabled=false", "rewards.functions=[{name: 'test_dynamic_sampling:half_signal'}]",
           "rewards.overlong_penalty=0.5", "rewards.overlong_buffer=2"]  # free up to 4 - 2 = 2 tokens


def _groups(run_dir, G=4):
    out = []
    for p in sorted((run_dir / "completions").glob("*.jsonl")):
        rows = [json.loads(x) for x in p.read_text().splitlines()]
        out.append([rows[i:i + G] for i in range(0, len(rows), G)])
    return out


def _rollout_metrics(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["step"] % 2 == 0]  # the last step of each rollout (2 minibatches)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dyn")
    gspo_train(tmp, "run", *DYNAMIC)
    return tmp / "run"


def test_dynamic_run_keeps_groups_with_signal_and_the_batch_size(straight):
    metrics, groups = _rollout_metrics(straight), _groups(straight)
    assert len(metrics) == len(groups) == 2
    for m, batch in zip(metrics, groups):
        assert len(batch) == 4 and all(len(g) == 4 for g in batch)  # prompts_per_step groups of G, always
        with_signal = [g for g in batch if len({r["reward"] for r in g}) > 1]
        assert len(with_signal) == m["dynamic/groups_kept"]
        for g in batch:  # a group has nonzero advantages exactly when its rewards differ
            assert any(r["advantage"] != 0 for r in g) == (g in with_signal)
        assert m["dynamic/groups_drawn"] == 4 * m["dynamic/rounds"]
        assert m["dynamic/groups_kept"] == 4 or m["dynamic/rounds"] == 3  # full, or the cap was hit
        for r in (r for g in batch for r in g):  # 0 up to 2 tokens, -0.25 at 3, -0.5 at 4 (cut: the full penalty)
            pen = r["rewards"]["overlong_penalty"]
            assert pen in (0.0, -0.25, -0.5) and (pen == -0.5 or r["finish_reason"] == "eos")
            assert r["reward"] == pytest.approx(r["rewards"]["half_signal"] + pen)


def test_dynamic_run_resumes_exactly(tmp_path, straight):
    p = gspo_train(tmp_path, "run", *DYNAMIC, faults="exit_after_rollout=1", check=False)
    assert p.returncode == 3
    gspo_train(tmp_path, "run", *DYNAMIC, "resume=auto")
    assert_same_run(straight, tmp_path / "run")


def rank_signal(prompts, completions, signal=None, **kwargs):
    """The share of '1's where the row's `signal` column is true, else 0.0 (no signal); the call
    that `gspo_test_rewards.raise_when_told` picks raises."""
    from gspo_test_rewards import raise_when_told

    raise_when_told()
    out = []
    for c, s in zip(completions, signal):
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(text.count("1") / max(len(text), 1) if s else 0.0)
    return out


def _launch_two(out, name, env_extra=None, *extra):
    """2 torchrun processes (gloo, FSDP2), unshuffled: rank 0 gets rows 0-1 of every 4, whose
    groups never have signal, so it hits the cap (3 rounds) every rollout; rank 1 gets rows 2-3."""
    from test_distributed import RUN, _env
    from zygote import gspo_torchrun

    data = out / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "signal": i % 4 >= 2}) + "\n" for i in range(8)))
    args = ["train", *RUN, f"output.dir={out}", f"output.name={name}", "rollout.dynamic_sampling=true",
            "rollout.dynamic_sampling_max_rounds=3", "schedule.rollouts=3", "eval.enabled=false", f"data.source={data}",
            "data.shuffle=false", "rewards.functions=[{name: 'test_dynamic_sampling:rank_signal'}]",
            "distributed.timeout_s=60", "checkpoint.every=0", *extra]
    return gspo_torchrun(2, args, env={**_env(), **(env_extra or {})}, timeout=600)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("dyn2")
    p = _launch_two(out, "two")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return out / "two"


def test_two_processes_agree_on_rounds_and_keep_their_batch(two):
    """Rank 1, which may need fewer rounds, must draw as many as rank 0 (else their collectives
    would not meet)."""
    metrics = _rollout_metrics(two)
    assert len(metrics) == 3
    for m in metrics:  # 3 rounds x 2 processes x 2 groups; only rank 1's can be kept
        assert (m["dynamic/rounds"], m["dynamic/groups_drawn"]) == (3, 12) and m["dynamic/groups_kept"] <= 2
    for batch in _groups(two):  # both ranks' rows, in rank order: 2 groups each
        assert len(batch) == 4
        assert all(r["advantage"] == 0 and r["prompt"][0] in "0145" for g in batch[:2] for r in g)  # rank 0's fillers
        assert all(r["prompt"][0] in "2367" for g in batch[2:] for r in g)  # rank 1's


def test_a_reward_that_raises_on_one_process_mid_rounds_saves_both_and_resume_is_exact(two, tmp_path):
    """The reward raises on rank 1 alone in the second round of rollout 2 (its 5th call), with no
    checkpoint due: both processes stop there together, each saves its part of the state after
    rollout 1, and resume=auto trains what the uninterrupted run trains, bitwise."""
    from test_distributed import final
    from test_resume import metrics_without_timings, sampled_prompts

    env = {"GSPO_TEST_CALLS_FILE": str(tmp_path / "calls"), "GSPO_TEST_RAISE_AT": "5", "GSPO_TEST_RAISE_RANK": "1"}
    p = _launch_two(tmp_path, "res", env)
    assert p.returncode != 0 and "the reward service is down" in p.stderr
    assert "another process failed while rollout 2 was produced" in p.stderr  # rank 0's own stop
    assert "saved the state after rollout 1" in p.stderr
    ck = tmp_path / "res" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-2" and (ck / "step-2" / "COMPLETE").is_file()
    p = _launch_two(tmp_path, "res", env, "resume=auto")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    a, b = final(tmp_path / "res"), final(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics_without_timings(tmp_path / "res") == metrics_without_timings(two)
    assert sampled_prompts(tmp_path / "res") == sampled_prompts(two)
