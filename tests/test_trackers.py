"""Experiment trackers (`logging.report_to`): each one's store read back with its own reader.

Two real `gspo train` runs with all four trackers: a straight one, and one killed after rollout 3
(checkpoint at rollout 2) then resumed. TensorBoard: event files through EventAccumulator; W&B:
the offline run's `.wandb` transaction logs through wandb's protobuf records; MLflow: the file
store through MlflowClient; trackio: its SQLite database.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.report.sinks import read_metrics
from zygote import gspo

TESTS = Path(__file__).parent
ALL = "logging.report_to=[tensorboard,wandb,trackio,mlflow]"
TINY = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=8",         "eval.num_prompts=4", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "rollout.temperature=1.5", "optim.lr=1e-3", "logging.console=false", "logging.completions_every=1",
        "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]"]  # a reward a random model can move


def gspo_train(tmp: Path, name: str, *extra: str, faults: str = "", env_extra: dict | None = None
               ) -> subprocess.CompletedProcess:
    """`gspo train` in a process of its own (forked from one that has imported torch and gspo but
    no tracker, tests/zygote.py): trackio reads TRACKIO_DIR at import, W&B must see no
    API key (NETRC points nowhere) to go offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    env.update(OMP_WAIT_POLICY="PASSIVE", GSPO_FAULTS=faults, PYTHONPATH=str(TESTS), NETRC=str(tmp / "no-netrc"),
               TRACKIO_DIR=str(tmp / "trackio"), WANDB_SILENT="true", WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp / "wandb-data"), WANDB_CONFIG_DIR=str(tmp / "wandb-config"), **(env_extra or {}))
    return gspo(["train", *TINY, ALL, f"output.dir={tmp}", f"output.name={name}", *extra], env=env, timeout=300)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    # 12 steps make the W&B file cross its 32 KiB block boundary
    p = gspo_train(tmp, "run", "schedule.rollouts=3", "schedule.num_minibatches=4")
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, dict]:
    """Killed after rollout 3 (step 6; checkpoint at step 4), then resumed to step 8. Returns the
    run directory and the last step TensorBoard and MLflow held before the resume."""
    tmp = tmp_path_factory.mktemp("resumed")
    run = ("schedule.rollouts=4", "schedule.num_minibatches=2", "checkpoint.every=2")
    p = gspo_train(tmp, "run", *run, faults="exit_after_rollout=3")
    assert p.returncode == 3, p.stderr[-3000:]
    held = {"tensorboard": max(s for h in tensorboard_scalars(tmp / "run").values() for s, _ in h),
            "mlflow": max(s for h in mlflow_metrics(tmp / "run").values() for s, _ in h)}
    p = gspo_train(tmp, "run", *run, "resume=auto")
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "run", held


# ---------------------------------------------------------------- readers: {key: [(step, value), ...]}


def expected(run_dir: Path) -> dict[str, list]:
    out: dict[str, list] = {}
    for rec in read_metrics(run_dir / "metrics.jsonl"):
        for k, v in rec.items():
            if k != "step" and v is not None:
                out.setdefault(k, []).append((rec["step"], float(v)))
    return out


def without_timings(history: dict[str, list]) -> dict[str, list]:
    return {k: sorted(v) for k, v in history.items() if "time" not in k and k != "tokens_per_s"}


