"""How a run stops early: SIGTERM / SIGINT (`StopRequest`: the loop saves after the rollout in
progress; a second signal stops at once, `Interrupted`), a lost peer process (`peer_lost`), and
what each keeps (`kept_note`)."""

from __future__ import annotations

import signal as signals
import sys
from pathlib import Path

from gspo.train import checkpoint


def peer_lost(err: BaseException) -> bool:
    """Whether a collective failed because another process of the job died (gloo's and NCCL's
    words for a closed connection), not because of this process's own error."""
    text = str(err)
    return any(w in text for w in ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                                   "Connection refused", "NCCL communicator was aborted", "remote process exited"))


def kept_note(saved: str | None) -> str:
    """What a run stopped early keeps, given its newest checkpoint's name (`latest_checkpoint`)."""
    return (f"its checkpoint {saved} is intact: resume=auto continues from it" if saved else
            "it had no checkpoint yet: resume=auto starts it over")


class Interrupted(KeyboardInterrupt):
    """A second SIGINT / SIGTERM: the run stops at once, without saving the rollout in progress."""


class StopRequest:
    """SIGTERM / SIGINT set a flag, and say so; the loop checkpoints after the current rollout and
    exits. A second signal stops the run at once (`Interrupted`)."""

    def __init__(self, say: bool = True, run_dir: Path | None = None):
        self.signum = None
        self._old = {}
        self.say = say
        self.run_dir = run_dir


    def __enter__(self):
        for s in (signals.SIGTERM, signals.SIGINT):
            try:
                self._old[s] = signals.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        saved = checkpoint.latest_checkpoint(self.run_dir) if self.run_dir is not None else None
        if self.signum is not None:  # second signal: stop now
            raise Interrupted(kept_note(saved))
        self.signum = signum
        if self.say:
            lose = f"the work since checkpoint {saved}" if saved else "all of the run's work (it has no checkpoint yet)"
            got, again = (("Ctrl-C", "a second Ctrl-C") if signum == signals.SIGINT else
                          ("SIGTERM", "a second SIGTERM (or a Ctrl-C)"))  # either second signal stops at once
            print(f"\ngspo: {got}: stopping after the rollout in progress, then saving a checkpoint to resume from "
                  f"(resume=auto); {again} stops at once and loses {lose}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signals.signal(s, h)
