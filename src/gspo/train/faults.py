"""Fault injection for the reliability tests: `GSPO_FAULTS="name=value,..."` in the environment.

Points where the trainer can be made to fail on purpose, so that tests exercise the real code
paths (a kill mid-save, a process death between rollouts, a non-finite loss):

- `exit_after_rollout=N`: the process dies (os._exit) right after rollout N is done and saved.
- `kill_in_save=N`: SIGKILL while the checkpoint of optimizer step N is half written.
- `kill_in_final=1`: SIGKILL while final/ is half written (the model saved, not yet renamed).
- `nan_loss_at=N[+M...]`: the loss of optimizer step N (and M...) becomes NaN.
- `nan_loss_from=N`: every loss from optimizer step N on becomes NaN.
- `generator_kill_at=Q` / `generator_hang_at=Q`: an async-mode generator SIGKILLs itself, or
  stops answering, when asked for rollout Q.

Unset (the normal case) every hook is a dictionary lookup that does nothing.
"""

from __future__ import annotations

import os
import signal


def _spec() -> dict[str, str]:
    raw = os.environ.get("GSPO_FAULTS", "")
    return dict(kv.split("=", 1) for kv in raw.split(",") if "=" in kv)


def after_rollout(rollout: int) -> None:
    if _spec().get("exit_after_rollout") == str(rollout):
        os._exit(3)


def in_save(step: int) -> None:
    if _spec().get("kill_in_save") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def in_final() -> None:
    if _spec().get("kill_in_final") == "1":
        os.kill(os.getpid(), signal.SIGKILL)


def nan_loss(step: int) -> bool:
    spec = _spec()
    if not spec:
        return False
    if str(step) in spec.get("nan_loss_at", "").split("+"):
        return True
    return "nan_loss_from" in spec and step >= int(spec["nan_loss_from"])


def in_generator(rollout: int) -> None:
    spec = _spec()
    if spec.get("generator_kill_at") == str(rollout):
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.get("generator_hang_at") == str(rollout):
        import time

        while True:
            time.sleep(3600)
