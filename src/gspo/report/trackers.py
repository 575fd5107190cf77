"""Experiment trackers for `logging.report_to` (TRL's names): tensorboard, wandb, trackio, mlflow.

Each tracker mirrors the run directory: every optimizer step's record of `metrics.jsonl` (its
numbers; None / NaN left out), every `completions/` file as a table, and the resolved config as
the run's config. All four sit behind the same three calls (`log`, `table`, `close`) and import
their package only when named. Rank 0 alone opens them (`gspo.train`).

Resume continues the same tracker run (its id is kept in `runs/NAME/trackers.json`) and leaves
every step in it exactly once. A killed run can leave a tracker holding less than the checkpoint
(W&B writes its file every 15 s, trackio every 0.5 s: both lose what was buffered) or more (the
steps past it). So each tracker says which step it already holds (`held`): later records up to
it are skipped, and those between it and the checkpoint are replayed from metrics.jsonl and
completions/, which hold the run's own numbers up to the checkpoint. TensorBoard alone can drop
steps: it purges those past the checkpoint (`purge_step`) and flushes every step, so it holds
exactly the checkpoint's. The others keep the steps past it that they hold; the resumed run
recomputes those with the same numbers, timings aside.
"""

from __future__ import annotations

import importlib
import json
import netrc
import os
import struct
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gspo.config import Config, ConfigError, to_yaml
from gspo.report.sinks import jsonable, read_metrics


def check_available(names: list[str]) -> None:
    """One ConfigError naming the extra to install for the first named tracker whose package
    does not import (at start-up, before any model loads)."""
    for name in names:
        try:
            importlib.import_module(TRACKERS[name].package)
        except ImportError:
            raise ConfigError(f"config field 'logging.report_to': {name} is not installed: "
                              f"pip install 'gspo[{name}]'") from None


def open_trackers(cfg: Config, step: int) -> "Trackers":
    """The trackers `logging.report_to` names, for a run that starts at optimizer step `step` (0,
    or the checkpoint it resumes from): each reattached to its earlier run and caught up to
    `step`. A tracker added on a resume gets the whole history so far."""
    path = cfg.run_dir / "trackers.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    opened = {name: TRACKERS[name](cfg, saved.get(name, {}), step) for name in cfg.logging.report_to}
    if opened:  # (a tracker left out this time keeps its entry, for a later resume that names it)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**saved, **{n: t.state for n, t in opened.items()}}, indent=1))
        os.replace(tmp, path)
    trackers = Trackers(list(opened.values()))
    trackers.catch_up(cfg.run_dir, step)
    return trackers


class Trackers:
    """The opened trackers, each skipping the steps it already holds."""

    def __init__(self, trackers: list):
        self.trackers = trackers

    def log(self, record: dict) -> None:
        step, values = record["step"], scalars(record)
        for t in self.trackers:
            if step > t.held:
                t.log(step, values)

    def table(self, step: int, rows: list[dict]) -> None:
        columns, data = completions_table(rows)
        for t in self.trackers:
            if step > _table_held(t):
                t.table(step, columns, data)

    def catch_up(self, run_dir: Path, last_step: int) -> None:
        """Replay the records and completions of steps in (held, last_step] from the run
        directory, in step order (W&B drops a step lower than one it has seen)."""
        if all(min(t.held, _table_held(t)) >= last_step for t in self.trackers) or \
                not (run_dir / "metrics.jsonl").exists():
            return
        tables = {int(p.stem.split("-")[1]): p for p in (run_dir / "completions").glob("step-*.jsonl")}
        for rec in read_metrics(run_dir / "metrics.jsonl"):  # (truncated to last_step on resume)
            step = rec["step"]
            Trackers([t for t in self.trackers if t.held < step <= last_step]).log(rec)
            if step in tables:  # a completions table is logged after its step's record
                behind = Trackers([t for t in self.trackers if _table_held(t) < step <= last_step])
                behind.table(step, [json.loads(x) for x in tables[step].read_text().splitlines()])

    def close(self) -> None:
        """Close every tracker, even after one fails (its error is raised at the end)."""
        error = None
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error


