"""Async mode (`rollout.mode=async`): generator processes sample the next rollouts while the
learner trains on the current one, in one `torch.distributed` job.

Roles. The first L ranks are learners, the last N generators (`rollout.generators=N`). On
one machine `gspo train` is the one learner and starts the N generator processes itself
(`async_job.start_job`); under torchrun every rank but the last N learns, L > 1 of them sharded
by FSDP2 (or replicated by DDP) on a default group of their own (`async_job.learner_dist`). The
job's groups are objects made on its store, never a default group (`async_job.connect`); this
module is the learner's side of the job. Every generator builds the
policy from the same config and samples with the hf backend's `HFGenerator`, which with the
same weights and seed draws the very tokens that sync mode draws, or with a vLLM engine in
its own process (`rollout.backend=vllm`), which no default group of ours stands in the way of.

The schedule is fixed, not a race: rollout q is sampled by generator L + q mod N with the
weights after rollout need(q) = max(start, q - K), K = `rollout.max_staleness`, `start` the
rollout the run began (or resumed) at. So every rollout's staleness is known in advance
(min(q - start, K)), a run is the same whatever the timing, K = 0 is sync mode computed on
another process, and a generator that would be more than K versions behind waits.

Messages (`gspo.train.async_wire`; all over `torch.distributed`, never files; the
generator's side of them is `gspo.train.async_generator`):

- learner -> generator, on the job's gloo group: a command header (kind, payload bytes,
  version) and a JSON payload: GENERATE (rollout, seed, prompts, row offset), WEIGHTS
  (version, tensor names and sizes), EVAL (learner 0, under FSDP2) or STOP; every learner
  sends its own GENERATE and WEIGHTS. WEIGHTS is followed by the learner's part of the
  tensors (its FSDP2 shards) over the weights group: every parameter and floating buffer on
  the first sync, the trainable parameters after that. Over gloo they
  go as one flat host copy per dtype, released once the generator has sampled with them;
  over NCCL (a GPU per rank) as the parameters themselves, which the learner leaves
  untouched until they are received (`finish_sends`, before the next update).
- generator -> learner: ROLLOUT (or EVAL_RESULT), a safetensors payload (the rollout's tensors, and its texts
  and timings as JSON in a uint8 tensor; nothing is unpickled), or ERROR with a traceback.

Faults. The learner waits for any message with a deadline (`rollout.generator_timeout_s`)
and watches its generator processes: a generator that dies or hangs stops the run with one
`GeneratorError` naming it, and the last checkpoint stays as it was. Generators die with the
learner: a spawned one gets SIGKILL when its parent dies (PR_SET_PDEATHSIG) and checks its
parent every second; any generator stops when its connection to the learner breaks.

Exact resume. A checkpoint after rollout c holds the rollouts already sampled for c..c+K-1
(`inflight/`), which older weights drew; a resumed run trains on them, so a SIGKILL followed
by `resume=auto` gives what the uninterrupted run gives.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from gspo.config import Config
from gspo.data import format_prompt
from gspo.rollout import Rollout, chunk_seed
from gspo.train.async_job import GeneratorError, Job, _try, _weights_backend, close_job
from gspo.train.checkpoint import latest_checkpoint
from gspo.train.async_wire import (CMD_TAG, ERROR, EVAL, EVAL_RESULT, GENERATE, ROLLOUT_TAG, STOP, WEIGHTS, _frame,
                                   decode_rollout, local_part, recv_message, weight_tensors)

# ---------------------------------------------------------------- the learner's side


@dataclass
class _Pending:
    """A rollout the learner has asked for: its prompt rows, the prompt stream's position
    before they were drawn, and (once it arrived) the rollout."""

    batch: list
    stream_before: dict
    version: int
    rollout: Rollout | None = None
    meta: dict = field(default_factory=dict)


class AsyncRollouts:
    """A learner rank's end of async mode: asks generators for rollouts ahead of time by the
    fixed schedule, sends them each weight version they need, and hands `produce` the next
    rollout. With several learner ranks (torchrun, FSDP2 or DDP) every one runs this in step:
    it asks for its own prompts' groups, sends its own shard of the weights (no rank gathers
    them), and receives its own part of each rollout."""

    def __init__(self, cfg: Config, job: Job, policy, tokenizer, prompts, total: int):
        self.cfg, self.job, self.policy, self.prompts, self.total = cfg, job, policy, prompts, total
        self._tokenizer = tokenizer
        self.episodes = bool(cfg.rollout.tools or cfg.rollout.environment)  # multi-turn: the generator plays them
        self.K, self.N, self.rank = cfg.rollout.max_staleness, job.world_size - job.learners, job.rank
        self.evals: dict[int, dict] = {}  # weight version -> a generator's evaluation completions
        self.pending: dict[int, _Pending] = {}
        self.have: dict[int, int] = {}  # generator rank -> the weight version it holds
        self.sends: list = []  # (generator, rollout, work, tensor) of command sends
        self.weight_sends: list = []  # (generator, version, work, tensor): sends from the parameters
        self.copied_sends: list = []  # the same for flat copies (gloo)
        self.cond = threading.Condition()
        self.failed: dict[int, str] = {}  # generator rank -> its traceback
        self.failed_run = False
        self.nccl = _weights_backend(job.device) == "nccl"
        self.receivers = [threading.Thread(target=self._receive_from, args=(g,), daemon=True)
                          for g in job.generator_ranks()]
        for t in self.receivers:
            t.start()
        self.next_q = 0  # the next rollout to ask for
        self.start = 0
        self.sync_s = 0.0
        self.sync_bytes = 0

    # the schedule
    def need(self, q: int) -> int:
        return max(self.start, q - self.K)

    def generator_of(self, q: int) -> int:
        return self.job.learners + q % self.N

    def begin(self, start: int, inflight: dict[int, tuple[Rollout, dict]]) -> None:
        """Start (or resume) at rollout `start` with the current weights as version `start`;
        `inflight` holds rollouts a checkpoint saved, already sampled by older weights. Those more
        than rollout.max_staleness versions behind the rollout they would be learned as (K lowered
        since they were saved) are sampled again, with every one after them, in order."""
        self.start = self.next_q = start
        stale = [q for q in sorted(inflight) if q - inflight[q][1]["version"] > self.K]
        if stale:
            inflight = {q: v for q, v in inflight.items() if q < stale[0]}
            if self.rank == 0:
                print(f"resume: rollouts {stale[0] + 1}.. in flight were sampled more than rollout.max_staleness="
                      f"{self.K} versions before they would be learned; they are sampled again", file=sys.stderr)
        for q in sorted(inflight):  # their prompts were drawn before the checkpoint: draw them again
            before = copy.deepcopy(self.prompts.state_dict())
            ro, meta = inflight[q]
            self.pending[q] = _Pending(self.prompts.next_batch(), before, meta["version"], ro, meta)
            self.next_q = q + 1
        self._ask_up_to(start)

    def after_update(self, version: int) -> None:
        """The learner's weights are now version `version` (= rollouts learned): send them
        where the schedule needs them and ask for the rollouts they sample. The rollouts learned
        are let go only now: until then a checkpoint (a fault's, `produce.produce_or_save`) holds
        the one being learned with those in flight."""
        with self.cond:
            for q in [q for q in self.pending if q < version]:
                del self.pending[q]
        self._ask_up_to(version)

    def _ask_up_to(self, version: int) -> None:
        while self.next_q < self.total and self.need(self.next_q) <= version:
            q = self.next_q
            g, v = self.generator_of(q), self.need(q)
            if self.have.get(g) != v:
                self._send_weights(g, v, full=g not in self.have)
            before = copy.deepcopy(self.prompts.state_dict())
            batch = self.prompts.next_batch()
            req = {"rollout": q, "version": v, "seed": chunk_seed(self.cfg.seed, q),
                   "offset": self.rank * len(batch) * self.cfg.rollout.group_size,  # as in sync mode
                   "prompts": [format_prompt(r["prompt"], self._tokenizer) for r in batch]
                   if not self.episodes else [],
                   "rows": batch if self.episodes else []}  # episodes: the rows (messages, environment columns)
            with self.cond:  # before the request goes out: the answer may come at once
                self.pending[q] = _Pending(batch, before, v)
            self._post(GENERATE, json.dumps(req).encode(), g, v)
            self.next_q += 1

    def _post(self, kind: int, payload: bytes, dst: int, version: int) -> None:
        """Send a command without waiting; its tensors stay alive in `sends` until the
        generator has surely read it (`_release`), tagged with the next rollout index it precedes."""
        head, body = _frame(kind, payload, version)
        for t in (head, body) if len(payload) else (head,):
            self.sends.append((dst, self.next_q, self._send(self.job.pg, t, dst, CMD_TAG, "a command"), t))

    def _send(self, pg, t: torch.Tensor, dst: int, tag: int, what: str):
        """pg.send of `t` to generator `dst`; a connection the generator closed (it died) is a
        GeneratorError saying why, not gloo's own error."""
        try:
            return pg.send([t], dst, tag)
        except RuntimeError as e:
            self.failed_run = True  # close() then kills the generators without a grace period
            deadline = time.monotonic() + 2.0  # a killed process is reaped a moment later: say why
            while (why := self.job.dead(dst)) is None and self.job.procs and time.monotonic() < deadline:
                time.sleep(0.05)
            raise GeneratorError(f"{why or f'the connection to generator {dst} broke ({e})'} while the learner "
                                 f"sent it {what}; {self._note()}") from None

    def _send_weights(self, g: int, version: int, full: bool) -> None:
        """This rank's part of weights `version` (`async_wire.local_part`: its FSDP2 shards, or
        everything on one learner) to generator g, which puts the learners' parts together.
        Over gloo: one flat host buffer per dtype, a copy (one message instead of one per
        tensor, ~1 ms each, and the learner may step at once); over NCCL: each part itself,
        which must then stay unchanged until received."""
        parts = {n: p for n, t in weight_tensors(self.policy, full).items()
                 if (p := local_part(t.detach(), self.rank)) is not None}
        t0 = time.perf_counter()
        flat = not self.nccl
        groups: dict[str, list] = {}
        for n, t in parts.items():  # [dtype, names, numels] per message
            key = str(t.dtype) if flat else n
            groups.setdefault(key, [str(t.dtype), [], []])
            groups[key][1].append(n)
            groups[key][2].append(t.numel())
        groups = list(groups.values())
        self._post(WEIGHTS, json.dumps({"version": version, "groups": groups, "flat": flat}).encode(), g, version)
        for _, names, numels in groups:
            if not sum(numels):
                continue
            t = torch.cat([parts[n].reshape(-1).cpu() for n in names]) if flat else parts[names[0]]
            work = self._send(self.job.weights_pg, t, g, 0, "weights")
            (self.copied_sends if flat else self.weight_sends).append((g, version, work, t))
            self.sync_bytes += t.numel() * t.element_size()
        self.have[g] = version
        self.sync_s += time.perf_counter() - t0

    def finish_sends(self) -> None:
        """Wait until the generators hold the weights sent from the parameters themselves (the
        parameters may then change). Copies and commands need no wait: a copy is released
        once its generator answers with a rollout of that version or newer (`_release`)."""
        t0 = time.perf_counter()
        for _, _, work, _ in self.weight_sends:
            self._wait(lambda w=work: w.wait(), "receive its weights")
        self.weight_sends.clear()
        self.sync_s += time.perf_counter() - t0

    def _release(self, g: int, q: int, version: int) -> None:
        """Generator g has answered rollout q, sampled with `version`: it has read every command
        up to q's and received every weight copy up to `version`."""
        self.copied_sends = _drop_done(self.copied_sends, lambda e: e[0] == g and e[1] <= version)
        self.sends = _drop_done(self.sends, lambda e: e[0] == g and e[1] <= q)

    def take(self, q: int) -> tuple[list, Rollout, dict]:
        """Rollout q (waiting for it), its prompt rows and its metrics; the weight sends are
        finished first, so the update that follows may change the parameters. It stays pending
        until `after_update` has the weights it trained."""
        p = self.pending[q]
        t0 = time.perf_counter()
        self._arrived(q)
        self._release(self.generator_of(q), q, p.version)
        self.finish_sends()
        wait = time.perf_counter() - t0
        m = p.meta
        info = {"time/generate": m.get("generate_s", 0.0), "async/learner_idle_s": wait,
                "async/generator_idle_s": m.get("idle_s", 0.0), "async/weight_sync_s": self.sync_s + m.get("sync_s", 0.0),
                "async/weight_sync_bytes": float(self.sync_bytes)}
        self.sync_s, self.sync_bytes = 0.0, 0
        p.rollout.policy_version = torch.full((p.rollout.num_samples,), p.version, dtype=torch.long)
        return p.batch, p.rollout, info

    def _arrived(self, q: int) -> None:
        """Wait until rollout q has come (the receiver threads fill `pending`)."""
        if self.pending[q].rollout is None:
            g = self.generator_of(q)
            self._wait(lambda: self._until(lambda: self.pending[q].rollout is not None or g in self.failed),
                       f"send rollout {q}", g)
        g = self.generator_of(q)
        if self.pending[q].rollout is None and g in self.failed:
            self.failed_run = True
            raise GeneratorError(f"generator {g} failed while sampling:\n{self.failed[g]}")

    def _until(self, ready) -> None:
        with self.cond:
            while not ready():
                self.cond.wait()

    def _receive_from(self, g: int) -> None:
        """A receiver thread, one per generator: every rollout it sends, as it comes (so that a
        generator never blocks on a send while the learner waits for something else)."""
        try:
            while True:
                kind, data, version = recv_message(self.job.pg, g, ROLLOUT_TAG)
                if kind == ERROR:
                    with self.cond:
                        self.failed[g] = data.decode(errors="replace")
                        self.cond.notify_all()
                    return
                if kind == EVAL_RESULT:
                    with self.cond:
                        self.evals[version] = json.loads(data)
                        self.cond.notify_all()
                    continue
                ro, meta = decode_rollout(data)
                with self.cond:
                    self.pending[meta["rollout"]].rollout, self.pending[meta["rollout"]].meta = ro, meta
                    self.cond.notify_all()
        except Exception:  # the connection closed: the main thread finds out why
            return

    def _wait(self, fn, what: str, g: int | None = None) -> None:
        try:
            self._wait_for(fn, what, g)
        except GeneratorError:
            self.failed_run = True  # close() then kills the generators without a grace period
            raise

    def _wait_for(self, fn, what: str, g: int | None) -> None:
        """Run the blocking `fn` on a helper thread and wait for it within
        rollout.generator_timeout_s, watching the generator processes meanwhile. (A gloo wait
        cannot be given a deadline of its own: a timed-out wait closes the connection.)"""
        limit = self.cfg.rollout.generator_timeout_s
        deadline = time.monotonic() + limit
        ranks = [g] if g is not None else self.job.generator_ranks()
        out: list = []
        t = threading.Thread(target=lambda: out.append(_try(fn)), daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            if not t.is_alive():
                break
            for r in ranks:
                why = self.job.dead(r)
                if why:
                    raise GeneratorError(f"{why} before it could {what}; {self._note()}")
            if time.monotonic() > deadline:
                who = f"generator {g}" if g is not None else "a generator"
                raise GeneratorError(f"{who} did not {what} within rollout.generator_timeout_s={limit:g} s "
                                     f"(hung?); {self._note()}")
        if out and out[0] is not None:
            raise GeneratorError(f"the connection to a generator broke while waiting for it to {what} "
                                 f"({out[0]}); {self._note()}")

    def _note(self) -> str:
        if latest_checkpoint(self.cfg.run_dir):
            return (f"the run stopped; its last checkpoint in {self.cfg.run_dir / 'checkpoints'} is intact: resume "
                    f"with resume=auto")
        return "the run stopped before its first checkpoint: resume=auto starts it over"

    # evaluation
    def evaluate(self, version: int, prompts: list[str], *, max_new_tokens: int, pass_k: int) -> dict:
        """Held-out completions under weights `version` (the learner's current ones), computed
        by a generator, so that no learner rank needs the whole model: every learner rank calls
        this (each sends its part of the weights if that generator lacks them); rank 0 asks
        and gets {"greedy": [...], "samples": [...] or None, "group_size": n}, the others {}."""
        g = self.generator_of(version + self.K)  # the one that samples with these weights next
        if self.have.get(g) != version:
            self._send_weights(g, version, full=False)
        if self.rank != 0:
            return {}
        req = {"version": version, "prompts": prompts, "max_new_tokens": max_new_tokens, "pass_k": pass_k}
        self._post(EVAL, json.dumps(req).encode(), g, version)
        self._wait(lambda: self._until(lambda: version in self.evals or g in self.failed), "evaluate", g)
        if version not in self.evals:
            self.failed_run = True
            raise GeneratorError(f"generator {g} failed while evaluating:\n{self.failed[g]}")
        self.copied_sends = _drop_done(self.copied_sends, lambda e: e[0] == g and e[1] <= version)
        return self.evals.pop(version)

    # checkpoints
    def stream_state(self, q: int) -> dict:
        """The prompt stream's position before rollout q's prompts were drawn."""
        p = self.pending.get(q)
        return copy.deepcopy(p.stream_before if p else self.prompts.state_dict())

    def inflight(self, q: int) -> dict[int, tuple[Rollout, dict]]:
        """The rollouts of q.. sampled by weights older than q (waiting for them): what a
        checkpoint after q rollouts must hold for an exact resume."""
        out = {}
        for r in sorted(self.pending):
            if r >= q and self.pending[r].version < q:
                self._arrived(r)
                out[r] = (self.pending[r].rollout, self.pending[r].meta)
        return out

    def close(self) -> None:
        """Stop the generators (STOP, then a kill for any that linger) and leave the job."""
        try:
            for g in self.job.generator_ranks():
                if not self.job.dead(g):  # (never waited for: a hung generator does not read it)
                    self._post(STOP, b"", g, 0)
        except Exception:  # a broken connection: the kill below
            pass
        grace = 10.0 if not self.failed_run else 0.5
        deadline = time.monotonic() + grace
        for t in self.receivers:  # each ends when its generator, stopped, closes the connection
            t.join(max(deadline - time.monotonic(), 0.0))
        close_job(self.job, grace_s=grace, clean=not any(t.is_alive() for t in self.receivers))


def _drop_done(sends: list, done) -> list:
    """The sends not known to be complete; the others are waited for (at once: they are)."""
    keep = []
    for e in sends:
        if done(e):
            e[2].wait()
        else:
            keep.append(e)
    return keep
