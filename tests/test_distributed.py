"""torchrun on CPUs (gloo, 2 processes): FSDP2 and DDP give the one-process result for the same
global batch, sharded checkpoints resume exactly across ranks, LoRA trains and merges.

Tolerance: the 2-rank runs reduce gradients in a different order than one process, so
parameters after 6 AdamW steps at lr 1e-3 may differ by float rounding amplified by Adam's
normalisation; measured 4.9e-7 max abs, asserted <= 1e-5. Dropping the world-size factor from
the token-mean weights (a real bug class) moves them by 1.5e-4, so the bound can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zygote import gspo, gspo_torchrun

TESTS = Path(__file__).parent
REWARD = "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]"  # moves a random model
RUN = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=8",        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.temperature=1.5",
       "rollout.batch_size=8",  # sampling chunks of 8 rows: the same samples on 1 or 2 processes
       "schedule.rollouts=3", "schedule.num_minibatches=2", "eval.num_prompts=4", "logging.console=false",
       "logging.completions_every=1", "checkpoint.every=1", "checkpoint.keep_last=10", "optim.lr=1e-3", REWARD]
TOL = 1e-5


def _env(faults: str = "") -> dict:
    path = os.pathsep.join(x for x in [str(TESTS), os.environ.get("PYTHONPATH", "")] if x)
    return {**os.environ, "GSPO_FAULTS": faults, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": path}


def launch(out: Path, name: str, *extra: str, nproc: int = 1, faults: str = "") -> subprocess.CompletedProcess:
    """`gspo train` on one process, or as torchrun runs it on `nproc` (both forked, tests/zygote.py)."""
    args = ["train", *RUN, f"output.dir={out}", f"output.name={name}", *extra]
    if nproc == 1:
        return gspo(args, env=_env(faults), timeout=600)
    return gspo_torchrun(nproc, args, env=_env(faults), timeout=600)


def train(out: Path, name: str, *extra: str, nproc: int = 1) -> Path:
    p = launch(out, name, *extra, nproc=nproc)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return out / name


def final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if "time" not in k and k != "tokens_per_s"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_metrics_close(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb)
    for ra, rb in zip(ma, mb):
        assert ra.keys() == rb.keys()
        for k in ra:
            if ra[k] is None or rb[k] is None:  # NaN (no row ran) is written as null
                assert ra[k] is rb[k], (ra["step"], k)
                continue
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6, nan_ok=True), (ra["step"], k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Built on first use, shared by this module's tests on one worker."""
    out = tmp_path_factory.mktemp("dist")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = {
                "one": lambda: train(out, "one"),
                "fsdp": lambda: train(out, "fsdp", nproc=2),
            }[name]()
        return cache[name]

    return get


def test_fsdp_matches_one_process(runs):
    one, fsdp = runs("one"), runs("fsdp")
    start = final(one)
    assert max_diff(final(fsdp), start) <= TOL
    assert_metrics_close(one, fsdp)
    m = metrics(one)
    assert m[1]["grad_norm"] > 0 and m[-1]["reward/mean"] == m[-1]["reward/mean"]  # it really trained
    ck = fsdp / "checkpoints" / "step-6"
    assert (ck / "COMPLETE").is_file() and (ck / "rng-rank1.json").is_file()
    shards = sorted((ck / "sharded").glob("*.safetensors"))
    assert len(shards) == 2  # one per rank, written by torch.distributed.checkpoint
    assert not list(ck.rglob("*.distcp")) and not list(ck.rglob(".metadata"))  # nothing pickled
    # completions were sampled by both ranks: the global batch is logged
    rows = [json.loads(x) for x in next((fsdp / "completions").glob("*.jsonl")).read_text().splitlines()]
    assert len(rows) == 16 and len({r["prompt"] for r in rows}) == 4  # both ranks' groups, not rank 0's alone