def _table_held(tracker) -> int:
    """The last step whose completions table `tracker` holds: its `held` step, unless it can tell
    the tables apart (MLflow's artifacts), where a kill may have fallen between the two."""
    return getattr(tracker, "table_held", tracker.held)


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers, without its step and without None / NaN / inf."""
    out = {}
    for k, v in record.items():
        v = jsonable(v)
        if k != "step" and isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def completions_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """`completion_rows` (or a completions/ file) as columns and rows; each reward function's
    score gets a column of its own (reward/NAME)."""
    fns = list(rows[0].get("rewards", {})) if rows else []
    columns = ["step", "prompt", "completion", "reward", "advantage", "finish_reason", *(f"reward/{f}" for f in fns)]
    data = [[r["step"], r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"]),
             r["completion"], jsonable(r["reward"]), jsonable(r["advantage"]), r["finish_reason"],
             *(jsonable(r["rewards"][f]) for f in fns)] for r in rows]
    return columns, data


def config_dict(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def flat_config(cfg: Config) -> dict[str, Any]:
    """The config as dotted keys (rollout.group_size); lists and None as JSON text."""
    out = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = v if isinstance(v, (str, int, float, bool)) else json.dumps(v)

    walk(config_dict(cfg), "")
    return out


# ---------------------------------------------------------------- the trackers


class TensorBoard:
    """Event files in runs/NAME/tensorboard: scalars in float64 (the numbers of metrics.jsonl,
    not float32 roundings), each completions table as a text table, the config as hparams
    (dotted keys) and as YAML text."""

    package = "tensorboard"

    def __init__(self, cfg: Config, saved: dict, step: int):
        from torch.utils.tensorboard import SummaryWriter

        logdir = cfg.run_dir / "tensorboard"
        self.held = step if any(logdir.glob("events.out.tfevents.*")) else -1
        self.state: dict = {}
        # TensorBoard's reader drops the events at purge_step and after from earlier files
        self.writer = SummaryWriter(str(logdir), purge_step=self.held + 1)
        if self.held < 0:
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(flat_config(cfg), {}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", f"```yaml\n{to_yaml(cfg)}```")

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step, new_style=True, double_precision=True)
        self.writer.flush()  # on disk before the checkpoint that covers it: a resume purges only later steps

    def table(self, step: int, columns: list[str], data: list[list]) -> None:
        import numpy as np
        from tensorboard.plugins.text.summary_v2 import text_pb

        cells = np.array([columns] + [[str(x) for x in row] for row in data], dtype=object)  # (1 + rows, cols)
        self.writer.file_writer.add_summary(text_pb("completions", cells), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _RunLogger:
    """W&B and trackio share one client shape: `run.log(values, step=)`, a `Table(columns, data)`
    in the package named by `package`, `run.finish()`."""

    package = ""
    run = None

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, columns: list[str], data: list[list]) -> None:
        import importlib

        table = importlib.import_module(self.package).Table(columns=columns, data=data)
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class WandB(_RunLogger):
    """A W&B run under runs/NAME/wandb: offline (upload with `wandb sync`) unless an API key is
    set (WANDB_API_KEY, or `wandb login`'s netrc entry) or WANDB_MODE says otherwise; the
    completions as a Table, the config as the run's config."""

    package = "wandb"

    def __init__(self, cfg: Config, saved: dict, step: int):
        import wandb

        run_id = saved.get("id") or uuid.uuid4().hex[:8]
        held = _wandb_files_step(cfg.run_dir, run_id)  # (read before this session's file exists)
        mode = None if os.environ.get("WANDB_MODE") or _wandb_logged_in() else "offline"
        self.run = wandb.init(project=cfg.logging.project, name=cfg.output.name, id=run_id, resume="allow",
                              dir=str(cfg.run_dir), config=config_dict(cfg), mode=mode, reinit="create_new")
        # online, the server says what it holds (the local files may hold steps it never got)
        self.held = self.run.step - 1 if self.run.resumed else held
        self.state = {"id": run_id}



def _wandb_logged_in() -> bool:
    """An API key or identity token in the environment, or the netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return path.is_file() and netrc.netrc(path).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):
        return False


def _wandb_files_step(run_dir: Path, run_id: str) -> int:
    """The last history step in the run's transaction logs (run_dir/wandb/*-ID/run-ID.wandb, one
    per session; -1 without any). W&B writes them every 15 s, so a killed session's file ends
    short of what it was given, or holds nothing."""
    from wandb.proto import wandb_internal_pb2

    last = -1
    for path in (run_dir / "wandb").glob(f"*-{run_id}/run-{run_id}.wandb"):
        for data in _leveldb_log_records(path.read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                last = max(last, rec.history.step.num)
    return last


def _leveldb_log_records(data: bytes):
    """The records of a .wandb file: a 7-byte header (":W&B", key, version), then LevelDB's log
    format: 32 KiB blocks of chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle,
    4 last). A torn tail (a killed writer) ends the records."""
    block, pos, parts = 32768, 7, []
    if data[:4] != b":W&B":
        return
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # (the rest of a block too short for a header is padding)
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        if kind not in (1, 2, 3, 4) or len(chunk) < n:
            return
        pos += 7 + n
        parts = [chunk] if kind in (1, 2) else parts + [chunk]
        if kind in (1, 4):
            yield b"".join(parts)


class Trackio(_RunLogger):
    """A trackio run in trackio's own local store (TRACKIO_DIR, by default
    ~/.cache/huggingface/trackio; `trackio show` opens it), project `logging.project`, named
    output.name; the completions as a trackio Table. Its CPU / GPU monitors stay off: it logs
    what gspo measures."""

    package = "trackio"

    def __init__(self, cfg: Config, saved: dict, step: int):
        import trackio

        project, name = saved.get("project", cfg.logging.project), cfg.output.name
        self.run = trackio.init(project=project, name=name, resume="allow" if saved else "never",
                                config=config_dict(cfg), embed=False, auto_log_gpu=False, auto_log_cpu=False)
        held = trackio.SQLiteStorage.get_max_step_for_run(project, name, run_id=self.run.id)
        self.held = -1 if held is None else held
        # trackio resumes the newest run of that name; a new one is fine when nothing of this run
        # reached the store (a kill can lose it all), another run's is not
        if saved and self.run.id != saved["id"] and self.held >= 0:
            raise ConfigError(f"config field 'output.name': trackio's project {project} holds a newer run named "
                              f"{name} than this one ({saved['id']}; another run directory used the name since), and "
                              f"trackio resumes the newest; to resume, leave trackio out of logging.report_to, or "
                              f"remove the 'trackio' entry of {cfg.run_dir / 'trackers.json'} to log the rest to a "
                              f"new trackio run")
        self.state = {"project": project, "id": self.run.id}



class MLflow:
    """An MLflow run in a file store at runs/NAME/mlruns, or on the server MLFLOW_TRACKING_URI
    names; experiment `logging.project`, run name output.name; the config as params (dotted
    keys), each completions table as an artifact completions/step-NNNNNN.json in log_table's
    layout (columns, data)."""

    package = "mlflow"

    def __init__(self, cfg: Config, saved: dict, step: int):
        own = (cfg.run_dir / "mlruns").resolve().as_uri()  # the run's own file store, wherever its folder is now
        stored = saved.get("tracking_uri")
        if saved:  # the store the run began in; its own store once that holds the run (the folder moved, or
            uri = own if stored is None or _file_store_holds(own, saved["run_id"]) else stored  # was copied)
        else:
            uri = os.environ.get("MLFLOW_TRACKING_URI") or own
        if uri.startswith("file:"):  # MLflow 3 refuses its file store without this opt-in, and
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny has no database store
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        if saved:
            self.run_id = saved["run_id"]
            try:
                self.client.update_run(self.run_id, status="RUNNING")
            except Exception as e:  # noqa: BLE001 (mlflow's MlflowException: the run is not in this store)
                raise ConfigError(f"config field 'logging.report_to': the MLflow run {self.run_id} this run logged to "
                                  f"is not in {uri} ({str(e).splitlines()[0][:200]}); to log the rest of the run to a "
                                  f"new MLflow run, remove the 'mlflow' entry of {cfg.run_dir / 'trackers.json'}") from None
            if uri == own:
                _follow_moved_store(self.client, self.run_id, own)
            self.held = self._last_step()
            done = self.client.list_artifacts(self.run_id, "completions")  # a kill can fall between a record and its table
            self.table_held = max((int(Path(f.path).stem.split("-")[1]) for f in done), default=-1)
        else:
            exp = self.client.get_experiment_by_name(cfg.logging.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.logging.project)
            self.run_id = self.client.create_run(exp_id, run_name=cfg.output.name).info.run_id
            params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
            for i in range(0, len(params), 100):  # (log_batch takes 100 params at a time)
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            self.held = self.table_held = -1
        self.state = {"tracking_uri": None if uri == own else uri, "run_id": self.run_id}

    def _last_step(self) -> int:
        keys = self.client.get_run(self.run_id).data.metrics
        return max((m.step for k in keys for m in self.client.get_metric_history(self.run_id, k)), default=-1)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def table(self, step: int, columns: list[str], data: list[list]) -> None:
        self.client.log_dict(self.run_id, {"columns": columns, "data": data}, f"completions/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _file_store_holds(uri: str, run_id: str) -> bool:
    """Whether the MLflow file store at `uri` holds the run `run_id` (an experiment folder of it)."""
    return any(Path(urlparse(uri).path).glob(f"*/{run_id}/meta.yaml"))


def _follow_moved_store(client, run_id: str, own: str) -> None:
    """A run folder moved or copied since its MLflow file store was made: the store's meta.yaml
    files still name the artifact folders where it began (MLflow writes absolute URIs), so the
    run's tables would go there. Rewrite them to the store where it is now."""
    info = client.get_run(run_id).info
    tail = f"/{info.experiment_id}/{run_id}/artifacts"
    began = info.artifact_uri[: -len(tail)] if info.artifact_uri.endswith(tail) else None
    if began is None or began == own or not began.startswith("file:"):
        return
    store = Path(urlparse(own).path)
    for meta in [*store.glob("*/meta.yaml"), *store.glob("*/*/meta.yaml")]:
        text = meta.read_text()
        if began + "/" in text:
            meta.write_text(text.replace(began + "/", own + "/"))


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}
