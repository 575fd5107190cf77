"""Reliability of the trainer: exact resume, kills mid-save, signals, non-finite steps, bad rewards.

Faults are injected with `GSPO_FAULTS` (see gspo/faults.py) into real `gspo train` processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo.cli import main
from gspo.config import load_config
from gspo.train.checkpoint import find_resume_checkpoint
from zygote import gspo, gspo_popen

TESTS = Path(__file__).parent
# 8 prompts at 4 per rollout: an epoch is 2 rollouts, so resuming after rollout 2 crosses an epoch boundary
TINY = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=8",         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "schedule.rollouts=4", "schedule.num_minibatches=2", "eval.num_prompts=4", "eval.every=3",
        "logging.console=false", "logging.completions_every=1", "checkpoint.every=1", "checkpoint.keep_last=10",
        "rollout.temperature=1.5", "optim.lr=1e-3",
        "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]"]  # a reward a random model can move


def _env(faults: str = "") -> dict:
    path = os.pathsep.join(x for x in [str(TESTS), os.environ.get("PYTHONPATH", "")] if x)
    return {**os.environ, "GSPO_FAULTS": faults, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": path}


def gspo_train(tmp_path: Path, name: str, *extra: str, faults: str = "", check: bool = True):
    env = _env(faults)
    p = gspo(["train", *TINY, f"output.dir={tmp_path}", f"output.name={name}", *extra], env=env, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def metrics_without_timings(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if "time" not in k and k != "tokens_per_s"})
    return out


def sampled_prompts(run_dir: Path) -> dict[str, list[str]]:
    return {p.name: [json.loads(x)["prompt"] + "|" + json.loads(x)["completion"] for x in p.read_text().splitlines()]
            for p in sorted((run_dir / "completions").glob("*.jsonl"))}


def final_state(run_dir: Path):
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    ck = run_dir / "checkpoints" / latest
    model = load_file(ck / "model.safetensors")
    optim = torch.load(ck / "optimizer.pt", weights_only=True)
    return model, optim


def assert_same_run(a: Path, b: Path) -> None:
    ma, oa = final_state(a)
    mb, ob = final_state(b)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k          # bitwise
    for pid, st in oa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob["state"][pid][k]), (pid, k)
    assert metrics_without_timings(a) == metrics_without_timings(b)
    assert sampled_prompts(a) == sampled_prompts(b)
    assert load_file(a / "final" / "model.safetensors").keys() == load_file(b / "final" / "model.safetensors").keys()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    gspo_train(tmp, "run")
    return tmp / "run"


@pytest.mark.parametrize("stop_after", [2, 3])  # 2: at the epoch boundary; 3: mid-epoch, right after an eval
def test_kill_and_resume_is_bitwise_identical(tmp_path, straight, stop_after):
    p = gspo_train(tmp_path, "run", faults=f"exit_after_rollout={stop_after}", check=False)
    assert p.returncode == 3  # died without finishing
    assert not (tmp_path / "run" / "final").exists()
    p = gspo_train(tmp_path, "run", "resume=auto")
    assert "differ from the checkpoint" not in p.stderr  # the same settings (its "auto" ones resolved)
    assert_same_run(straight, tmp_path / "run")


def test_a_resume_with_changed_settings_says_which(tmp_path):
    gspo_train(tmp_path, "run", "schedule.rollouts=2", faults="exit_after_rollout=1", check=False)
    p = gspo_train(tmp_path, "run", "schedule.rollouts=2", "resume=auto", "optim.lr=0.01", "rollout.group_size=2")
    assert "settings that differ from the checkpoint's: rollout.group_size: 4 -> 2; optim.lr: 0.001 -> 0.01" \
        in p.stderr, p.stderr[-2000:]
    # the optimizer's state brought its lr back: the run's config records that one, not 0.01, which never acted
    assert "optim.lr stay the checkpoint's" in p.stderr
    assert load_config(tmp_path / "run" / "config.yaml").optim.lr == 0.001
    assert {r["lr"] for r in metrics_without_timings(tmp_path / "run") if "lr" in r} == {0.001}
    p = gspo_train(tmp_path, "run", "schedule.rollouts=3", "resume=auto", "lora.enabled=true", check=False)
    assert p.returncode == 2 and "config field 'lora.enabled': a resume continues the checkpoint's model" in p.stderr


def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path, straight):
    # rollout 3 ends at optimizer step 6: kill -9 while that checkpoint is half written
    p = gspo_train(tmp_path, "run", faults="kill_in_save=6", check=False)
    assert p.returncode == -signal.SIGKILL
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-4"
    assert any(x.name.startswith(".tmp-step-6") for x in ck.iterdir())  # the half-written one
    gspo_train(tmp_path, "run", "resume=auto")
    assert not any(x.name.startswith(".tmp-") for x in ck.iterdir())
    assert_same_run(straight, tmp_path / "run")


def test_a_run_killed_before_its_first_checkpoint_starts_over_under_resume_auto(tmp_path, straight):
    """Without a whole checkpoint (checkpoint.every=0: only at the end, and the process died by
    os._exit after rollout 2) there is nothing to resume: resume=auto starts the run again, the
    stopped run's files set aside, and trains what the uninterrupted run trained."""
    p = gspo_train(tmp_path, "run", "checkpoint.every=0", faults="exit_after_rollout=2", check=False)
    assert p.returncode == 3 and not (tmp_path / "run" / "checkpoints").exists()
    stale = (tmp_path / "run" / "metrics.jsonl").read_text()
    p = gspo_train(tmp_path, "run", "checkpoint.every=0", "resume=auto")
    assert "holds no whole checkpoint" in p.stderr
    aside = [x for x in (tmp_path / "run").iterdir() if x.name.startswith("stopped-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == stale
    assert metrics_without_timings(tmp_path / "run") == metrics_without_timings(straight)
    a, b = load_file(tmp_path / "run" / "final" / "model.safetensors"), load_file(straight / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    p = gspo_train(tmp_path, "again", "checkpoint.every=0", faults="exit_after_rollout=1", check=False)
    p = gspo_train(tmp_path, "again", "checkpoint.every=0", check=False)  # without resume=auto: refused
    assert p.returncode == 2 and "already holds a run; continue it with resume=auto" in p.stderr


def test_a_restart_sets_aside_only_what_the_run_wrote(tmp_path):
    """A run directory that also held the user's own files (here: the model folder itself) had
    them all moved into stopped-<time>/ by the restart, model included, which then failed."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    (mine / "NOTES.txt").write_text("my notes")
    p = gspo_train(tmp_path, "mine", "checkpoint.every=0", "schedule.rollouts=2", faults="exit_after_rollout=1",
                   check=False)
    assert p.returncode == 3 and "already holds files no gspo run wrote (NOTES.txt, config.json)" in p.stderr
    p = gspo_train(tmp_path, "mine", "checkpoint.every=0", "schedule.rollouts=2", "resume=auto")
    assert "holds no whole checkpoint" in p.stderr and "no gspo run wrote" not in p.stderr
    assert (mine / "NOTES.txt").read_text() == "my notes" and (mine / "config.json").is_file()
    aside = next(x for x in mine.iterdir() if x.name.startswith("stopped-"))
    assert sorted(x.name for x in aside.iterdir()) == ["completions", "config.yaml", "metrics.jsonl"]


def test_a_kill_while_final_is_written_leaves_no_final_and_resume_writes_it(tmp_path, straight):
    p = gspo_train(tmp_path, "run", faults="kill_in_final=1", check=False)
    assert p.returncode == -signal.SIGKILL
    run = tmp_path / "run"
    assert not (run / "final").exists() and (run / "final.partial" / "model.safetensors").is_file()
    p = gspo_train(tmp_path, "run", "resume=auto")
    assert "final/ was not whole and is written again" in p.stdout + p.stderr
    assert not (run / "final.partial").exists()
    a, b = load_file(run / "final" / "model.safetensors"), load_file(straight / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (run / "final" / "tokenizer_config.json").is_file()


def test_resume_of_finished_run_exits_0_without_training(tmp_path):
    gspo_train(tmp_path, "run", "schedule.rollouts=1")
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    p = gspo_train(tmp_path, "run", "schedule.rollouts=1", "resume=auto")
    assert "already finished" in p.stdout + p.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_a_finished_run_given_more_rollouts_trains_on_to_what_a_straight_run_trains(tmp_path, straight):
    """A finished run of 2 rollouts, resumed with schedule.rollouts=4 (the straight run's), continues
    from its last checkpoint: the same weights and optimizer state as the run of 4, bitwise, and a
    final/ that is the longer run's."""
    gspo_train(tmp_path, "run", "schedule.rollouts=2")
    p = gspo_train(tmp_path, "run", "resume=auto")
    assert "finished at rollout 2; schedule.rollouts=4 extends it" in p.stdout
    assert "differ from the checkpoint" not in p.stderr  # schedule.rollouts is what a resume may change
    run = tmp_path / "run"
    (m1, o1), (m2, o2) = final_state(run), final_state(straight)
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)  # bitwise
    assert all(torch.equal(v, o2["state"][pid][k]) for pid, st in o1["state"].items() for k, v in st.items())
    a, b = load_file(run / "final" / "model.safetensors"), load_file(straight / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)  # final/ is the longer run's

    def without_eval(d: Path) -> list[dict]:  # the 2-rollout run also evaluated at its end
        return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in metrics_without_timings(d)]

    assert without_eval(run) == without_eval(straight)  # every step once, with the same values
    assert sampled_prompts(run) == sampled_prompts(straight)


FAILING_REWARD = "rewards.functions=[{name: 'gspo_test_rewards:count_ones_until_told'}]"


def failing_reward_env(env: dict, tmp_path: Path, at: int, rank: int | None = None) -> dict:
    """`env` for FAILING_REWARD: count_ones, except that its call number `at` raises (on `rank`
    alone under torchrun)."""
    return {**env, "GSPO_TEST_CALLS_FILE": str(tmp_path / "calls"), "GSPO_TEST_RAISE_AT": str(at),
            **({"GSPO_TEST_RAISE_RANK": str(rank)} if rank is not None else {})}


def as_count_ones(records: list[dict]) -> list[dict]:
    """Metric records of a FAILING_REWARD run under count_ones' names, to compare with a run of it."""
    return [{k.replace("count_ones_until_told", "count_ones"): v for k, v in r.items()} for r in records]


def test_a_reward_that_raises_keeps_the_rollouts_before_it_and_resume_is_exact(tmp_path, straight):
    """No checkpoint is due (checkpoint.every=0) when the reward raises while rollout 3 is scored:
    the state after rollout 2 is saved before the run stops, and resume=auto then trains to what
    the uninterrupted run trains, bitwise."""
    env = failing_reward_env(_env(), tmp_path, 4)  # call 1 is the evaluation at the start
    common = ["train", *TINY, f"output.dir={tmp_path}", "output.name=run", "checkpoint.every=0", FAILING_REWARD]
    p = gspo(common, env=env, timeout=300)
    assert p.returncode != 0 and "the reward service is down" in p.stderr
    assert "saved the state after rollout 2" in p.stderr
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-4"  # 2 rollouts x 2 minibatches
    p = gspo([*common, "resume=auto"], env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "differ from the checkpoint" not in p.stderr
    (m1, o1), (m2, o2) = final_state(tmp_path / "run"), final_state(straight)
    assert all(torch.equal(m1[k], m2[k]) for k in m2)  # count_ones' values: the straight run's rewards
    assert all(torch.equal(v, o2["state"][pid][k]) for pid, st in o1["state"].items() for k, v in st.items())
    assert sampled_prompts(tmp_path / "run") == sampled_prompts(straight)


def test_a_reward_that_raises_in_the_held_out_evaluation_keeps_that_rollout(tmp_path, straight):
    """The reward raises in the evaluation after rollout 3 (call 5; checkpoint.every=0): rollout 3's
    update is kept, its metrics logged without the evaluation's, and resume=auto trains on to the
    uninterrupted run's weights. It used to stop with every rollout since the start lost."""
    env = failing_reward_env(_env(), tmp_path, 5)
    common = ["train", *TINY, f"output.dir={tmp_path}", "output.name=run", "checkpoint.every=0", FAILING_REWARD]
    p = gspo(common, env=env, timeout=300)
    assert p.returncode != 0 and "the reward service is down" in p.stderr
    assert "held-out evaluation after rollout 3 failed; saved the state after that rollout" in p.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in lines if "loss" in r][-1] == 3 and "eval/accuracy" not in lines[-1]
    assert gspo([*common, "resume=auto"], env=env, timeout=300).returncode == 0
    (m1, o1), (m2, o2) = final_state(tmp_path / "run"), final_state(straight)
    assert all(torch.equal(m1[k], m2[k]) for k in m2)
    assert all(torch.equal(v, o2["state"][pid][k]) for pid, st in o1["state"].items() for k, v in st.items())


def test_corrupt_checkpoints_are_skipped_or_fatal(tmp_path):
    gspo_train(tmp_path, "run", "schedule.rollouts=3", faults="exit_after_rollout=2", check=False)
    ck = tmp_path / "run" / "checkpoints"
    newest = ck / (ck / "latest").read_text().strip()
    with open(newest / "model.safetensors", "r+b") as f:
        f.truncate(100)
    p = gspo_train(tmp_path, "run", "schedule.rollouts=3", "resume=auto")
    assert newest.name == "step-4" and newest.name in p.stderr  # the warning names the skipped checkpoint
    assert "resumed from" in p.stdout + p.stderr and "step-2" in p.stdout + p.stderr
    # every checkpoint corrupt: an error, never a silent restart from step 0
    for d in ck.glob("step-*"):
        (d / "COMPLETE").unlink()
    p = gspo_train(tmp_path, "run", "schedule.rollouts=3", "resume=auto", check=False)
    assert p.returncode != 0 and "none is complete" in p.stderr


def test_sigterm_checkpoints_and_resumes(tmp_path):
    env = _env()
    proc = gspo_popen(["train", *TINY, "schedule.rollouts=200", "checkpoint.every=0", f"output.dir={tmp_path}",
                       "output.name=run"], env=env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by signal" in out + err
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()
    p = gspo_train(tmp_path, "run", "schedule.rollouts=200", "checkpoint.every=0", "resume=auto",
                   faults="exit_after_rollout=" + str(_last_rollout(metrics) + 1), check=False)
    assert p.returncode == 3 and "resumed from" in p.stdout + p.stderr


def _last_rollout(metrics: Path) -> int:
    return max(json.loads(x).get("rollout", 0) for x in metrics.read_text().splitlines())


def test_non_finite_loss_skips_the_step(tmp_path):
    # optimizer step 2 gets a NaN loss: skipped, counted, the run goes on with finite numbers
    gspo_train(tmp_path, "run", "schedule.rollouts=2", "checkpoint.every=0", faults="nan_loss_at=2")
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["train/skipped_steps"] for r in recs] == [0, 1, 1, 1]
    assert all(torch.isfinite(torch.tensor(r["ratio/seq_mean"])) for r in recs)
    for v in load_file(tmp_path / "run" / "final" / "model.safetensors").values():
        assert torch.isfinite(v).all()


def test_repeated_non_finite_steps_stop_with_a_checkpoint(tmp_path):
    p = gspo_train(tmp_path, "run", "checkpoint.max_bad_steps=3", "checkpoint.every=0", faults="nan_loss_from=3",
                   check=False)
    assert p.returncode == 1 and "non-finite" in p.stderr
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").exists()
    for v in load_file(ck / (ck / "latest").read_text().strip() / "model.safetensors").values():
        assert torch.isfinite(v).all()


def test_reward_that_raises_fails_fast_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    rc = main(["train", *TINY, f"output.dir={tmp_path}", "output.name=run", "eval.enabled=false",
               "rewards.functions=[{name: 'gspo_test_rewards:always_raises'}]"])
    err = capsys.readouterr().err
    assert rc == 1 and "always_raises" in err


@pytest.mark.parametrize("policy", ["skip", "zero"])
def test_reward_errors_and_hangs_are_counted_under_a_policy(tmp_path, monkeypatch, capsys, policy):
    monkeypatch.syspath_prepend(str(TESTS))
    rc = main(["train", *TINY, f"output.dir={tmp_path}", "output.name=run", "eval.enabled=false",
               "schedule.rollouts=1", "checkpoint.every=0", f"rewards.on_error={policy}", "rewards.timeout_s=1",
               "rewards.functions=[{name: 'gspo_test_rewards:hangs'}, {name: 'gspo_test_rewards:always_raises'}]"])
    assert rc == 0
    rec = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["reward/timeouts"] > 0 and rec["reward/errors"] > 0
    assert rec["loss"] is not None  # finite: None would mean NaN or inf
    n = int(rec["reward/timeouts"] + rec["reward/errors"])
    err = capsys.readouterr().err  # the failures the policy tolerated are said, not only counted
    assert f"rollout 1: {n} rewards failed in this rollout" in err and f"rewards.on_error={policy}" in err
    assert "this reward function always fails" in err or "timed out" in err
    if policy == "skip":
        assert rec["adv/frac_zero_std"] == 1.0  # every reward missing: no signal, advantages 0
        assert "every reward was missing" in err and "rewards were equal" not in err


def test_degenerate_rollouts_give_finite_loss(tmp_path, monkeypatch, capsys):
    """All rewards missing; every completion truncated at one token; empty completions in the update."""
    monkeypatch.syspath_prepend(str(TESTS))
    rc = main(["train", *TINY, f"output.dir={tmp_path}", "output.name=run", "eval.enabled=false",
               "schedule.rollouts=1", "checkpoint.every=0", "rollout.max_new_tokens=1",
               "rewards.functions=[{name: 'gspo_test_rewards:none_for_all'}]"])
    assert rc == 0
    rec = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["reward/missing"] > 0 and rec["adv/frac_zero_std"] == 1.0
    assert rec["loss"] == 0.0 and rec["grad_norm"] == 0.0
    err = capsys.readouterr().err
    assert "every reward was missing" in err and "rewards failed" not in err  # None is no failure


def test_a_run_directory_another_live_process_runs_in_is_refused(tmp_path):
    """Two runs into one directory at once would interleave metrics.jsonl and overwrite each
    other's checkpoints: the second is refused before its model loads, while the first's
    process lives; a lock left by a dead process is stale. A finished run leaves no lock."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / ".lock").write_text(f"{holder.pid}\n")
        p = gspo_train(tmp_path, "run", check=False)
        assert p.returncode == 2 and f"is in use by another gspo process (pid {holder.pid})" in p.stderr
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    gspo_train(tmp_path, "run", "schedule.rollouts=1")  # the holder is gone: its lock is stale
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_first_signal_is_acknowledged_and_a_second_stops_at_once_without_a_traceback(tmp_path, monkeypatch,
                                                                                       capsys):
    """The first Ctrl-C said nothing, so users pressed again, and the second raised a bare
    KeyboardInterrupt (a traceback, and the rollout in progress lost without a word)."""
    from gspo import cli
    from gspo.train.stops import Interrupted, StopRequest

    run = tmp_path / "run"
    with StopRequest(say=True, run_dir=run) as stop:
        stop._handle(signal.SIGINT, None)
        assert stop.signum == signal.SIGINT
        with pytest.raises(Interrupted, match="it had no checkpoint yet: resume=auto starts it over") as stopped:
            stop._handle(signal.SIGINT, None)
    assert "loses all of the run's work (it has no checkpoint yet)" in capsys.readouterr().err
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-4\n")
    with StopRequest(say=True, run_dir=run) as stop:
        stop._handle(signal.SIGINT, None)
        with pytest.raises(Interrupted, match="its checkpoint step-4 is intact"):
            stop._handle(signal.SIGINT, None)
    assert "loses the work since checkpoint step-4" in capsys.readouterr().err
    with StopRequest(say=True, run_dir=run) as stop:  # a SIGTERM's message named Ctrl-C
        stop._handle(signal.SIGTERM, None)
        with pytest.raises(Interrupted, match="its checkpoint step-4 is intact"):
            stop._handle(signal.SIGTERM, None)
    err = capsys.readouterr().err
    assert "gspo: SIGTERM: stopping after the rollout in progress" in err and "Ctrl-C stops" not in err
    assert "a second SIGTERM (or a Ctrl-C) stops at once and loses the work since checkpoint step-4" in err

    def interrupted(args):
        raise stopped.value

    monkeypatch.setattr(cli, "cmd_train", interrupted)
    assert cli.main(["train", *TINY]) == 130
    err = capsys.readouterr().err
    assert "stopped at once by a second signal; it had no checkpoint yet: resume=auto starts it over" in err


def test_checkpoints_are_also_saved_by_time(tmp_path):
    """checkpoint.every=0 saved nothing before the end, so a killed process lost the whole run;
    checkpoint.every_minutes (default 30) bounds what it can lose."""
    p = gspo_train(tmp_path, "run", "schedule.rollouts=3", "checkpoint.every=0", "checkpoint.every_minutes=1e-6")
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(x.name for x in ck.glob("step-*")) == ["step-2", "step-4", "step-6"], p.stderr[-2000:]
    gspo_train(tmp_path, "untimed", "schedule.rollouts=3", "checkpoint.every=0", "checkpoint.every_minutes=0")
    assert sorted(x.name for x in (tmp_path / "untimed" / "checkpoints").glob("step-*")) == ["step-6"]


def test_a_lost_process_of_the_job_is_one_stop_message_naming_what_is_kept(tmp_path, monkeypatch):
    """When one rank was SIGKILLed, the survivor printed gloo's traceback ('Read error ...
    Connection reset by peer'), with no word on the checkpoint: it now stops with one message."""
    import gspo.train.loop as loop
    from gspo.config import load_config
    from gspo.train.run import build_run

    assert loop.peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [...]: Connection reset by peer"))
    assert not loop.peer_lost(RuntimeError("CUDA out of memory"))
    monkeypatch.syspath_prepend(str(TESTS))
    cfg = load_config(None, [*TINY, f"output.dir={tmp_path}", "output.name=run", "eval.enabled=false"])
    run = build_run(cfg)

    def lost(*a, **k):  # as a torchrun rank whose peer died while it sampled
        monkeypatch.setattr(type(run.dist), "enabled", property(lambda self: True))
        raise RuntimeError("[pair.cc:534] Read error [127.0.0.1]:29500: Connection reset by peer")

    monkeypatch.setattr(loop, "produce_or_save", lost)
    with pytest.raises(loop.TrainingError, match=r"another process of the job is gone .*it had no checkpoint yet"):
        loop.train(cfg, run=run)


def test_a_logging_fault_after_an_update_keeps_that_update(tmp_path, straight, monkeypatch, capsys):
    """A tracker or the console that fails after rollout 2's update (rich's MarkupError did, on a
    Llama-2 prompt) no longer loses the rollouts since the last checkpoint: the state after the
    update is saved before the error goes on, and resume=auto trains on to the straight run."""
    import gspo.train.loop as loop

    real = loop.log_step

    def failing(run, sinks, console, state, *a, **kw):
        if state.rollout == 2 and run.cfg.output.name == "run":
            raise ValueError("the tracker's server went away")
        if state.rollout == 3 and run.cfg.output.name == "piped":
            raise SystemExit(1)  # what rich's console does on a broken pipe (gspo train ... | head)
        return real(run, sinks, console, state, *a, **kw)

    monkeypatch.setattr(loop, "log_step", failing)
    monkeypatch.syspath_prepend(str(TESTS))
    rc = main(["train", *TINY, f"output.dir={tmp_path}", "output.name=run", "checkpoint.every=0"])
    assert rc != 0 and "went away" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", *TINY, f"output.dir={tmp_path}", "output.name=piped", "checkpoint.every=0", "resume=auto"])
    assert json.loads((find_resume_checkpoint(tmp_path / "piped") / "trainer_state.json").read_text())["rollout"] == 3
    ck = find_resume_checkpoint(tmp_path / "run")
    assert json.loads((ck / "trainer_state.json").read_text())["rollout"] == 2
    monkeypatch.setattr(loop, "log_step", real)
    gspo_train(tmp_path, "run", "checkpoint.every=0", "resume=auto")
    (ma, _), (mb, _) = final_state(straight), final_state(tmp_path / "run")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_a_resume_follows_the_schedule_it_is_given_from_its_first_step(tmp_path):
    """A finished cosine run extended by a rollout ran its first new step at the old schedule's
    last rate, 0 (a lost rollout), though the schedule was said to be stretched; a changed
    schedule.lr_schedule acted one step late. Unchanged settings keep the saved rates (the
    resume tests above are bitwise)."""
    from gspo.config import load_config
    from gspo.train.run import lr_lambda

    cosine = ["schedule.lr_schedule=cosine", "eval.enabled=false"]
    gspo_train(tmp_path, "run", *cosine, "schedule.rollouts=2")
    gspo_train(tmp_path, "run", *cosine, "schedule.rollouts=3", "resume=auto")
    lrs = {r["step"]: r["lr"] for r in metrics_without_timings(tmp_path / "run") if "lr" in r}
    stretched = lr_lambda(load_config(None, [*TINY, *cosine, "schedule.rollouts=3"]))
    assert lrs[5] == pytest.approx(1e-3 * stretched(4)) and lrs[5] > 0 and lrs[6] == pytest.approx(1e-3 * stretched(5))
    gspo_train(tmp_path, "const", "eval.enabled=false", "schedule.rollouts=2")
    gspo_train(tmp_path, "const", *cosine, "schedule.rollouts=3", "resume=auto")
    lrs = {r["step"]: r["lr"] for r in metrics_without_timings(tmp_path / "const") if "lr" in r}
    assert lrs[4] == 1e-3 and lrs[5] == pytest.approx(1e-3 * stretched(4))
