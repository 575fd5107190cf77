"""The first half of a step: `produce(run, state) -> ScoredRollout`, prompts -> B·G episodes ->
rewards -> group advantages (paper Eq. 6). Sampling is the generator's (or, in async mode, a
generator process's), scoring the reward runner's; `gspo.train.dynamic` draws more rounds for
DAPO's dynamic sampling. `learn` (`gspo.train.loop`) takes the ScoredRollout from here.
`produce_or_save` is the step's call: on a fault while producing, the state after the last
finished rollout is saved first (every process together under torchrun)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo import algo
from gspo.data import format_prompt, reward_views
from gspo.rewards import reward_columns
from gspo.rewards.runner import RewardResult
from gspo.rewards.shaping import length_limit, overlong_buffer, overlong_penalty
from gspo.rollout import Rollout, chunk_seed
from gspo.train import async_job, checkpoint, dynamic, run_state
from gspo.train.plan import any_process
from gspo.train.run import Run, play_episodes

if TYPE_CHECKING:
    from gspo.train.loop import TrainerState


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps); the last good state was saved.
    `everywhere`: every process of a torchrun job reached the same decision (from reduced
    numbers), so rank 0 alone says it."""

    def __init__(self, *args, everywhere: bool = False):
        super().__init__(*args)
        self.everywhere = everywhere


@dataclass
class ScoredRollout:
    """What `produce` hands to `learn`: this process's B prompt rows, their B·G episodes, the
    rewards, and the group advantages (paper Eq. 6)."""

    batch: list[dict]
    rollout: Rollout
    rewards: RewardResult
    advantages: torch.Tensor  # (N,) on the run's device
    adv_stats: dict
    times: dict  # time/generate, time/score; dynamic/* with rollout.dynamic_sampling


# ---------------------------------------------------------------- produce


def produce(run: Run, state: TrainerState) -> ScoredRollout:
    """Prompts -> B·G episodes -> rewards -> advantages. Each process samples whole groups of
    its own prompts; advantages never cross processes."""
    cfg, G = run.cfg, run.cfg.rollout.group_size
    if run.remote is not None:  # async mode: sampled ahead by a generator process
        batch, rollout, times = run.remote.take(state.rollout)
        rollout = rollout.to(run.device)
        t1 = time.perf_counter()
        rewards = score(run, batch, rollout)                                    # rewards
        times["time/score"] = time.perf_counter() - t1
        stale = (state.rollout - rollout.policy_version).double()
        times.update({"async/staleness_mean": float(stale.mean()), "async/staleness_max": float(stale.max())})
    elif cfg.rollout.dynamic_sampling:  # DAPO: rounds of prompts until B groups have signal
        batch, rollout, rewards, times = dynamic.sample_with_signal(
            lambda k: sample_and_score(run, state, k), need=run.prompts.batch_size, group_size=G,
            max_rounds=cfg.rollout.dynamic_sampling_max_rounds,
            adv_scale=cfg.algo.adv_scale, adv_eps=cfg.algo.adv_eps, all_reduce=run.dist.all_reduce,
            pad_id=run.generator.pad_token_id)
    else:
        batch, rollout, rewards, times = sample_and_score(run, state)           # B rows, B·G episodes, rewards
    adv, adv_stats = algo.group_advantages(rewards.rewards, G, scale=cfg.algo.adv_scale, eps=cfg.algo.adv_eps)
    return ScoredRollout(batch, rollout, rewards, adv.to(run.device), adv_stats, times)


def sample_and_score(run: Run, state: TrainerState, round_: int = 0):
    """One round of sampling: the prompt stream's next B rows, their B·G episodes, and the
    rewards; returns (batch, rollout, rewards, times). Sampled from `chunk_seed(seed, rollout)`,
    or with dynamic sampling's later rounds `chunk_seed(seed, rollout, round_)`."""
    cfg, G = run.cfg, run.cfg.rollout.group_size
    seed = chunk_seed(cfg.seed, state.rollout) if round_ == 0 else chunk_seed(cfg.seed, state.rollout, round_)
    t0 = time.perf_counter()
    batch = run.prompts.next_batch()                                            # B prompt rows
    if run.tools is not None:  # multi-turn: the model's turns and the tools' replies
        rollout = play_episodes(cfg, run.generator, run.tokenizer, run.tools, batch, seed=seed,
                                offset=run.dist.rank * len(batch) * G).to(run.device)
    else:
        rollout = run.generator.generate(                                       # B·G episodes
            [format_prompt(r["prompt"], run.tokenizer) for r in batch], G,
            seed=seed, offset=run.dist.rank * len(batch) * G).to(run.device)
    rollout.policy_version = torch.full((rollout.num_samples,), state.rollout, dtype=torch.long)
    t1 = time.perf_counter()
    rewards = score(run, batch, rollout)                                        # rewards
    return batch, rollout, rewards, {"time/generate": t1 - t0, "time/score": time.perf_counter() - t1}


