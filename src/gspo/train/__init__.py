"""The training layer: the loop and one step (`loop`: `train`, `learn`; `produce`, with `dynamic`
for DAPO's dynamic sampling), building a
run from its config (`run`), the per-rollout plan and its cross-process agreement (`plan`), the
step's metrics (`step_metrics`), checkpoints (`checkpoint`, `state_io`), torchrun and FSDP2
(`distributed`), held-out evaluation (`evaluate`) and fault injection for tests (`faults`).
See docs/architecture.md."""

from gspo.train.loop import (  # noqa: F401  (the names users and tests import from gspo.train)
    ScoredRollout, TrainerState, TrainingError, learn, make_plan, minibatch_step, minibatches, old_logprobs,
    produce, score, train,
)
