"""Async mode (rollout.mode=async, gspo.train.async_mode): generator processes sample while the
learner trains. Exactness against sync mode, bounded staleness, exact resume with rollouts in
flight, and the faults: a killed or hung generator, a dead learner, bad settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo.config import ConfigError, load_config
from gspo.rollout import Rollout
from gspo.train import async_job, async_mode, async_wire
from gspo.train.checkpoint import find_resume_checkpoint, verify_checkpoint
from test_resume import (FAILING_REWARD, TINY, _env, as_count_ones, failing_reward_env, gspo_train,
                         metrics_without_timings)
from zygote import gspo, gspo_popen, gspo_torchrun

ASYNC = ["rollout.mode=async"]


def final_params(run_dir: Path) -> dict:
    return load_file(run_dir / "final" / "model.safetensors")


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def comparable(run_dir: Path) -> list[dict]:
    """metrics.jsonl without timings and async mode's own bookkeeping."""
    return [{k: v for k, v in r.items() if not k.startswith("async/")} for r in metrics_without_timings(run_dir)]


def versions(run_dir: Path) -> dict[int, set[int]]:
    """The policy version of every sampled row, per rollout (completions/ has every rollout)."""
    out = {}
    for f in sorted((run_dir / "completions").glob("*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        step = rows[0]["step"]
        out[step] = {r["policy_version"] for r in rows}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One sync run and async runs with K = 0 and K = 2, on the same settings."""
    tmp = tmp_path_factory.mktemp("async")
    gspo_train(tmp, "sync")
    gspo_train(tmp, "k0", *ASYNC, "rollout.max_staleness=0")
    gspo_train(tmp, "k2", *ASYNC, "rollout.max_staleness=2")
    return tmp


def test_async_with_no_staleness_trains_the_same_parameters_as_sync(runs):
    assert_same_params(runs / "sync", runs / "k0")  # bitwise
    assert comparable(runs / "sync") == comparable(runs / "k0")
    stale = [r["async/staleness_max"] for r in metrics_without_timings(runs / "k0") if "async/staleness_max" in r]
    assert stale and set(stale) == {0.0}


def test_staleness_is_bounded_and_every_row_carries_the_version_that_sampled_it(runs):
    recs = [r for r in metrics_without_timings(runs / "k2") if "async/staleness_max" in r]
    by_rollout = {r["rollout"]: (r["async/staleness_mean"], r["async/staleness_max"]) for r in recs}
    # rollout r (1-based in the log) was sampled by the weights after rollout max(0, r-1-K)
    assert by_rollout == {r: (float(min(r - 1, 2)),) * 2 for r in range(1, 5)}
    steps_per_rollout = 2
    assert versions(runs / "k2") == {r * steps_per_rollout: {max(0, r - 1 - 2)} for r in range(1, 5)}
    assert versions(runs / "sync") == {r * steps_per_rollout: {r - 1} for r in range(1, 5)}
    # stale rollouts are off-policy from the first minibatch on: the sampler/trainer gap shows it
    gap = {r["rollout"]: r["mismatch/token_abs_max"] for r in recs}
    assert gap[1] < 1e-5 and gap[4] > 1e-3
    pa, pb = final_params(runs / "k2"), final_params(runs / "sync")
    assert any(not torch.equal(pa[k], pb[k]) for k in pa)


def test_sigkill_then_resume_is_exact_with_rollouts_in_flight(runs, tmp_path):
    p = gspo_train(tmp_path, "run", *ASYNC, "rollout.max_staleness=2", faults="exit_after_rollout=2", check=False)
    assert p.returncode == 3
    ck = find_resume_checkpoint(tmp_path / "run")
    # rollouts 3 and 4 were sampled (by older weights) before the checkpoint: it holds them
    assert sorted(f.name for f in (ck / "inflight").iterdir()) == ["rollout-2.safetensors", "rollout-3.safetensors"]
    gspo_train(tmp_path, "run", *ASYNC, "rollout.max_staleness=2", "resume=auto")
    assert_same_params(runs / "k2", tmp_path / "run")
    assert comparable(runs / "k2") == comparable(tmp_path / "run")


def test_a_resume_with_a_lower_staleness_samples_again_what_is_now_too_stale(tmp_path):
    """Killed after rollout 2 at K = 2, with rollouts 3 and 4 in flight (sampled by version 0 and
    1), resumed at K = 0: they were trained on all the same (staleness 2 logged under a config
    that says 0). Now they are sampled again, and every later rollout is on-policy."""
    p = gspo_train(tmp_path, "run", *ASYNC, "rollout.max_staleness=2", faults="exit_after_rollout=2", check=False)
    assert p.returncode == 3
    p = gspo_train(tmp_path, "run", *ASYNC, "rollout.max_staleness=0", "resume=auto")
    assert "rollouts 3.. in flight were sampled more than rollout.max_staleness=0 versions before" in p.stderr
    later = [r["async/staleness_max"] for r in metrics_without_timings(tmp_path / "run")
             if "async/staleness_max" in r and r["rollout"] > 2]
    assert later and set(later) == {0.0}


def test_a_reward_that_raises_keeps_the_rollouts_in_flight_and_resume_is_exact(runs, tmp_path):
    """No checkpoint is due when the reward raises on rollout 3 (K = 2): the state after rollout 2
    is saved with rollouts 3 and 4, both sampled by older weights, and resume=auto trains what
    the uninterrupted run trains, bitwise."""
    env = failing_reward_env(_env(), tmp_path, 4)  # the learner scores: call 1 is the evaluation at the start
    common = ["train", *TINY, f"output.dir={tmp_path}", "output.name=run", "checkpoint.every=0", FAILING_REWARD,
              *ASYNC, "rollout.max_staleness=2"]
    p = gspo(common, env=env, timeout=300)
    assert p.returncode != 0 and "the reward service is down" in p.stderr
    assert "saved the state after rollout 2" in p.stderr
    ck = find_resume_checkpoint(tmp_path / "run")
    assert ck.name == "step-4"  # 2 rollouts x 2 minibatches
    assert sorted(f.name for f in (ck / "inflight").iterdir()) == ["rollout-2.safetensors", "rollout-3.safetensors"]
    p = gspo([*common, "resume=auto"], env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_params(runs / "k2", tmp_path / "run")
    assert as_count_ones(comparable(tmp_path / "run")) == comparable(runs / "k2")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie has stopped
    except FileNotFoundError:
        return True


def listening(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process `pid` listens on ("127.0.0.1:port")."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                ip = ".".join(str(b) for b in raw[::-1]) if len(raw) == 4 else raw.hex()
                found.append(f"{ip}:{int(port, 16)}")
    return found


def test_the_store_and_groups_listen_on_loopback_only_and_forked_workers_drop_the_listener():
    store = async_job.loopback_store(2, async_job._timeout(load_config(None, [])))
    mine = listening(os.getpid())
    assert f"127.0.0.1:{store.port}" in mine
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked worker: its copy of the store's listener is closed
        os.write(w, json.dumps(listening(os.getpid())).encode())
        os._exit(0)
    os.close(w)
    child = json.loads(os.read(r, 65536))
    os.waitpid(pid, 0)
    assert f"127.0.0.1:{store.port}" not in child
    del store


def test_generators_stop_when_the_learner_is_killed(tmp_path):
    learner = gspo_popen(["train", *TINY, f"output.dir={tmp_path}", "output.name=run", *ASYNC, "rollout.generators=1",
                          "schedule.rollouts=400"], env=_env())
    pids = []
    deadline = time.monotonic() + 120
    while not pids and learner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        for line in learner.read_stderr().splitlines():  # "async mode: generator 1 started (pid N)"
            if "started (pid" in line:
                pids.append(int(line.rsplit("pid ", 1)[1].rstrip(")")))
                break
    assert pids, "no generator started"
    while not (tmp_path / "run" / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # training is under way
    assert not _gone(pids[0])
    # the job's store and gloo groups listen on loopback only, never on every interface
    sockets = listening(learner.pid) + listening(pids[0])
    assert sockets and all(s.startswith("127.0.0.1:") for s in sockets), sockets
    learner.kill()
    learner.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [p for p in pids if not _gone(p)]
    for p in orphans:
        os.kill(p, signal.SIGKILL)
    assert orphans == []


def test_a_sigterm_to_learner_and_generator_alike_stops_after_the_rollout_with_its_rollouts_in_flight(tmp_path):
    """torchrun, Slurm and systemd stop a job with SIGTERM to every process of it: the generator
    leaves the stop to the learner, which saves after its rollout, with the rollout in flight,
    and stops it; no process is left."""
    learner = gspo_popen(["train", *TINY, f"output.dir={tmp_path}", "output.name=run", *ASYNC, "rollout.generators=1",
                          "schedule.rollouts=400", "checkpoint.every=0"], env=_env())
    pids, deadline = [], time.monotonic() + 120
    while not pids and learner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [int(x.rsplit("pid ", 1)[1].rstrip(")")) for x in learner.read_stderr().splitlines() if "started (pid" in x]
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    learner.send_signal(signal.SIGTERM)
    out, err = learner.communicate(timeout=120)
    assert learner.returncode == 0 and "stopped by signal 15" in out + err, err[-2000:]
    ck = find_resume_checkpoint(tmp_path / "run")
    assert ck is not None and [f.name for f in (ck / "inflight").iterdir()]  # K = 1: the next rollout was sampled
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and all(_gone(p) for p in pids)


def test_a_killed_generator_stops_the_run_with_one_clear_error_and_its_last_checkpoint_intact(tmp_path):
    p = gspo_train(tmp_path, "run", *ASYNC, "rollout.max_staleness=2", faults="generator_kill_at=3", check=False)
    assert p.returncode == 1
    err = p.stderr
    assert "gspo train: stopped: generator 1 (pid" in err and "killed by signal 9" in err
    assert "is intact: resume with resume=auto" in err and "Traceback" not in err
    ck = find_resume_checkpoint(tmp_path / "run")
    verify_checkpoint(ck)  # the last checkpoint stayed whole (resuming one exactly: the SIGKILL test)
    p = gspo_train(tmp_path, "early", *ASYNC, "checkpoint.every=0", faults="generator_kill_at=2", check=False)
    assert p.returncode == 1 and "stopped before its first checkpoint: resume=auto starts it over" in p.stderr


def test_a_hung_generator_is_noticed_within_its_deadline(tmp_path):
    t0 = time.monotonic()
    p = gspo_train(tmp_path, "run", *ASYNC, "rollout.generator_timeout_s=2", faults="generator_hang_at=1",
                   check=False)
    assert p.returncode != 0
    assert "generator 1 did not send rollout 1 within rollout.generator_timeout_s=2 s" in p.stderr
    assert time.monotonic() - t0 < 100


@pytest.mark.parametrize("overrides, field", [
    (["rollout.max_staleness=-1"], "rollout.max_staleness"),
    (["rollout.generators=0"], "rollout.generators"),
    (["rollout.generator_timeout_s=0"], "rollout.generator_timeout_s"),
    (["rollout.backend=vllm", "rollout.old_logp=sampler", "algo.routing_replay=true"], "algo.routing_replay"),
    (["rollout.old_logp=sampler", "algo.routing_replay=true", "rollout.decode=generate"], "algo.routing_replay"),
    (["algo.mismatch_correction=tis"], "algo.mismatch_correction"),  # needs old_logp=trainer
    (["algo.mismatch_correction=mis", "rollout.old_logp=trainer", "algo.mismatch_floor=1.5"], "algo"),
    (["rollout.mode=later"], "rollout.mode"),
])
def test_bad_async_settings_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"config field '{field}"):
        load_config(None, ["rollout.mode=async", *overrides])


@pytest.mark.parametrize("world, generators, message", [
    ("2", 2, "need at least 3 processes"),
    ("1", 1, "need at least 2 processes"),
])
def test_async_world_checks_under_torchrun(monkeypatch, world, generators, message):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.delenv(async_job.ROLE_ENV, raising=False)
    cfg = load_config(None, ["rollout.mode=async", f"rollout.generators={generators}"])
    with pytest.raises(ConfigError, match=f"'rollout.generators'.*{message}"):
        async_job.check_world(cfg)


def test_a_job_with_no_learner_rank_is_refused_before_any_rank_takes_a_role(monkeypatch):
    """torchrun -n 2 with rollout.generators=2: every rank went down the generator path and exited
    with gloo's "the learners are gone"; the world check came after that turn."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv(async_job.ROLE_ENV, raising=False)
    cfg = load_config(None, ["rollout.mode=async", "rollout.generators=2"])
    with pytest.raises(ConfigError, match="'rollout.generators': 2 generators need at least 3 processes"):
        async_job.is_generator_rank(cfg)


def test_more_generators_than_cores_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'rollout.generators': 2 generators and the learner need 3 CPU cores"):
        async_job.check_world(load_config(None, ["rollout.mode=async", "rollout.generators=2"]))


def test_torchrun_assigns_the_last_ranks_to_generators(runs, tmp_path):
    """The same config under torchrun with two generators: rank 0 learns, ranks 1 and 2 take
    alternate rollouts. The schedule fixes which weights sample each rollout, not which
    generator does, so this is the one-machine, one-generator run bit for bit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "gspo", "train", *TINY, f"output.dir={tmp_path}", "output.name=run", *ASYNC, "rollout.max_staleness=2",
           "rollout.generators=2"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "started (pid" not in p.stderr  # torchrun started every process, gspo none
    assert_same_params(runs / "k2", tmp_path / "run")


def torchrun(out: Path, name: str, nproc: int, *extra: str, faults: str = "", rc: int = 0) -> Path:
    """As torchrun runs it, the ranks forked (tests/zygote.py); the test above keeps the real one."""
    p = gspo_torchrun(nproc, ["train", *TINY, f"output.dir={out}", f"output.name={name}", *extra], env=_env(faults),
                      timeout=300)
    assert (p.returncode == 0) == (rc == 0), p.stderr[-3000:]
    return out / name


def test_two_fsdp_learners_and_a_generator_train_what_sync_fsdp_trains(tmp_path):
    """torchrun, 3 processes: ranks 0-1 learn under FSDP2 (each sends the generator its own
    shards, nobody gathers them), rank 2 samples each learner's prompts as sync mode's rank
    would; evaluation runs on the generator. At K = 0 that is the 2-process sync FSDP2 run,
    parameters and held-out metrics bit for bit."""
    fsdp = ["distributed.strategy=fsdp", "eval.every=2"]
    sync = torchrun(tmp_path, "sync", 2, *fsdp)
    run = torchrun(tmp_path, "async", 3, *fsdp, *ASYNC, "rollout.max_staleness=0")
    assert_same_params(sync, run)
    ev = lambda d: [{k: v for k, v in r.items() if k.startswith("eval/")} for r in comparable(d) if "eval/accuracy" in r]
    assert len(ev(run)) == 3 and ev(run) == ev(sync)  # rollouts 0, 2 and 4
    assert comparable(run) == comparable(sync)


def test_two_fsdp_learners_resume_exactly_with_their_parts_of_the_rollouts_in_flight(tmp_path):
    """K = 2 with two FSDP2 learners: a job that dies after rollout 2 leaves each learner's
    part of rollouts 3 and 4 in its checkpoint; resumed, it trains what the uninterrupted job did."""
    args = ["distributed.strategy=fsdp", *ASYNC, "rollout.max_staleness=2"]
    whole = torchrun(tmp_path, "whole", 3, *args)
    run = torchrun(tmp_path, "run", 3, *args, faults="exit_after_rollout=2", rc=1)
    ck = find_resume_checkpoint(run)
    assert sorted(f.name for f in (ck / "inflight").iterdir()) == [
        "rollout-2.rank-1.safetensors", "rollout-2.safetensors", "rollout-3.rank-1.safetensors", "rollout-3.safetensors"]
    torchrun(tmp_path, "run", 3, *args, "resume=auto")
    assert_same_params(whole, run)
    assert comparable(whole) == comparable(run)


def test_rollout_messages_round_trip():
    ro = Rollout(prompt_ids=torch.tensor([[0, 5], [0, 5]]), prompt_mask=torch.tensor([[0, 1], [0, 1]]),
                 completion_ids=torch.tensor([[7, 2], [8, 0]]), completion_mask=torch.tensor([[1, 1], [1, 0]]),
                 sampler_logp=torch.tensor([[-0.5, -1.25], [-2.0, 0.0]]), finish_reason=["eos", "length"],
                 group_size=2, prompts=["π ≈ 3?", "π ≈ 3?"], completions=["yes ✓", ""])
    back, meta = async_wire.decode_rollout(async_wire.encode_rollout(ro, {"rollout": 7, "version": 5}))
    assert meta == {"rollout": 7, "version": 5}
    for k in async_wire.ROLLOUT_TENSORS:
        assert torch.equal(getattr(back, k), getattr(ro, k)), k
    assert (back.prompts, back.completions, back.finish_reason) == (ro.prompts, ro.completions, ro.finish_reason)


def test_the_schedule_samples_rollout_q_with_the_weights_after_q_minus_k():
    r = async_mode.AsyncRollouts.__new__(async_mode.AsyncRollouts)
    r.start, r.K, r.N, r.job = 0, 2, 2, async_job.Job(world_size=3)
    assert [r.need(q) for q in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [r.generator_of(q) for q in range(4)] == [1, 2, 1, 2]
    r.job = async_job.Job(world_size=4, learners=2)  # torchrun: ranks 0-1 learn, 2-3 sample
    assert [r.generator_of(q) for q in range(4)] == [2, 3, 2, 3]
    r.start = 3  # resumed at rollout 3: nothing older than the checkpoint's weights
    assert [r.need(q) for q in range(3, 8)] == [3, 3, 3, 4, 5]


def test_mismatch_corrections_act_in_the_loss(tmp_path):
    """With the trainer's pi_old, a stale rollout's tokens get weights pi_old / pi_sampler != 1:
    MIS with tight bounds masks some of them, TIS truncates others, and the two train different
    weights (were the weights ignored, both runs would be the same uncorrected run)."""
    base = [*ASYNC, "rollout.max_staleness=1", "rollout.old_logp=trainer", "algo.mismatch_cap=1.01"]
    gspo_train(tmp_path, "mis", *base, "algo.mismatch_correction=mis", "algo.mismatch_floor=0.99")
    gspo_train(tmp_path, "tis", *base, "algo.mismatch_correction=tis")
    mis, tis = (metrics_without_timings(tmp_path / n)[1:] for n in ("mis", "tis"))
    assert mis[0]["mismatch_is/masked_frac"] == 0.0 and abs(mis[0]["mismatch_is/weight_max"] - 1) < 1e-5  # on-policy
    assert max(r["mismatch_is/masked_frac"] for r in mis) > 0
    assert max(r["mismatch_is/truncated_frac"] for r in tis) > 0
    assert all(r["mismatch_is/truncated_frac"] == 0 for r in mis) and all(r["mismatch_is/masked_frac"] == 0 for r in tis)
    pa, pb = final_params(tmp_path / "mis"), final_params(tmp_path / "tis")
    assert any(not torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("overrides, old_logp, expected", [
    (["rollout.mode=async", "algo.level=token"], "trainer", "tis"),   # measured: docs/async.md
    (["rollout.mode=async", "algo.level=token"], "sampler", "none"),  # w = 1: nothing to correct
    (["algo.level=token"], "trainer", "none"),                        # sync: pi_old is on-policy
    (["rollout.mode=async"], "trainer", "none"),                      # GSPO: measured no gain
    (["rollout.mode=async", "algo.level=token", "algo.mismatch_correction=mis", "rollout.old_logp=trainer"],
     "trainer", "mis"),
])
def test_the_default_correction_is_tis_only_where_it_was_measured_to_help(overrides, old_logp, expected):
    from gspo.train.run import resolve_correction

    assert resolve_correction(load_config(None, overrides), old_logp) == expected


# ---------------------------------------------------------------- MoE: the sampler's routes (R3)


@pytest.mark.parametrize("batch_size", [None, 8])
def test_the_decode_loop_records_the_routes_the_trainer_would(batch_size):
    """Every token the sampler ran has the routes the trainer's pi_old pass records for it (same
    weights); the only tokens without are each row's last, which neither pass needs."""
    from gspo.models.logprobs import LogprobModule
    from gspo.models.routing import RouteTracker
    from gspo.models.tiny import build_char_tokenizer, build_tiny_model
    from gspo.rollout.hf import HFGenerator

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, moe=True, seed=0)
    gen = HFGenerator(model, tok, temperature=1.5, max_new_tokens=6, batch_size=batch_size)
    gen.routes = RouteTracker(model)
    torch.manual_seed(0)
    ro = gen.generate(["1+2=", "10+20+3=", "7="], 4, seed=3)
    assert ro.routes is not None and ro.routes.shape[:2] == ro.input_ids.shape
    trainer = RouteTracker(model)
    trainer.reset(*ro.input_ids.shape, ro.input_ids.device)
    with torch.no_grad(), trainer.forward("capture", torch.arange(ro.num_samples), 0, ro.attention_mask):
        LogprobModule(model)(ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1])
    both = (ro.routes >= 0).all(-1) & (trainer.routes >= 0).all(-1)  # (N, P+T, layers)
    assert both.sum() > 0.8 * ro.attention_mask.sum() * 2
    assert torch.equal(ro.routes[both], trainer.routes[both])
    real = ro.attention_mask.bool()[:, :, None].expand_as(both)
    missing = real & ~(ro.routes >= 0).all(-1)
    P = ro.prompt_ids.shape[1]
    last = P + ro.completion_lengths - 1  # each row's last token
    for i in range(ro.num_samples):
        cols = missing[i].any(-1).nonzero().flatten().tolist()
        assert cols == [int(last[i])], (i, cols)
    gen.routes.close()
    trainer.close()


