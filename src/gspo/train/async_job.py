"""Async mode's job (`gspo.train.async_mode`): which ranks learn and which sample, the
learners' own default group, the generator processes started on one machine, and the job's
groups (commands and rollouts over gloo, weights over gloo or NCCL), made on the job's store
as objects of their own, never a default group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gspo.config import Config, ConfigError, to_yaml
from gspo.train.distributed import Dist, stop_with_launcher

ROLE_ENV = "GSPO_ASYNC_ROLE"  # set for the generator processes that `start_job` spawns


class GeneratorError(RuntimeError):
    """A generator process died, hung or failed; the run stopped with its last checkpoint intact."""


# ---------------------------------------------------------------- the job


def learner_count(cfg: Config) -> int:
    """Learner ranks: under torchrun every rank but the last `rollout.generators`; else one."""
    if "WORLD_SIZE" in os.environ and not os.environ.get(ROLE_ENV):
        return int(os.environ["WORLD_SIZE"]) - cfg.rollout.generators
    return 1


def is_generator_rank(cfg: Config) -> bool:
    """Under torchrun with rollout.mode=async: is this rank one of the last `generators` ranks?
    (A job with no learner rank left is refused here, before any rank takes a role.)"""
    if cfg.rollout.mode != "async" or "RANK" not in os.environ or os.environ.get(ROLE_ENV):
        return False
    check_world(cfg)
    return int(os.environ["RANK"]) >= learner_count(cfg)


def check_world(cfg: Config) -> None:
    """Async mode's process count, before anything starts. Under torchrun the job has at least
    one learner rank besides the `rollout.generators` generator ranks; on one machine each
    generator needs a core of its own besides the learner's."""
    n = cfg.rollout.generators
    if "WORLD_SIZE" in os.environ and not os.environ.get(ROLE_ENV):
        world = int(os.environ["WORLD_SIZE"])
        if n >= world:
            raise ConfigError(f"config field 'rollout.generators': {n} generators need at least {n + 1} processes "
                              f"(one learner), but torchrun started {world}")
        return
    cores = os.cpu_count() or 1
    if n > max(cores - 1, 1) and not torch.cuda.is_available():
        raise ConfigError(f"config field 'rollout.generators': {n} generators and the learner need {n + 1} CPU "
                          f"cores; this machine has {cores}")


def torchrun_store(cfg: Config):
    """The store torchrun's environment names (MASTER_ADDR/PORT), which the job's groups meet at."""
    store, _, _ = next(dist.rendezvous("env://", timeout=_timeout(cfg)))
    return store


def learner_dist(cfg: Config, device: torch.device) -> tuple[Dist, object]:
    """A learner rank's `Dist` and (under torchrun) the job's store. The learners' collectives
    (FSDP2, DDP, metrics, checkpoints) run on a default process group of the learner ranks
    alone, so that every collective of the trainer's works unchanged; the job's own groups
    (`connect`) never become a default group, which leaves a generator free to host an engine
    that starts one of its own (vLLM)."""
    if "RANK" not in os.environ:
        return Dist(device=device), None
    store = torchrun_store(cfg)
    stop_with_launcher()
    learners, rank = learner_count(cfg), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if learners == 1:
        return Dist(device=device), store
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.PrefixStore("gspo/learners", store), rank=rank,
                            world_size=learners, timeout=_timeout(cfg), **kw)
    return Dist(rank=rank, world_size=learners, local_rank=local_rank, strategy=cfg.distributed.strategy,
                device=device, launched=True), store


def _weights_backend(device: torch.device) -> str:
    """NCCL between GPUs of their own (torchrun, one GPU per rank); gloo otherwise, with the
    tensors staged through host memory when they live on a GPU (NCCL cannot join two
    processes on one GPU, as a spawned generator beside its learner is)."""
    own_gpus = "RANK" in os.environ and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    return "nccl" if device.type == "cuda" and own_gpus and not os.environ.get(ROLE_ENV) else "gloo"


@dataclass
class Job:
    """One process's view of the job: its size, the learner ranks (0..learners-1; generators
    after them), the groups, and (one machine) the generator processes the learner started."""

    world_size: int
    learners: int = 1
    rank: int = 0
    procs: list = field(default_factory=list)  # subprocess.Popen, one per spawned generator
    store: object = None
    pg: object = None  # commands and rollouts: gloo over the whole job
    weights_pg: object = None  # weights: gloo, or NCCL between GPUs
    device: torch.device = torch.device("cpu")
    local: bool = False  # one machine, spawned generators: every socket on 127.0.0.1

    def generator_ranks(self) -> list[int]:
        return list(range(self.learners, self.world_size))

    def dead(self, rank: int) -> str | None:
        """Why generator `rank` is gone (a spawned process that exited), else None."""
        if not self.procs:
            return None
        p = self.procs[rank - self.learners]
        code = p.poll()
        if code is None:
            return None
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"generator {rank} (pid {p.pid}) {how}"