def test_ddp_with_token_mean_matches_one_process(tmp_path):
    """DDP, and GRPO's token-mean, which needs each minibatch's global token count (an all-reduce)."""
    extra = ("algo.level=token", "algo.aggregation=token-mean", "schedule.rollouts=2")
    one = train(tmp_path, "one", *extra)
    ddp = train(tmp_path, "ddp", *extra, "distributed.strategy=ddp", "logging.report_to=[tensorboard]", nproc=2)
    assert max_diff(final(one), final(ddp)) <= TOL
    assert_metrics_close(one, ddp)
    # rank 0 alone writes to the trackers: one event file, every optimizer step once
    from test_trackers import tensorboard_scalars

    assert len(list((ddp / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    assert [s for s, _ in tensorboard_scalars(ddp)["loss"]] == [m["step"] for m in metrics(ddp) if "loss" in m]
    ck = one / "checkpoints"
    assert max_diff(load_file(ck / "step-2" / "model.safetensors"), load_file(ck / "step-4" / "model.safetensors")) > 1e-4



def test_moe_with_route_tracking_under_fsdp_matches_one_process(tmp_path):
    """A MoE model: the π_old pass records routes through shared-prompt forwards (every rank
    agreeing on sharing), rows with advantage 0 are skipped, and routing/changed_frac is
    reduced over ranks: the 2-process run gives the 1-process parameters and metrics."""
    extra = ("tiny.moe=true", "tiny.num_experts=4", "schedule.rollouts=2")
    one = train(tmp_path, "one", *extra)
    fsdp = train(tmp_path, "fsdp", *extra, nproc=2)
    assert max_diff(final(one), final(fsdp)) <= TOL
    assert_metrics_close(one, fsdp)
    m = metrics(one)
    assert all("routing/changed_frac" in r for r in m if r["step"] > 0)
    assert any((r.get("routing/changed_frac") or 0) > 0 for r in m)  # off-policy steps moved routes

def test_sharded_checkpoint_resumes_exactly(runs, tmp_path):
    """Killed after rollout 2 (both ranks), resumed with resume=auto on 2 ranks: the final
    parameters equal the uninterrupted 2-rank run's bitwise."""
    p = launch(tmp_path, "res", nproc=2, faults="exit_after_rollout=2")
    assert p.returncode != 0
    assert (tmp_path / "res" / "checkpoints" / "step-4" / "COMPLETE").is_file()
    assert not (tmp_path / "res" / "final").exists()
    res = train(tmp_path, "res", "resume=auto", nproc=2)
    fsdp = runs("fsdp")
    assert max_diff(final(res), final(fsdp)) == 0.0
    assert metrics(res) == metrics(fsdp)


def test_a_reward_that_raises_on_one_rank_stops_both_after_saving_and_resume_is_exact(runs, tmp_path):
    """Under torchrun the reward raises on rank 1 alone, while rollout 3 is scored and no
    checkpoint is due: both ranks learn of it, save their parts of the state after rollout 2 and
    stop; resume=auto on 2 ranks then trains what the uninterrupted 2-rank run trains, bitwise."""
    from test_resume import FAILING_REWARD, as_count_ones, failing_reward_env

    env = failing_reward_env(_env(), tmp_path, 3, rank=1)  # rank 1 runs no evaluation
    args = ["train", *RUN, f"output.dir={tmp_path}", "output.name=res", "checkpoint.every=0", FAILING_REWARD]
    p = gspo_torchrun(2, args, env=env, timeout=600)
    assert p.returncode != 0 and "the reward service is down" in p.stderr
    assert "another process failed while rollout 3 was produced" in p.stderr  # rank 0's own stop
    assert "saved the state after rollout 2" in p.stderr
    ck = tmp_path / "res" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-4" and (ck / "step-4" / "COMPLETE").is_file()
    p = gspo_torchrun(2, [*args, "resume=auto"], env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    fsdp = runs("fsdp")
    assert max_diff(final(tmp_path / "res"), final(fsdp)) == 0.0
    assert as_count_ones(metrics(tmp_path / "res")) == metrics(fsdp)


def test_sharded_checkpoint_refuses_a_single_process(runs, tmp_path):
    import shutil

    shutil.copytree(runs("fsdp"), tmp_path / "fsdp")
    p = launch(tmp_path, "fsdp", "resume=auto", "schedule.rollouts=4")
    assert p.returncode == 2  # before any model loads (it stopped after loading, exit 1)
    assert "was written by 2 FSDP2 learner processes, and this job has one learner process" in p.stderr
    assert "torchrun" in p.stderr


def test_a_whole_checkpoint_refuses_another_number_of_ddp_processes_before_the_models_load(runs, tmp_path):
    """A one-process checkpoint resumed by 2 DDP ranks: rank 1 said the checkpoint had no
    rng-rank1.json (as if damaged), rank 0 that the prompt stream was split over 1 process,
    both after the models had loaded. Now one refusal, as a sharded checkpoint's."""
    import shutil

    shutil.copytree(runs("one"), tmp_path / "one")
    p = launch(tmp_path, "one", "resume=auto", "schedule.rollouts=4", "distributed.strategy=ddp", nproc=2)
    assert p.returncode != 0
    assert "was written by one learner process (whole weights), and this job has 2 ddp learner processes" in p.stderr
    assert "rng-rank1" not in p.stderr


def test_world_size_must_divide_the_batch(tmp_path):
    p = launch(tmp_path, "bad", "rollout.prompts_per_step=3", "rollout.batch_size=0", "schedule.num_minibatches=1",
               nproc=2)
    assert p.returncode != 0
    assert "rollout.prompts_per_step" in p.stderr and "2 processes" in p.stderr


def test_lora_under_fsdp_with_bf16_matches_one_process(tmp_path):
    """The fp32 LoRA runs on 1 and 2 ranks agree; LoRA + FSDP2 + bf16 + gradient checkpointing runs."""
    one = train(tmp_path, "lora1", "lora.enabled=true")
    two = train(tmp_path, "lora2", "lora.enabled=true", nproc=2)
    assert max_diff(final(one), final(two)) <= TOL
    assert (two / "final" / "adapter" / "adapter_model.safetensors").is_file()
    mp = train(tmp_path, "lora_bf16", "lora.enabled=true", "model.mixed_precision=bf16",
               "model.gradient_checkpointing=true", "schedule.rollouts=1", nproc=2)
    assert (mp / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("extra", [("algo.objective=gmpo",),  # the frozen reference copy, sharded like the trainer
                                   ("lora.enabled=true", "algo.objective=cispo", "algo.level=token")])  # adapters off
def test_kl_to_the_reference_under_fsdp_matches_one_process(tmp_path, extra):
    """A KL penalty in the loss: the reference's forwards are collectives under FSDP2 (every rank
    runs them for each micro-batch) and the 2-process update equals the 1-process one."""
    extra = (*extra, "algo.kl_coef=0.5", "algo.entropy_coef=0.01", "schedule.rollouts=1")
    one = train(tmp_path, "one", *extra)
    two = train(tmp_path, "two", *extra, nproc=2)
    assert max_diff(final(one), final(two)) <= TOL
    assert_metrics_close(one, two)
    steps = [m for m in metrics(one) if "kl/ref" in m]
    assert steps[0]["kl/ref"] == 0.0 and steps[-1]["kl/ref"] > 0  # the first step runs at the starting weights


def test_ranks_whose_launcher_is_killed_stop_after_the_rollout_and_save(tmp_path):
    """torchrun starts each rank in a session of its own: a launcher killed with SIGKILL left them
    training to the end of the schedule. Now each takes the SIGTERM path: it saves and stops."""
    import signal
    import sys
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gspo",
           "train", *RUN, "schedule.rollouts=500", "checkpoint.every=0", f"output.dir={tmp_path}", "output.name=run"]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)  # the launcher alone; its ranks live on in their own sessions
    out, _ = p.communicate(timeout=120)  # (returns once every rank has closed the output it inherited)
    assert "stopped by signal 15" in out, out[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file() and not (tmp_path / "run" / "final").exists()