def test_async_moe_routes_come_from_the_sampler_and_replay_runs(tmp_path):
    """The default pi_old on a MoE in async mode is the sampler's, with its routes: the route
    change is measured from them, and Routing Replay replays them."""
    moe = ["tiny.moe=true", "tiny.num_experts=4"]
    gspo_train(tmp_path, "r3", *ASYNC, *moe, "algo.level=token", "algo.routing_replay=true")
    recs = [r for r in metrics_without_timings(tmp_path / "r3") if "routing/changed_frac" in r]
    first = {}
    for r in recs:  # each rollout's first minibatch: before any update of this rollout
        first.setdefault(r["rollout"], r["routing/changed_frac"])
    # rollout 1 was sampled by the weights it is trained on: the sampler's routes are the trainer's;
    # later ones by weights one update older, so some routes differ already on the first minibatch
    # (with the trainer's pi_old pass the first minibatch compares with itself: exactly 0)
    assert first[1] == 0.0
    assert all(first[r] > 0 for r in range(2, 5)), first


@pytest.mark.parametrize("family", ["llama"])
def test_async_on_a_saved_checkpoint_with_chat_data_matches_sync(saved, tmp_path, family):
    """A user's artifacts through the CLI: a save_pretrained checkpoint (llama: a tokenizer
    that adds BOS) that every generator loads from disk, and chat rows with messy columns.
    With K = 0 async mode trains the parameters sync mode trains, bit for bit."""
    from artifacts import chat_rows, write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    common = [f"model.name_or_path={saved(family)}", f"data.source={data}", "data.prompt_column=messages",
              "data.max_prompt_tokens=256", "rollout.max_new_tokens=6"]
    gspo_train(tmp_path, "sync", *common)
    gspo_train(tmp_path, "async", *common, *ASYNC, "rollout.max_staleness=0")
    assert_same_params(tmp_path / "sync", tmp_path / "async")
    assert comparable(tmp_path / "sync") == comparable(tmp_path / "async")