def tensorboard_events(run_dir: Path):
    """The TensorBoard server's own reader (it purges tensor events past a restart's purge_step;
    the older `event_accumulator` does so only for legacy float32 scalars)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def tensorboard_scalars(run_dir: Path) -> dict[str, list]:
    from tensorboard.util import tensor_util

    acc = tensorboard_events(run_dir)
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def wandb_records(run_dir: Path, kind: str) -> list:
    """Every record of one kind in the offline run's transaction logs, one per session."""
    from wandb.proto import wandb_internal_pb2

    from gspo.report.trackers import _leveldb_log_records

    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files, "no offline W&B run"
    out = []
    for f in files:
        for data in _leveldb_log_records(f.read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == kind:
                out.append(getattr(rec, kind))
    return out


def wandb_history(run_dir: Path) -> dict[str, list]:
    out: dict[str, list] = {}
    for row in wandb_records(run_dir, "history"):
        for item in row.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith(("_", "completions")):
                out.setdefault(key, []).append((row.step.num, float(json.loads(item.value_json))))
    return out


def mlflow_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gspo").experiment_id])
    return client, run


def mlflow_metrics(run_dir: Path) -> dict[str, list]:
    client, run = mlflow_client(run_dir)
    return {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}


def trackio_rows(run_dir: Path) -> list[tuple[int, dict]]:
    run_id = json.loads((run_dir / "trackers.json").read_text())["trackio"]["id"]
    db = sqlite3.connect(run_dir.parent / "trackio" / "gspo.db")
    try:
        return [(s, json.loads(m)) for s, m in db.execute("select step, metrics from metrics where run_id = ?", (run_id,))]
    finally:
        db.close()


def trackio_metrics(run_dir: Path) -> dict[str, list]:
    out: dict[str, list] = {}
    for step, metrics in trackio_rows(run_dir):
        for k, v in metrics.items():
            if k != "completions":
                out.setdefault(k, []).append((step, float(v)))
    return out


READERS = {"tensorboard": tensorboard_scalars, "wandb": wandb_history, "mlflow": mlflow_metrics,
           "trackio": trackio_metrics}


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("tracker", READERS)
def test_every_step_reaches_the_tracker_with_its_values(straight, tracker):
    want = expected(straight)
    assert max(s for h in want.values() for s, _ in h) == 12 and ("eval/accuracy" in want)
    got = READERS[tracker](straight)
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}  # exact: float64


@pytest.mark.parametrize("tracker", READERS)
def test_kill_and_resume_leaves_each_step_once(resumed, tracker):
    run_dir, held = resumed
    if tracker in held:  # it got the steps past the checkpoint (step 4) before the kill
        assert held[tracker] == 6
    want = expected(run_dir)
    assert sorted(s for s, _ in want["loss"]) == list(range(1, 9))
    got = READERS[tracker](run_dir)
    assert without_timings(got) == without_timings(want)  # (steps 5-6 of the killed run differ only in timings)
    assert sorted(s for s, _ in got["time/step"]) == list(range(1, 9))


def completion_files(run_dir: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("-")[1]): [json.loads(x) for x in p.read_text().splitlines()]
            for p in sorted((run_dir / "completions").glob("step-*.jsonl"))}


def test_completions_tables_mirror_the_completions_files(straight):
    from tensorboard.util import tensor_util

    files = completion_files(straight)
    assert sorted(files) == [4, 8, 12]
    texts = {s: [r["completion"] for r in rows] for s, rows in files.items()}
    acc = tensorboard_events(straight)  # a text table: a header row, then one row per completion
    tb = {e.step: tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors("completions")}
    assert {s: [c.decode() for c in t[1:, 2]] for s, t in tb.items()} == texts
    assert [c.decode() for c in tb[4][0]] == ["step", "prompt", "completion", "reward", "advantage",
                                              "finish_reason", "reward/count_ones"]
    wb = {}
    for row in wandb_records(straight, "history"):
        path = [json.loads(i.value_json) for i in row.item if list(i.nested_key) == ["completions", "path"]]
        if path:
            media = next((straight / "wandb").glob(f"offline-run-*/files/{path[0]}"))
            wb[row.step.num] = json.loads(media.read_text())
    assert {s: [r[2] for r in t["data"]] for s, t in wb.items()} == texts
    client, run = mlflow_client(straight)
    ml = {s: client.download_artifacts(run.info.run_id, f"completions/step-{s:06d}.json", str(straight.parent))
          for s in files}
    assert {s: [r[2] for r in json.loads(Path(p).read_text())["data"]] for s, p in ml.items()} == texts
    tr = {s: m["completions"]["_value"] for s, m in trackio_rows(straight) if "completions" in m}
    assert {s: [r["completion"] for r in rows] for s, rows in tr.items()} == texts
    assert tr[4][0]["advantage"] == files[4][0]["advantage"]


