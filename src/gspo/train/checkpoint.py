"""Crash-safe training checkpoints: save, verify, find the one to resume from, load.

Layout under a run directory::

    <run_dir>/checkpoints/
        step-<N>/
            model.safetensors   model state dict (tied/shared tensors stored once)
            optimizer.pt        optimizer.state_dict(); read back only with weights_only=True
            scheduler.json      the JSON-able part of scheduler.state_dict()
            rng.json            python / numpy / torch CPU / every CUDA device RNG state
            trainer_state.json  whatever JSON dict the trainer passes (step, sampler position, ...)
            config.yaml         the resolved config text
            COMPLETE            manifest: every file's name, size and sha256; written last
        latest                  text file naming the newest step directory; written last
        .tmp-step-<N>-<pid>/    a save in progress (or left behind by a crash)

A save builds everything in the temp directory, fsyncs each file and the directory, renames
it to ``step-<N>``, fsyncs ``checkpoints/``, then atomically replaces ``latest``. A crash (or
kill -9, or a full disk) at any point leaves the previous checkpoint and ``latest`` usable.
Nothing is ever unpickled: tensors go through safetensors or ``torch.load(weights_only=True)``,
everything else through JSON.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from gspo.train import faults
from gspo.config import CheckpointConfig, ConfigError
from gspo.train.state_io import (  # noqa: F401  (re-exported: part of this module's API)
    CheckpointWarning, load_scheduler_state, scheduler_json, capture_rng_state, load_model_state,
    load_optimizer_state, restore_rng_state, save_model_state, save_optimizer_state,
)

__all__ = [
    "CheckpointError", "CheckpointWarning", "save_checkpoint", "load_checkpoint", "verify_checkpoint",
    "list_checkpoints", "find_resume_checkpoint", "resolve_resume", "capture_rng_state", "restore_rng_state",
    "save_model_state", "load_model_state", "save_optimizer_state", "load_optimizer_state",
]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "COMPLETE"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.json"
RNG_FILE = "rng.json"
TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-.*-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found, verified or loaded; the message names the path."""


# ----------------------------------------------------------------------------- fsync helpers


def _fsync_path(path: Path) -> None:
    """fsync a file or directory by path (directories: so a rename inside it is durable)."""
    if path.is_dir() and os.name == "nt":  # Windows cannot open directories; renames are durable enough
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- save