def score(run: Run, batch: list[dict], rollout: Rollout, columns: list[str] | None = None) -> RewardResult:
    """Weighted reward per completion (NaN where missing) and each function's own values, plus
    DAPO's soft overlong penalty with `rewards.overlong_penalty` (its values under the name
    `overlong_penalty`); a multi-turn episode is scored on its messages, and one that failed has
    no reward. `columns`: the reward columns (default: the training data's, `PromptStream.columns`)."""
    G = rollout.group_size
    prompts = [row["prompt"] for row in batch for _ in range(G)]
    if rollout.turns is not None:  # an episode: its messages, the model's turns and the tools' replies
        completions = [list(t) for t in rollout.turns]
    else:  # TRL's shapes (conversational for chat prompts), so users' functions work unchanged
        prompts, completions = reward_views(prompts, rollout.completions)
    columns = reward_columns(batch, G, run.prompts.columns if columns is None else columns)  # a column these rows
    # all lack is None, as in any other call
    if rollout.env_reward is not None:  # what the episodes' environments reported
        columns["env_reward"] = list(rollout.env_reward)
    result = run.rewards.score(prompts, completions, columns)
    rw = run.cfg.rewards
    if rw.overlong_penalty:  # on |y|, the tokens the model wrote; a missing reward stays missing (NaN + x)
        limit = length_limit(run.cfg.rollout)
        pen = overlong_penalty(rollout.model_lengths.cpu(), max_len=limit, coef=rw.overlong_penalty,
                               buffer=overlong_buffer(rw.overlong_buffer, limit))  # (N,)
        result.rewards += pen.to(result.rewards.dtype)
        result.per_function["overlong_penalty"] = pen.tolist()
        result.stats["reward/overlong_penalty/mean"] = pen.mean().item()
    if rollout.turns is not None:  # an episode that failed (its environment) has no reward
        failed = torch.tensor([f == "error" for f in rollout.finish_reason])
        result.rewards[failed] = 0.0 if run.cfg.rewards.on_error == "zero" else float("nan")
    return result


# ---------------------------------------------------------------- a fault while producing


def produce_or_save(run: Run, state: TrainerState, rng: dict | None) -> ScoredRollout:
    """`produce`, and if it raises (a reward that raised or ran past its deadline under
    rewards.on_error=raise, a tool or data error) the state after the last finished rollout is
    saved before the run stops. The fault comes before any update from the rollout, so that state
    is whole; it is saved with the RNG as it was when the failed rollout began (`rng`; None where
    the newest checkpoint already holds this state), and resume=auto goes on from there as if
    nothing had failed. In async mode the checkpoint holds the rollouts in flight, the failed one
    among them (`AsyncRollouts.inflight`); a generator that failed leaves nothing to collect, and
    its run stops on its last checkpoint.

    Under torchrun every process learns whether any one failed (one all-reduce a rollout; with
    dynamic sampling, one a round, `dynamic.draw_rounds`), so all of them save their part
    together and stop, instead of waiting in the next collective for a process that has gone."""
    scored, fault, failed = _on_every_process(run, lambda: produce(run, state))
    if not failed:
        return scored
    if rng is not None:
        save_before_fault(run, state, rng)
    _stop(fault, f"while rollout {state.rollout + 1} was produced")


def _on_every_process(run: Run, call):
    """`call()`, and whether it failed on any process (one all-reduce under torchrun): (its value
    or None, this process's exception or None, failed anywhere). A generator that is gone stops at
    once: the rollouts in flight cannot be collected, and the last checkpoint stands."""
    value, fault, failed = None, None, False
    try:
        value = call()
    except async_job.GeneratorError:
        raise
    except dynamic.ProcessFailed:  # another process raised in a round of dynamic sampling
        failed = True
    except Exception as e:
        fault, failed = e, True
    if run.dist.enabled:
        failed = bool(any_process(failed, run.dist.all_reduce))
    return value, fault, failed


def _stop(fault: Exception | None, when: str):
    """Stop the run: with this process's own exception, or, where another process failed, saying so."""
    if fault is not None:
        raise fault
    raise TrainingError(f"another process failed {when} (its error is in its own output); this process stopped "
                        f"with it")


def save_before_fault(run: Run, state: TrainerState, rng: dict) -> None:
    """Save the state after the last finished rollout, with the RNG restored to `rng` (see
    `produce_or_save`)."""
    if state.rollout == 0:  # nothing to keep
        return
    checkpoint.restore_rng_state(rng)
    path = run_state.save_run(run, state)
    if run.dist.is_main:
        print(f"saved the state after rollout {state.rollout} in {path} before stopping; resume with resume=auto",
              file=sys.stderr)


def evaluate_or_save(run: Run, state: TrainerState, log) -> dict:
    """The held-out metrics after a rollout (`evaluate_run`). If the evaluation raises (a reward
    that raised or ran past its deadline on held-out prompts), the rollout is kept all the same:
    its own metrics are logged without the evaluation's (`log(eval_metrics)`), its state is saved,
    and the run stops; resume=auto goes on from the next rollout (that evaluation is not redone).
    It used to stop with every update since the last checkpoint lost, the whole run at the final
    evaluation with checkpoint.every=0. Under torchrun every process learns whether one failed, and
    all save together."""
    from gspo.train.evaluate import evaluate_run

    metrics, fault, failed = _on_every_process(run, lambda: evaluate_run(run, state.rollout))
    if not failed:
        return metrics
    log({})
    path = run_state.save_run(run, state)
    if run.dist.is_main:
        print(f"the held-out evaluation after rollout {state.rollout} failed; saved the state after that rollout in "
              f"{path} before stopping; resume with resume=auto (that evaluation is not redone)", file=sys.stderr)
    _stop(fault, f"in the held-out evaluation after rollout {state.rollout}")
