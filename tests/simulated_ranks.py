"""Several processes simulated by threads, for tests of what processes must agree on: each
thread stands for one rank, and their collectives meet as `gspo.train.distributed.Dist`'s do."""

from __future__ import annotations

import threading


class SimulatedRanks:
    """`n` ranks; `exchange` is an all-gather among them, `run` runs a body on every rank."""

    def __init__(self, n: int):
        self.n = n
        self.calls = [0] * n  # collectives each rank made
        self._slots: list = [None] * n
        self._barrier = threading.Barrier(n, timeout=10)

    def exchange(self, rank: int, value) -> list:
        """Every rank's `value`, once all have sent one (an all-gather)."""
        self.calls[rank] += 1
        self._slots[rank] = value
        self._barrier.wait()
        every = list(self._slots)
        self._barrier.wait()  # everyone has read before the next exchange overwrites
        return every

    def run(self, body) -> list:
        """body(rank) on every rank, each in its thread; their results. The first error is
        re-raised, and frees the other ranks from their barrier."""
        out, errors = [None] * self.n, []

        def one(r):
            try:
                out[r] = body(r)
            except BaseException as e:  # surface it in the test
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out