def start_job(cfg: Config, device: torch.device, store=None) -> Job:
    """The learner's first step: on one machine, host the store (on 127.0.0.1) and start
    the generator processes, which build their policy while the learner builds its own; under
    torchrun every rank is there already (`store`: torchrun's). `connect` then forms the groups."""
    if "RANK" in os.environ:
        return Job(world_size=int(os.environ["WORLD_SIZE"]), learners=learner_count(cfg),
                   rank=int(os.environ["RANK"]), store=store)
    world = cfg.rollout.generators + 1
    store = loopback_store(world, _timeout(cfg))
    text = to_yaml(cfg).encode()
    procs = []
    for rank in range(1, world):
        env = {**os.environ, ROLE_ENV: "generator", "GSPO_ASYNC_RANK": str(rank), "GSPO_ASYNC_WORLD": str(world),
               "GSPO_ASYNC_PORT": str(store.port), "GSPO_ASYNC_PARENT": str(os.getpid())}
        p = subprocess.Popen([sys.executable, "-c", "from gspo.train.async_generator import main; main()"], env=env,
                             stdin=subprocess.PIPE)
        p.stdin.write(text)
        p.stdin.close()
        procs.append(p)
        print(f"async mode: generator {rank} started (pid {p.pid})", file=sys.stderr, flush=True)
    return Job(world_size=world, procs=procs, store=store, local=True)


def loopback_store(world: int, timeout) -> dist.TCPStore:
    """The job's store server, listening on 127.0.0.1 only. torch's server binds every interface
    whatever host it is given, so gspo binds the listening socket itself and hands it over
    (`master_listen_fd`; the store owns it from then on). Processes forked from this one (reward
    and tool workers) close their copy of it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    global _LISTENING
    _LISTENING = (fd, os.fstat(fd).st_ino)
    return store


_LISTENING: tuple[int, int] | None = None  # the store's listening socket: (fd, inode)


def _close_listening_in_child() -> None:
    global _LISTENING
    if _LISTENING is None:
        return
    fd, ino = _LISTENING
    _LISTENING = None  # a grandchild has nothing more to close
    try:
        if os.fstat(fd).st_ino == ino:  # still that socket (not a later file on a reused number)
            os.close(fd)
    except OSError:
        pass


os.register_at_fork(after_in_child=_close_listening_in_child)


def _gloo(store, job: Job, timeout) -> dist.ProcessGroupGloo:
    """A gloo group of the whole job; on one machine its sockets listen on 127.0.0.1, not on the
    address the host name resolves to."""
    if not job.local:
        return dist.ProcessGroupGloo(store, job.rank, job.world_size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, job.rank, job.world_size, opts)


def connect(job: Job, cfg: Config, device: torch.device) -> None:
    """Form the job's groups on its store, as objects of their own (never the default group):
    gloo for commands and rollouts, and gloo on CPU or NCCL on GPU for the weights. The
    learner watches its spawned generators meanwhile, so that one that fails while it loads
    stops the start-up at once with its own error."""
    timeout = _timeout(cfg)
    job.device = device

    def make():
        job.pg = _gloo(dist.PrefixStore("gspo/job", job.store), job, timeout)
        backend = _weights_backend(device)
        wstore = dist.PrefixStore("gspo/weights", job.store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            job.weights_pg = dist.ProcessGroupNCCL(wstore, job.rank, job.world_size, opts)
        else:
            job.weights_pg = _gloo(wstore, job, timeout)

    if not job.procs:
        make()
        return
    done: list = []
    t = threading.Thread(target=lambda: done.append(_try(make)), daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)
        for r in job.generator_ranks():
            why = job.dead(r)
            if why and t.is_alive():
                raise GeneratorError(f"{why} while starting (its error is printed above)")
    if done and done[0] is not None:
        raise done[0]


def _try(fn):
    try:
        fn()
    except Exception as e:  # handed to the waiting thread
        return e
    return None


def _timeout(cfg: Config):
    import datetime

    return datetime.timedelta(seconds=cfg.distributed.timeout_s)


def close_job(job: Job, grace_s: float = 10.0, clean: bool = True) -> None:
    """Wait for (then kill) the spawned generators and let go of the job's groups, unless an
    operation on them may still be pending (`clean` False, or a generator died): tearing a
    group down under a blocked receive aborts the process, which is about to exit anyway."""
    deadline = time.monotonic() + grace_s
    for p in job.procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if clean and not any(p.returncode not in (0, None) for p in job.procs):
        job.pg = job.weights_pg = None
    else:
        global LEFT_PENDING
        LEFT_PENDING = True


# A job closed with an operation on its groups still pending (a receive from a generator that
# died): the interpreter's own exit would destroy the groups under it, and gloo then aborts the
# process (exit 134, "terminate called without an active exception") after the run has saved and
# said why it stopped. `gspo`'s entry point ends such a process with os._exit instead.
LEFT_PENDING = False