def test_the_entry_point_ends_a_process_whose_job_left_a_receive_pending_with_os_exit(monkeypatch, capsys):
    """After a generator died, the interpreter's own exit destroyed the job's groups under a
    pending receive and gloo aborted the process (exit 134, "terminate called without an active
    exception", 1 run in 20) after the run had saved and said why it stopped."""
    import sys

    from gspo import cli
    from gspo.train import async_job

    class Exited(BaseException):
        pass

    def exit_(rc):
        raise Exited(rc)

    def stopped(argv):
        async_job.close_job(async_job.Job(world_size=2), grace_s=0, clean=False)  # a receive still pending
        print("gspo train: stopped: generator 1 died", file=sys.stderr)
        return 1

    monkeypatch.setattr(cli, "_main", stopped)
    monkeypatch.setattr(cli.os, "_exit", exit_)
    monkeypatch.setattr(async_job, "LEFT_PENDING", False)
    assert cli.main(["train"]) == 1  # called with arguments (a library call, a test): it returns
    with pytest.raises(Exited) as e:
        cli.main()  # the process's entry point
    assert e.value.args == (1,) and "generator 1 died" in capsys.readouterr().err
    monkeypatch.setattr(async_job, "LEFT_PENDING", False)
    async_job.close_job(async_job.Job(world_size=2), grace_s=0)  # closed cleanly: the interpreter's exit is safe
    assert not async_job.LEFT_PENDING
