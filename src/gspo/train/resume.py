"""Where a run starts (`resume_point`): the checkpoint that `resume` names, or none.

- `resume=auto` continues from the run directory's last whole checkpoint. When there is none
  though the directory holds a run (it stopped before its first checkpoint), the run starts
  over and what it wrote is set aside in `stopped-<UTC time>/`, never deleted.
- A run directory that holds a run is refused without `resume=auto` (one run per directory),
  and so is one another live process is running in (`claim_run_dir`).
- Settings that differ from the checkpoint's are listed in a warning (`changed_settings`): the
  optimizer's state and hyperparameters come from the checkpoint, so changes of those do not
  act, and the run's config keeps the checkpoint's (`keep_optimizer_settings`); the learning-rate schedule (`schedule.*`) acts from the checkpoint's step on. A changed LoRA or tiny-model shape, which the checkpoint's weights would not
  fit, is refused before the model loads.
- The starting weights a run's checkpoints do not hold (LoRA's base, the KL reference) must
  still be the ones at model.name_or_path (`base_weights_fingerprint`, `check_base_weights`).
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import sys
from pathlib import Path

from gspo.config import Config, ConfigError
from gspo.config.rules import needs_reference
from gspo.models import weights_fingerprint
from gspo.train import checkpoint as ckpt
from gspo.train.distributed import Dist

# the settings a resume is meant to change, and those whose change the checkpoint cannot take
FREE = ("resume", "schedule.rollouts", "threads", "output.", "logging.", "checkpoint.", "data.resume_on_changed")
SHAPE, SHAPE_FREE = ("lora.", "tiny."), ("lora.merge_final", "lora.dropout")


def changed_settings(checkpoint_dir: Path, cfg: Config) -> list[str]:
    """'field: old -> new' for each setting of `cfg` that differs from the checkpoint's own
    config.yaml, leaving out those a resume is meant to change (`FREE`) and those left to
    "auto", which start-up resolves (the checkpoint holds the resolved value)."""
    from gspo.config import from_yaml_text
    from gspo.report.trackers import flat_config

    path = checkpoint_dir / ckpt.CONFIG_FILE
    if not path.is_file():
        return []
    old, new = flat_config(from_yaml_text(path.read_text())), flat_config(cfg)
    return [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items()
            if not k.startswith(FREE) and v != "auto" and old.get(k) != v]


# the settings the optimizer's own state holds (its param groups), which a resume takes from the checkpoint
OPTIMIZER_HELD = ("lr", "beta1", "beta2", "adam_eps", "weight_decay", "router_lr_scale")


def keep_optimizer_settings(checkpoint_dir: Path, cfg: Config, changed: list[str]) -> list[str]:
    """Set `cfg`'s optimizer hyperparameters that `changed` lists back to the checkpoint's: the
    optimizer's state brings those back, so the run's config.yaml (and its report) would record
    values that never acted. Returns the fields set back."""
    from gspo.config import from_yaml_text

    keys = [k for k in OPTIMIZER_HELD if any(c.startswith(f"optim.{k}:") for c in changed)]
    if keys:
        old = from_yaml_text((checkpoint_dir / ckpt.CONFIG_FILE).read_text()).optim
        for k in keys:
            setattr(cfg.optim, k, getattr(old, k))
    return [f"optim.{k}" for k in keys]


LOCK = ".lock"  # the pid of the process that runs in a run directory


def claim_run_dir(run_dir: Path, d: Dist) -> Path | None:
    """One run per directory, also for runs started at once (the checks below look for what a
    run writes once its model has loaded): rank 0 writes its pid to run_dir/.lock, and a lock of
    another live process is one error. Returns the lock for `release_run_dir` (None on other ranks)."""
    if not d.is_main:
        return None
    lock = run_dir / LOCK
    try:
        holder = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        holder = 0
    if holder and ckpt.pid_alive(holder):
        raise ConfigError(f"config field 'output.name': run directory {run_dir} is in use by another gspo process "
                          f"(pid {holder}); wait for it to end, or choose another output.name")
    lock.write_text(f"{os.getpid()}\n")
    return lock


def release_run_dir(lock: Path | None) -> None:
    """Remove this process's lock (`claim_run_dir`) as its run ends."""
    try:
        if lock is not None and lock.read_text().strip() == str(os.getpid()):
            lock.unlink()
    except OSError:
        pass


# what a run writes in its directory (and `gspo report`, `gspo demo`): all that a restart sets aside
RUN_ENTRIES = ("config.yaml", "metrics.jsonl", "completions", ckpt.CHECKPOINTS, "final", "final.partial",
               "trackers.json", "tensorboard", "wandb", "mlruns", "vllm", "report.html", "plots", "summary.json",
               "warmup", ".gspo-demo")


def set_aside(run_dir: Path) -> Path:
    """Move what a run wrote in its directory (`RUN_ENTRIES`) into run_dir/stopped-<UTC time>/
    (earlier such folders stay); files the run did not write stay where they are."""
    aside = run_dir / f"stopped-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S%fZ}"
    aside.mkdir()
    for entry in sorted(run_dir.iterdir()):
        if entry.name in RUN_ENTRIES:
            shutil.move(str(entry), str(aside / entry.name))
    return aside


def foreign_entries(run_dir: Path) -> list[str]:
    """What a run directory holds that no gspo run wrote there (a user's own files)."""
    return sorted(e.name for e in run_dir.iterdir() if e.name not in RUN_ENTRIES and e.name != LOCK
                  and not e.name.startswith(("stopped-", ".write-test-")))