def _step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _step_dirs(root: Path) -> list[Path]:
    """All ``step-<N>`` directories under ``root``, newest (highest N) first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(dirs, key=_step_of, reverse=True)


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours from an earlier failed attempt in this process: stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_tmp(root: Path) -> None:
    """Delete temp dirs left by crashed saves (any whose writer pid is no longer running)."""
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if m and not pid_alive(int(m.group(1))):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _rng_file(rank: int) -> str:
    return RNG_FILE if rank == 0 else f"rng-rank{rank}.json"


def _write_state_files(tmp: Path, step: int, model, optimizer, rng: dict, trainable_only: bool,
                       write_state, rank: int) -> None:
    """What every rank writes: the model and optimizer (a sharded `write_state(tmp)`, or rank
    0's plain files) and this rank's RNG state."""
    if write_state is not None:
        write_state(tmp)
    elif rank == 0:
        save_model_state(model, tmp / MODEL_FILE, trainable_only=trainable_only)
    faults.in_save(step)  # tests only: a kill with the checkpoint half written
    if write_state is None and rank == 0 and optimizer is not None:
        save_optimizer_state(optimizer, tmp / OPTIMIZER_FILE)
    _write_text(tmp / _rng_file(rank), json.dumps(rng))


def _write_manifest(tmp: Path, step: int, scheduler, state_text: str, config_text: str,
                    trainable_only: bool, sharded: bool) -> None:
    """Rank 0, after every rank has written: the JSON files, then the manifest, which goes last
    so that its presence means 'complete'."""
    if scheduler is not None:
        _write_text(tmp / SCHEDULER_FILE, json.dumps(scheduler_json(scheduler), indent=1))
    _write_text(tmp / TRAINER_STATE_FILE, state_text)
    _write_text(tmp / CONFIG_FILE, config_text)
    files = {}
    for f in sorted(q for q in tmp.rglob("*") if q.is_file()):
        _fsync_path(f)
        files[f.relative_to(tmp).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    for d in sorted({f.parent for f in tmp.rglob("*") if f.is_file()}):
        _fsync_path(d)
    manifest = {"format": FORMAT_VERSION, "step": step, "trainable_only": trainable_only,
                "sharded": sharded, "files": files}
    _write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_path(tmp)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".tmp-latest-{os.getpid()}"
    _write_text(tmp, name + "\n")
    os.replace(tmp, root / LATEST)
    _fsync_path(root)


def resume_here(path: Path) -> None:
    """A run resumed from one of its own checkpoints that ``latest`` does not name (resume=PATH
    to an older one): ``latest`` names it from now on, as metrics.jsonl is cut to it, so a stop
    before the next save resumes from here again, not from the abandoned newer checkpoints."""
    root = Path(path).parent
    if root.name == CHECKPOINTS and _read_latest(root) not in (None, Path(path).name):
        _write_latest(root, Path(path).name)


def _prune(root: Path, current: Path, keep_last: int, previous_latest: str | None) -> None:
    """Keep ``current`` plus the newest ``keep_last - 1`` complete checkpoints older than it.

    Checkpoints with a higher step than ``current`` come from an earlier run that went further
    (the trainer resumed from an older one); they are never deleted, and a warning says so on
    the save that moves ``latest`` away from them.
    """
    step = _step_of(current)
    newer = [p.name for p in _step_dirs(root) if _step_of(p) > step]
    if previous_latest in newer:
        warnings.warn(f"{root} holds checkpoints newer than step {step} from an earlier run: {newer}; "
                      f"they are kept, but `latest` now names {current.name}", CheckpointWarning, stacklevel=3)
    kept = 1
    for p in _step_dirs(root):
        if _step_of(p) >= step:
            continue
        if kept < keep_last and (p / MANIFEST).is_file():
            kept += 1
        else:
            shutil.rmtree(p, ignore_errors=True)


def disk_full_hint(e: BaseException, where: Path) -> str:
    """" (disk full?)" for an error of a write that ran out of space: ENOSPC / EDQUOT, or any
    error (torch.save and safetensors raise their own) where under 16 MiB is left."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return " (disk full?)"
    try:
        return " (disk full?)" if shutil.disk_usage(where).free < 16 * 2**20 else ""
    except OSError:
        return ""


def save_checkpoint(run_dir, step: int, *, model: torch.nn.Module, optimizer=None, scheduler=None,
                    trainer_state: dict, config_text: str = "", keep_last: int = CheckpointConfig.keep_last,
                    trainable_only: bool = False, comm=None, write_state=None, write_extra=None) -> Path:
    """Atomically write ``<run_dir>/checkpoints/step-<step>/`` and point ``latest`` at it.

    Returns the checkpoint directory. Any failure while writing (a full disk, a permission
    error, ...) raises ``CheckpointError`` naming the path and the cause, removes the partial
    temp directory and leaves the previous checkpoint and ``latest`` untouched. Afterwards all
    but the newest ``keep_last`` complete checkpoints are deleted. ``trainer_state`` must be
    JSON-able (tuples come back as lists, dict keys as strings). ``model`` is the unwrapped
    module (not DDP/FSDP).

    Several processes (``comm``: a `gspo.train.distributed.Dist`) call this together: each writes its
    own RNG state and its part of ``write_state(tmp_dir)`` (a sharded model + optimizer writer;
    without one, rank 0 writes the plain files); rank 0 then writes the rest and publishes the
    checkpoint. The run directory must be one filesystem that all ranks see. ``write_extra(tmp_dir)``,
    when given, lets every rank add files of its own (async mode's rollouts in flight, each learner
    rank its part); the manifest covers them like the rest.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    rank = comm.rank if comm is not None else 0
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step}"
    try:
        state_text = json.dumps(trainer_state, indent=1, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"trainer_state for {final} is not JSON-serialisable: {e}") from e
    rng = capture_rng_state()  # before any I/O so the saved state is exactly the trainer's

    pid = comm.broadcast_object(os.getpid()) if comm is not None else os.getpid()
    tmp = root / f".tmp-step-{step}-{pid}"
    old = root / f".tmp-old-step-{step}-{pid}"
    error = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale_tmp(root)
            tmp.mkdir()
        if comm is not None:
            comm.barrier()
        _write_state_files(tmp, step, model, optimizer, rng, trainable_only, write_state, rank)
        if write_extra is not None:
            write_extra(tmp)
        if comm is not None:
            comm.barrier()
        if rank == 0:
            _write_manifest(tmp, step, scheduler, state_text, config_text, trainable_only,
                            sharded=write_state is not None)
            if final.exists():  # from an earlier (possibly partial) run: set aside, delete once replaced
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_path(root)
    except BaseException as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not final.exists():
                os.replace(old, final)  # the earlier step-<N> was set aside but not replaced: put it back
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt etc.: clean up, do not wrap
        cause = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
        error = (f"could not save checkpoint {final}: {type(e).__name__}: {cause}{disk_full_hint(e, root)}; "
                 f"{_latest_note(root)}")
        if comm is None:
            raise CheckpointError(error) from e
    if rank == 0 and error is None:
        shutil.rmtree(old, ignore_errors=True)
        previous_latest = _read_latest(root)
        try:
            _write_latest(root, final.name)
            _prune(root, final, keep_last, previous_latest)
        except OSError as e:
            error = (f"checkpoint {final} was written but {root / LATEST} could not be updated: "
                     f"{os.strerror(e.errno) if e.errno else e}; {_latest_note(root)}")
    if comm is not None:
        error = comm.broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)
    return final


def _latest_note(root: Path) -> str:
    target = _read_latest(root)
    return f"the previous checkpoint {root / target} is untouched" if target else "no earlier checkpoint exists"


# ----------------------------------------------------------------------------- verify / find


def _read_latest(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name if _STEP_RE.match(name) else None


def latest_checkpoint(run_dir) -> str | None:
    """The name of a run's newest whole checkpoint (what `latest` names); None before its first."""
    return _read_latest(Path(run_dir) / CHECKPOINTS)


def verify_checkpoint(path, *, checksums: bool = True) -> dict:
    """Check ``path`` against its manifest (sizes, and sha256 if ``checksums``); return the manifest.

    Raises ``CheckpointError`` naming the directory and what is wrong.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = {name: (int(meta["size"]), str(meta["sha256"])) for name, meta in manifest["files"].items()}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} manifest") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable {MANIFEST} manifest: {e}") from e
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
    for name, (size, sha256) in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} has {f.stat().st_size} bytes, "
                                  f"manifest says {size}")
        if checksums and _sha256(f) != sha256:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} fails its sha256 check")
    return manifest


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints under ``run_dir``, newest (highest step) first.

    'Complete' here is the cheap check (manifest present, file sizes match); checksums are
    verified by ``find_resume_checkpoint`` and ``load_checkpoint``.
    """
    out = []
    for p in _step_dirs(Path(run_dir) / CHECKPOINTS):
        try:
            verify_checkpoint(p, checksums=False)
            out.append(p)
        except CheckpointError:
            pass
    return out


def find_resume_checkpoint(run_dir) -> Path | None:
    """The checkpoint to resume from: ``latest`` if it verifies, else the newest that verifies.

    Each partial or corrupt checkpoint is skipped with a ``CheckpointWarning`` naming it.
    Returns None only when there are no checkpoint directories at all (temp dirs of crashed
    saves do not count); if some exist but none verifies, raises ``CheckpointError``.
    """
    root = Path(run_dir) / CHECKPOINTS
    dirs = _step_dirs(root)
    latest = _read_latest(root)
    if latest is not None and not (root / latest).is_dir():
        warnings.warn(f"{root / LATEST} names {latest}, which does not exist; "
                      "falling back to the newest complete checkpoint", CheckpointWarning, stacklevel=2)
    if not dirs:
        return None
    if latest is not None and root / latest in dirs:
        dirs.remove(root / latest)
        dirs.insert(0, root / latest)
    problems = []
    for p in dirs:
        try:
            verify_checkpoint(p)
            return p
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {p}: {e}", CheckpointWarning, stacklevel=2)
            problems.append(str(e))
    raise CheckpointError(f"found {len(dirs)} checkpoints in {root} but none is complete: " + "; ".join(problems))


def resolve_resume(run_dir, resume: str | None) -> Path | None:
    """Turn a ``resume`` setting into a checkpoint path (or None to start fresh).

    ``"auto"``: ``find_resume_checkpoint(run_dir)``. ``"none"``, ``""`` or None: start fresh.
    Anything else is the path of a checkpoint directory, which must verify.
    """
    key = "" if resume is None else str(resume).strip()
    if key.lower() == "auto":
        return find_resume_checkpoint(run_dir)
    if key.lower() in ("", "none"):
        return None
    path = Path(key).expanduser()
    if not path.is_dir():
        import difflib

        guess = " (did you mean resume=auto?)" if difflib.get_close_matches(key.lower(), ["auto", "none"], n=1) else ""
        raise ConfigError(f"config field 'resume': {key!r} is not auto, none or a checkpoint folder{guess}")
    if (path / CHECKPOINTS).is_dir() or (path.name == CHECKPOINTS and (path / LATEST).is_file()):
        run = path if (path / CHECKPOINTS).is_dir() else path.parent
        raise ConfigError(f"config field 'resume': {path} is a run's {'folder' if run == path else 'checkpoints folder'}, "
                          f"not one checkpoint; continue the run with resume=auto output.dir={run.parent} "
                          f"output.name={run.name}, or name one of its checkpoints ({run / CHECKPOINTS}/step-N)")
    if (path / "config.json").is_file() and not (path / "trainer_state.json").is_file():
        raise ConfigError(f"config field 'resume': {path} is a model folder, not a checkpoint; to train from these "
                          f"weights set model.name_or_path={path} (a run's checkpoints are in RUN/checkpoints/step-N, "
                          f"and resume=auto finds the newest)")
    try:
        verify_checkpoint(path)
    except CheckpointError as e:
        hint = (f" ({path} looks like a run directory; continue it with resume=auto output.dir={path.parent} "
                f"output.name={path.name})"
                if (path / CHECKPOINTS).is_dir() else "")
        raise CheckpointError(f"resume={resume!r}: {e}{hint}") from e
    return path


# ----------------------------------------------------------------------------- load


def load_checkpoint(path, *, model: torch.nn.Module, optimizer=None, scheduler=None,
                    restore_rng: bool = True, read_state=None, rank: int = 0) -> dict:
    """Verify ``path`` and load it into ``model`` (and ``optimizer``/``scheduler`` if given).

    Returns the trainer_state dict. Restores the RNG states unless ``restore_rng`` is False.
    The config text is at ``path / "config.yaml"``. Raises ``CheckpointError`` naming the
    directory on any problem (missing files, checksum mismatch, keys that do not fit).
    A sharded checkpoint is read by ``read_state(path)`` (every rank calls this together), and
    ``rank`` picks the RNG state that rank saved.
    """
    path = Path(path)
    manifest = verify_checkpoint(path)
    files = manifest["files"]
    sharded = manifest.get("sharded", False)
    if sharded and read_state is None:
        raise CheckpointError(f"checkpoint {path} is sharded (saved by a multi-process run); "
                              f"resume it with torchrun and the same distributed settings")
    if not sharded and read_state is not None:
        raise CheckpointError(f"checkpoint {path} was saved by one process with a full model; "
                              f"it cannot be read into a sharded (FSDP) run")
    for wanted, name in ((optimizer, OPTIMIZER_FILE), (scheduler, SCHEDULER_FILE)):
        if wanted is not None and name not in files and not (sharded and name == OPTIMIZER_FILE):
            raise CheckpointError(f"checkpoint {path} has no {name}, but one was asked to be loaded")
    try:
        if sharded:
            read_state(path)
        else:
            load_model_state(model, path / MODEL_FILE, trainable_only=manifest.get("trainable_only", False))
        if optimizer is not None and not sharded:
            load_optimizer_state(optimizer, path / OPTIMIZER_FILE)
        if scheduler is not None:
            load_scheduler_state(scheduler, json.loads((path / SCHEDULER_FILE).read_text(encoding="utf-8")))
        trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
        if restore_rng:
            rng_file = path / _rng_file(rank)
            if not rng_file.is_file():
                raise CheckpointError(f"checkpoint {path} has no {rng_file.name}: it was saved by fewer ranks; "
                                      f"resume with the same number of processes")
            restore_rng_state(json.loads(rng_file.read_text(encoding="utf-8")))
    except Exception as e:
        raise CheckpointError(f"could not load checkpoint {path}: {type(e).__name__}: {e}") from e
    return trainer_state