def test_config_is_the_runs_config(straight):
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = tensorboard_events(straight).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["rollout.group_size"].number_value == 4 and hparams["output.name"].string_value == "run"
    (run_record,) = wandb_records(straight, "run")
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["rollout"]["group_size"] == 4 and config["logging"]["report_to"][0] == "tensorboard"
    _, run = mlflow_client(straight)
    assert run.data.params["rollout.group_size"] == "4" and run.data.params["schedule.num_minibatches"] == "4"
    db = sqlite3.connect(straight.parent / "trackio" / "gspo.db")
    ((text,),) = db.execute("select config from configs").fetchall()  # one run, one config
    db.close()
    assert json.loads(text)["rollout"]["group_size"] == 4


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "trackio", "mlflow"])
def test_missing_tracker_package_fails_before_the_model_loads(tmp_path, monkeypatch, capsys, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import NAME` now raises ImportError
    monkeypatch.setattr("gspo.train.run.build_policy", lambda *a, **k: pytest.fail("the model loaded"))
    rc = main(["train", *TINY, f"logging.report_to=[{tracker}]", f"output.dir={tmp_path}", "output.name=run"])
    assert rc == 2 and f"pip install 'gspo[{tracker}]'" in capsys.readouterr().err


@pytest.mark.parametrize("names", ["[wandb,neptune]", "[wandb,wandb]"])
def test_unknown_or_repeated_tracker_is_rejected(names):
    with pytest.raises(ConfigError, match="logging.report_to"):
        load_config(None, [f"logging.report_to={names}"])


def test_none_and_all_are_trls_words_for_no_tracker_and_every_installed_one(monkeypatch):
    """TRL and transformers users write report_to=none (it was 'unknown tracker none')."""
    import importlib.util

    assert load_config(None, ["logging.report_to=none"]).logging.report_to == []
    installed = {"tensorboard", "mlflow"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in installed else None)
    assert load_config(None, ["logging.report_to=all"]).logging.report_to == ["tensorboard", "mlflow"]


def test_wandb_goes_online_only_with_a_key(tmp_path, monkeypatch):
    from gspo.report.trackers import _wandb_logged_in

    for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not _wandb_logged_in()
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    assert _wandb_logged_in()
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert _wandb_logged_in()


class _Recorder:
    def __init__(self, held):
        self.held, self.steps, self.tables = held, [], []

    def log(self, step, values):
        self.steps.append(step)

    def table(self, step, columns, data):
        self.tables.append(step)


def test_catch_up_replays_only_what_a_tracker_lacks(tmp_path):
    from gspo.report.sinks import JsonlWriter, write_completions
    from gspo.report.trackers import Trackers

    w = JsonlWriter(tmp_path / "metrics.jsonl")
    for step in range(5):  # step 0: the first evaluation
        w.write({"step": step, "loss": float(step)})
    w.close()
    row = {"step": 0, "prompt": "p", "completion": "c", "reward": 1.0, "advantage": 0.5, "finish_reason": "stop",
           "rewards": {"f": 1.0}}
    for step in (2, 4, 6):  # step 6: written by the killed run, past the checkpoint
        write_completions(tmp_path, step, [{**row, "step": step}])
    fresh, short, ahead = _Recorder(-1), _Recorder(2), _Recorder(6)
    Trackers([fresh, short, ahead]).catch_up(tmp_path, 4)
    assert fresh.steps == [0, 1, 2, 3, 4] and fresh.tables == [2, 4]
    assert short.steps == [3, 4] and short.tables == [4]
    assert ahead.steps == [] and ahead.tables == []


def test_every_tracker_name_the_config_accepts_has_a_class():
    from gspo.config import TRACKER_NAMES
    from gspo.report.trackers import TRACKERS

    assert tuple(TRACKERS) == TRACKER_NAMES


def test_a_moved_run_logs_to_the_mlflow_store_in_its_own_folder(tmp_path):
    """trackers.json kept the file store's absolute path: a copied run, resumed, logged into the
    original's store, and a moved one stopped with MLflow's traceback."""
    import shutil

    p = gspo_train(tmp_path, "run", "schedule.rollouts=1", "schedule.num_minibatches=2", "logging.report_to=mlflow")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]["tracking_uri"] is None
    (tmp_path / "moved").mkdir()
    shutil.move(tmp_path / "run", tmp_path / "moved" / "run")
    p = gspo_train(tmp_path / "moved", "run", "schedule.rollouts=2", "schedule.num_minibatches=2",
                   "logging.report_to=mlflow", "resume=auto")
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (tmp_path / "run").exists(), sorted(str(x) for x in (tmp_path / "run").rglob("*"))[:10]
    steps = {s for h in mlflow_metrics(tmp_path / "moved" / "run").values() for s, _ in h}
    assert steps == {0, 1, 2, 3, 4}


def test_a_table_a_kill_kept_from_mlflow_is_replayed_with_the_run(tmp_path):
    """MLflow held the record of a step whose completions table a kill had not let it log: the
    catch-up skipped both, and the table was lost for good."""
    from gspo.report.trackers import MLflow, Trackers

    cfg = load_config(None, [f"output.dir={tmp_path}", "output.name=run"])
    run = cfg.run_dir
    (run / "completions").mkdir(parents=True)
    rows = [{"step": 1, "prompt": "1+1=", "completion": "2", "reward": 1.0, "advantage": 0.0, "finish_reason": "eos"}]
    for step in (1, 2):
        (run / "completions" / f"step-{step:06d}.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5 * s}) + "\n" for s in (1, 2)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    with mock.patch.dict(os.environ, env, clear=True):
        first = MLflow(cfg, {}, 0)
        t = Trackers([first])
        t.log({"step": 1, "loss": 0.5})
        t.table(1, rows)
        t.log({"step": 2, "loss": 1.0})  # killed here, before step 2's table
        again = MLflow(cfg, first.state, 2)
        assert (again.held, again.table_held) == (2, 1)
        Trackers([again]).catch_up(run, 2)
        client, _ = mlflow_client(run)
        files = [f.path for f in client.list_artifacts(again.run_id, "completions")]
        assert files == ["completions/step-000001.json", "completions/step-000002.json"]
        assert [m.step for m in client.get_metric_history(again.run_id, "loss")] == [1, 2]


def test_a_run_logged_to_a_store_mlflow_tracking_uri_names_resumes_there(tmp_path):
    """A file store named mlruns elsewhere (MLflow's own default name) was taken for the run
    folder's own store on resume, where the run is not: the resume stopped."""
    store = (tmp_path / "elsewhere" / "mlruns").as_uri()
    run = ("schedule.num_minibatches=2", "logging.report_to=mlflow")
    p = gspo_train(tmp_path, "run", "schedule.rollouts=1", *run, env_extra={"MLFLOW_TRACKING_URI": store})
    assert p.returncode == 0, p.stderr[-3000:]
    p = gspo_train(tmp_path, "run", "schedule.rollouts=2", "resume=auto", *run, env_extra={"MLFLOW_TRACKING_URI": store})
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (tmp_path / "run" / "mlruns").exists() and not (tmp_path / "run" / ".lock").exists()
    from mlflow.tracking import MlflowClient

    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):
        client = MlflowClient(tracking_uri=store)
    (r,) = client.search_runs([client.get_experiment_by_name("gspo").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "loss")) == [1, 2, 3, 4]


def test_a_run_whose_mlflow_run_is_gone_says_so_and_lets_its_directory_go(tmp_path):
    """A failure between the model load and the loop (here the tracker's) left runs/NAME/.lock."""
    import shutil

    run = ("schedule.num_minibatches=2", "logging.report_to=mlflow")
    assert gspo_train(tmp_path, "run", "schedule.rollouts=1", *run).returncode == 0
    shutil.rmtree(tmp_path / "run" / "mlruns")
    p = gspo_train(tmp_path, "run", "schedule.rollouts=2", "resume=auto", *run)
    assert p.returncode == 2 and "remove the 'mlflow' entry of" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run" / ".lock").exists()