def resume_point(cfg: Config, d: Dist) -> Path | None:
    """The checkpoint this run continues from (None: it starts at rollout 0), after the checks
    above; every rank calls it, and rank 0 alone writes to the run directory."""
    run_dir = cfg.run_dir
    resume_from = ckpt.resolve_resume(run_dir, cfg.resume)
    restart = resume_from is None and ((run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists())
    if restart and str(cfg.resume).strip().lower() != "auto":
        raise ConfigError(f"config field 'output.name': run directory {run_dir} already holds a run; "
                          f"continue it with resume=auto, or choose another output.name")
    if resume_from is not None:
        check_layout(resume_from, cfg, d)
    changed = changed_settings(resume_from, cfg) if resume_from is not None else []
    shape = [c for c in changed if c.startswith(SHAPE) and not c.startswith(SHAPE_FREE)]
    if shape:  # the checkpoint's weights would not fit the model built from these settings
        raise ConfigError(f"config field '{shape[0].split(':')[0]}': a resume continues the checkpoint's model, "
                          f"which these settings change ({'; '.join(shape)}); start a new run (output.name) instead")
    kept = keep_optimizer_settings(resume_from, cfg, changed) if changed else []
    if changed and d.is_main:
        stay = f" ({', '.join(kept)} stay the checkpoint's, as the run's config.yaml records)" if kept else ""
        print(f"warning: resuming with settings that differ from the checkpoint's: {'; '.join(changed)}. "
              f"The optimizer's state and hyperparameters come from the checkpoint{stay}, and the learning-rate "
              "schedule (schedule.*) acts from the checkpoint's step on; "
              "a changed model, data or batch shape makes this no longer the run it continues", file=sys.stderr)
    foreign = foreign_entries(run_dir) if resume_from is None and not restart and d.is_main else []
    if foreign:
        print(f"warning: run directory {run_dir} already holds files no gspo run wrote ({', '.join(foreign[:4])}"
              f"{', ...' if len(foreign) > 4 else ''}); the run writes its own beside them (output.dir / output.name "
              "choose another directory)", file=sys.stderr)
    if resume_from is None and not restart and str(cfg.resume).strip().lower() == "auto" and d.is_main:
        print(f"resume=auto: no run in {run_dir} yet, so a new one starts at rollout 0", file=sys.stderr)
    d.barrier()  # every rank has looked at the run directory before rank 0 writes to it
    if restart:
        if d.is_main:
            print(f"resume=auto: {run_dir} holds no whole checkpoint (the run stopped before its first), so it "
                  f"starts again from rollout 0; what the stopped run wrote is kept in {set_aside(run_dir)}",
                  file=sys.stderr)
        d.barrier()
    return resume_from


def check_layout(path: Path, cfg: Config, d: Dist) -> None:
    """The checkpoint's learner processes against this job's, before any model loads: a sharded
    (FSDP2) checkpoint is read by as many FSDP2 learners as wrote it, a whole one by as many
    learners without FSDP2 (one process, or DDP), each of which holds its own part of the prompt
    stream and its RNG. It was found only once the models had loaded (under torchrun the
    generator ranks then printed gloo's tracebacks; DDP ranks a missing rng-rankN.json)."""
    manifest = ckpt.verify_checkpoint(path, checksums=False)
    saved = len([f for f in manifest["files"] if re.fullmatch(r"rng(-rank\d+)?\.json", Path(f).name)]) or 1
    sharded = bool(manifest.get("sharded", False))
    now_sharded = d.enabled and cfg.distributed.strategy == "fsdp"
    if sharded == now_sharded and saved == d.world_size:
        return
    was = (f"{saved} FSDP2 learner processes" if sharded else "one learner process (whole weights)" if saved == 1
           else f"{saved} learner processes without FSDP2 (whole weights)")
    now = f"{d.world_size} FSDP2 learner processes" if now_sharded else (
        f"{d.world_size} {cfg.distributed.strategy} learner processes" if d.enabled else "one learner process")
    raise ConfigError(f"config field 'resume': checkpoint {path} was written by {was}, and this job has {now}; "
                      f"resume it with the layout that wrote it (torchrun --nproc-per-node, rollout.generators, "
                      f"distributed.strategy)")


def base_weights_fingerprint(cfg: Config, model) -> str:
    """`weights_fingerprint` of the weights at model.name_or_path where a run's checkpoints do not
    hold them: LoRA's frozen base, and the KL reference (the starting weights); "" otherwise.
    A resumed run whose base has changed since (a folder rewritten by another run) is refused."""
    if not (cfg.lora.enabled or needs_reference(cfg)):
        return ""
    return weights_fingerprint(p for p in model.parameters() if not (cfg.lora.enabled and p.requires_grad))


def check_base_weights(cfg: Config, saved: str, now: str) -> None:
    """One error where the weights at model.name_or_path are not the ones the resumed run started from."""
    if saved and now and saved != now:
        raise ConfigError(f"config field 'model.name_or_path': the weights at {cfg.model.name_or_path} are not the "
                          f"ones this run started from, which its checkpoints do not hold ("
                          + ("LoRA adapters train on them" if cfg.lora.enabled else "the KL reference is them")
                          + f"; fingerprint {now}, the run's {saved}); resume with the model it started from, or "
                          f"start a new run")
