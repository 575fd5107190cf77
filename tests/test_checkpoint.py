"""Checkpoint save/load: bitwise resume, RNG, keep_last, corrupt/partial checkpoints, full disk, kill -9."""

import ast
import errno
import json
import os
import random
import re
import signal
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors
import torch

from gspo.config import ConfigError

import gspo.train.checkpoint as ck
from gspo.train.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    capture_rng_state,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    restore_rng_state,
    save_checkpoint,
)
from zygote import popen

SRC = str(Path(__file__).resolve().parents[1] / "src")


# ----------------------------------------------------------------------------- tiny training setups


def build_mlp(seed):
    torch.manual_seed(seed)
    # Dropout makes the forward pass consume torch RNG, so a resume without RNG restore diverges.
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.GELU(), torch.nn.Linear(16, 1))


def build_qwen3(seed):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                      attention_dropout=0.2)
    cfg._attn_implementation = "eager"
    return Qwen3ForCausalLM(cfg)


def make_opt(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return opt, sched


def train_step(model, opt, sched):
    # Data drawn from all three RNGs so restoring each one matters.
    scale = random.random() + float(np.random.rand())
    if isinstance(model, torch.nn.Sequential):
        x = torch.randn(4, 8) * scale  # (B, 8)
        loss = model(x).pow(2).mean()
    else:
        ids = torch.randint(0, 32, (2, 6))  # (B, T)
        loss = model(input_ids=ids, labels=ids).loss * scale
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def assert_state_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_opt_equal(a: dict, b: dict):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)


# ----------------------------------------------------------------------------- round trip / resume


def test_rng_round_trip_through_json():
    seed_all(1)
    state = json.loads(json.dumps(capture_rng_state()))  # must be plain JSON
    first = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn())  # randn: numpy gauss cache
    torch.rand(7), random.random(), np.random.rand(2)  # move every generator on
    restore_rng_state(state)
    again = (torch.rand(5), random.random(), np.random.rand(3), np.random.randn())
    assert torch.equal(first[0], again[0])
    assert first[1] == again[1]
    assert np.array_equal(first[2], again[2]) and first[3] == again[3]


@pytest.mark.parametrize("build", [build_mlp, build_qwen3], ids=["mlp", "qwen3-tied"])
def test_resume_is_bitwise_identical_to_uninterrupted(tmp_path, build):
    # Uninterrupted: 5 steps.
    seed_all(0)
    model = build(0)
    opt, sched = make_opt(model)
    seed_all(123)
    for _ in range(5):
        train_step(model, opt, sched)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # Interrupted: 3 steps, save, wreck all state, load into freshly built objects, 2 more steps.
    seed_all(0)
    model = build(0)
    opt, sched = make_opt(model)
    seed_all(123)
    for _ in range(3):
        train_step(model, opt, sched)
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, scheduler=sched,
                           trainer_state={"step": 3, "sampler": {"epoch": 0, "index": 12}},
                           config_text="lr: 0.01\n")
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    saved_lr = sched.get_last_lr()
    torch.rand(3), random.random(), np.random.rand()  # without RNG restore the continuation would differ

    model2 = build(7)  # different init: load must overwrite every parameter
    opt2, sched2 = make_opt(model2)
    assert not torch.equal(next(model2.parameters()), next(iter(saved_model.values())))
    state = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert state == {"step": 3, "sampler": {"epoch": 0, "index": 12}}
    assert (path / "config.yaml").read_text() == "lr: 0.01\n"
    assert_state_equal(model2.state_dict(), saved_model)
    assert_opt_equal(opt2.state_dict(), saved_opt)
    assert sched2.get_last_lr() == saved_lr and sched2.last_epoch == 3
    for _ in range(2):
        train_step(model2, opt2, sched2)
    assert_state_equal(model2.state_dict(), expected)


def test_tied_weights_stored_once_and_still_tied_after_load(tmp_path):
    model = build_qwen3(0)
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state={})
    with safetensors.safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert len({"lm_head.weight", "model.embed_tokens.weight"} & keys) == 1
    model2 = build_qwen3(1)
    load_checkpoint(path, model=model2)
    assert model2.lm_head.weight is model2.model.embed_tokens.weight
    assert torch.equal(model2.lm_head.weight, model.lm_head.weight)


def test_trainable_only_saves_and_restores_only_trainable_params(tmp_path):
    model = build_mlp(0)
    model[0].requires_grad_(False)  # stands in for a frozen base model under LoRA
    with torch.no_grad():
        model[3].weight.add_(1.0)
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state={}, trainable_only=True)
    with safetensors.safe_open(str(path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"3.weight", "3.bias"}
    model2 = build_mlp(0)
    model2[0].requires_grad_(False)
    load_checkpoint(path, model=model2)
    assert_state_equal(model2.state_dict(), model.state_dict())


def test_load_into_mismatched_model_names_the_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path, 1, model=torch.nn.Linear(4, 4), trainer_state={})
    with pytest.raises(CheckpointError, match="step-1"):
        load_checkpoint(path, model=torch.nn.Linear(4, 5))
    with pytest.raises(CheckpointError, match="no optimizer.pt"):
        m = torch.nn.Linear(4, 4)
        load_checkpoint(path, model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def test_trainer_state_must_be_json(tmp_path):
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path, 1, model=torch.nn.Linear(2, 2), trainer_state={"t": torch.zeros(1)})
    assert find_resume_checkpoint(tmp_path) is None


# ----------------------------------------------------------------------------- layout, keep_last, finding


def test_layout_keep_last_and_latest(tmp_path):
    model = torch.nn.Linear(4, 4)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model=model, trainer_state={"step": step}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-4", "step-5"]
    assert (root / "latest").read_text().strip() == "step-5"
    assert list_checkpoints(tmp_path) == [root / "step-5", root / "step-4"]
    manifest = json.loads((root / "step-5" / "COMPLETE").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "rng.json", "trainer_state.json", "config.yaml"}
    assert find_resume_checkpoint(tmp_path) == root / "step-5"


def test_resave_same_step_replaces_it(tmp_path):
    model = torch.nn.Linear(4, 4)
    save_checkpoint(tmp_path, 1, model=model, trainer_state={"v": 1})
    save_checkpoint(tmp_path, 1, model=model, trainer_state={"v": 2})
    path = find_resume_checkpoint(tmp_path)
    assert path.name == "step-1" and load_checkpoint(path, model=model) == {"v": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step-1"]


def test_resuming_from_an_older_checkpoint_never_deletes_newer_ones(tmp_path):
    model = torch.nn.Linear(4, 4)
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, model=model, trainer_state={"step": step}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-30", "step-20"]
    # The trainer resumed from step-20 (explicit path) and saves step 25: step-30 is kept, with a warning.
    with pytest.warns(CheckpointWarning, match="newer than step 25.*step-30"):
        save_checkpoint(tmp_path, 25, model=model, trainer_state={"step": 25}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-30", "step-25", "step-20"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # warns only on the save that moved `latest` back
        save_checkpoint(tmp_path, 26, model=model, trainer_state={"step": 26}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-30", "step-26", "step-25"]
    assert (root / "latest").read_text().strip() == "step-26"
    assert find_resume_checkpoint(tmp_path) == root / "step-26"


def _corrupt(path: Path, how: str):
    f = path / "model.safetensors"
    if how == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "flip-byte":  # same size: only the checksum catches it
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    elif how == "no-manifest":
        (path / "COMPLETE").unlink()


@pytest.mark.parametrize("how", ["truncate", "flip-byte", "no-manifest"])
def test_corrupt_latest_is_skipped_with_warning(tmp_path, how):
    model = torch.nn.Linear(4, 4)
    save_checkpoint(tmp_path, 1, model=model, trainer_state={"step": 1})
    save_checkpoint(tmp_path, 2, model=model, trainer_state={"step": 2})
    _corrupt(tmp_path / "checkpoints" / "step-2", how)
    with pytest.warns(CheckpointWarning, match="step-2"):
        path = find_resume_checkpoint(tmp_path)
    assert path.name == "step-1"
    assert load_checkpoint(path, model=model) == {"step": 1}
    with pytest.raises(CheckpointError, match="step-2"):
        load_checkpoint(tmp_path / "checkpoints" / "step-2", model=model)


def test_all_corrupt_raises_and_none_without_checkpoints(tmp_path):
    assert find_resume_checkpoint(tmp_path) is None  # no checkpoints/ at all
    (tmp_path / "checkpoints" / ".tmp-step-1-999999").mkdir(parents=True)
    assert find_resume_checkpoint(tmp_path) is None  # a crashed first save is not a checkpoint
    model = torch.nn.Linear(4, 4)
    save_checkpoint(tmp_path, 1, model=model, trainer_state={})
    save_checkpoint(tmp_path, 2, model=model, trainer_state={})
    _corrupt(tmp_path / "checkpoints" / "step-1", "truncate")
    _corrupt(tmp_path / "checkpoints" / "step-2", "no-manifest")
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="found 2 checkpoints .* none is complete"):
        find_resume_checkpoint(tmp_path)


def test_resolve_resume(tmp_path):
    model = torch.nn.Linear(4, 4)
    assert resolve_resume(tmp_path, "auto") is None
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state={})
    assert resolve_resume(tmp_path, "auto") == path
    assert resolve_resume(tmp_path, "none") is None and resolve_resume(tmp_path, "") is None
    assert resolve_resume(tmp_path, str(path)) == path
    # not a folder, a typo of auto, a model folder: one error naming the field, before the model loads
    with pytest.raises(ConfigError, match=r"config field 'resume': '.*nope' is not auto, none or a checkpoint folder"):
        resolve_resume(tmp_path, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"'autoo' is not auto, none or a checkpoint folder \(did you mean resume=auto"):
        resolve_resume(tmp_path, "autoo")
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="is a model folder, not a checkpoint; to train from these weights set "
                                          "model.name_or_path="):
        resolve_resume(tmp_path, str(tmp_path / "final"))
    # a run's folder or its checkpoints folder: what to write instead (it was a stop, exit 1, on the
    # checkpoints folder: 'no COMPLETE manifest')
    for given in (tmp_path, tmp_path / "checkpoints"):
        with pytest.raises(ConfigError, match=re.escape(f"not one checkpoint; continue the run with resume=auto "
                                                        f"output.dir={tmp_path.parent} output.name={tmp_path.name}")):
            resolve_resume(tmp_path, str(given))
    (path / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="step-1"):
        resolve_resume(tmp_path, str(path))


# ----------------------------------------------------------------------------- failures mid-save


@pytest.mark.parametrize("step", [2, 1], ids=["new-step", "resave-existing-step"])
def test_disk_full_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch, step):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, trainer_state={"step": 1})
    root = tmp_path / "checkpoints"
    saved_weight = model.weight.detach().clone()

    def full_disk(optimizer, path):  # model.safetensors is already written when this runs
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ck, "save_optimizer_state", full_disk)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointError, match=rf"step-{step}.*No space left on device.*step-1 is untouched"):
        save_checkpoint(tmp_path, step, model=model, optimizer=opt, trainer_state={"step": "bad"})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]  # temp dir removed
    assert (root / "latest").read_text().strip() == "step-1"
    assert find_resume_checkpoint(tmp_path) == good
    fresh = torch.nn.Linear(4, 4)
    assert load_checkpoint(good, model=fresh) == {"step": 1}
    assert torch.equal(fresh.weight, saved_weight) and not torch.equal(fresh.weight, model.weight)


class _Evil:
    def __reduce__(self):
        return (os.getpid, ())  # any callable: weights_only loading must refuse to call it


def test_optimizer_file_is_never_unpickled(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, trainer_state={})
    torch.save({"state": {}, "param_groups": [], "evil": _Evil()}, path / "optimizer.pt")
    manifest = json.loads((path / "COMPLETE").read_text())  # make the tampered file "verify"
    manifest["files"]["optimizer.pt"] = {"size": (path / "optimizer.pt").stat().st_size,
                                         "sha256": ck._sha256(path / "optimizer.pt")}
    (path / "COMPLETE").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="(?i)weights.only"):
        load_checkpoint(path, model=model, optimizer=opt)


def test_source_never_calls_torch_load_without_weights_only():
    # every module of the package (the optimizer loader lives in gspo.train.state_io)
    sources = [f.read_text() for f in sorted(Path(ck.__file__).parent.glob("*.py"))]
    trees = [ast.parse(src) for src in sources]
    calls = [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute)
             and n.func.attr == "load" and getattr(n.func.value, "id", None) == "torch"]
    assert calls, "expected the optimizer loader to call torch.load"
    for c in calls:
        kw = {k.arg: k.value for k in c.keywords}
        assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, ast.unparse(c)
    names = {a.name for tree in trees for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    assert not names & {"pickle", "cPickle", "dill", "cloudpickle"}
    assert not any("np.load" in src for src in sources)


# ----------------------------------------------------------------------------- kill -9


def _spawn(script: str, *args):
    """`python -c SCRIPT ARGS` in a process of its own, forked from the fork server
    (tests/zygote.py), which has imported torch and gspo already."""
    env = dict(os.environ, PYTHONPATH=SRC, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    return popen([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], env=env)


def _line(proc, n: int, timeout: float = 120) -> str:
    """The n-th line (from 1) the process writes to its stdout, once it is whole."""
    deadline = time.monotonic() + timeout
    while True:
        lines = proc.read_stdout().split("\n")[:-1]
        if len(lines) >= n:
            return lines[n - 1]
        assert proc.poll() is None and time.monotonic() < deadline, proc.read_stderr()[-3000:]
        time.sleep(0.002)


SLOW_SAVER = """
    import sys, time, torch, gspo.train.checkpoint as ck
    run_dir = sys.argv[1]
    model = torch.nn.Linear(64, 64)
    ck.save_checkpoint(run_dir, 1, model=model, trainer_state={"step": 1})
    real = ck.save_model_state
    def slow(*a, **k):  # stall after the model file, before anything else, so the kill lands mid-save
        real(*a, **k)
        print("in-save", flush=True)
        time.sleep(60)
    ck.save_model_state = slow
    ck.save_checkpoint(run_dir, 2, model=model, trainer_state={"step": 2})
"""


def test_kill9_mid_save_resumes_from_previous_and_next_save_cleans_up(tmp_path):
    proc = _spawn(SLOW_SAVER, tmp_path)
    try:
        assert _line(proc, 1).strip() == "in-save"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    root = tmp_path / "checkpoints"
    stale = root / f".tmp-step-2-{proc.pid}"
    assert (stale / "model.safetensors").is_file() and not (root / "step-2").exists()
    assert (root / "latest").read_text().strip() == "step-1"
    path = find_resume_checkpoint(tmp_path)
    assert path == root / "step-1"
    assert load_checkpoint(path, model=torch.nn.Linear(64, 64)) == {"step": 1}
    save_checkpoint(tmp_path, 2, model=torch.nn.Linear(64, 64), trainer_state={"step": 2})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-2"]


LOOP_SAVER = """
    import sys, torch, gspo.train.checkpoint as ck
    run_dir = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])  # ~1M params
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        ck.save_checkpoint(run_dir, step, model=model, optimizer=opt, trainer_state={"step": step}, keep_last=2)
        print(step, flush=True)
"""


def test_kill9_at_arbitrary_point_leaves_a_consistent_checkpoint(tmp_path):
    proc = _spawn(LOOP_SAVER, tmp_path)
    try:
        _line(proc, 1)
        t0 = time.perf_counter()
        _line(proc, 2)
        per_save = time.perf_counter() - t0
        time.sleep(random.Random(0).uniform(0.2, 0.8) * per_save)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    path = find_resume_checkpoint(tmp_path)
    assert path is not None and all(p.name.startswith(("step-", ".tmp-", "latest")) for p in path.parent.iterdir())
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    step = load_checkpoint(path, model=model, optimizer=opt)["step"]
    assert path.name == f"step-{step}" and step >= 2
    assert all(torch.all(p == step) for p in model.parameters())  # model and trainer_state from the same save


def test_a_resume_from_an_older_checkpoint_makes_it_latest(tmp_path):
    """resume=PATH to an older checkpoint cuts metrics.jsonl to it; `latest` must follow, or a stop
    before the next save would resume from the abandoned newer one (and find the run finished)."""
    from gspo.train.checkpoint import find_resume_checkpoint, resume_here, save_checkpoint

    model = torch.nn.Linear(2, 2)
    for step in (20, 24, 28):
        save_checkpoint(tmp_path, step, model=model, trainer_state={"step": step}, keep_last=3)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-28"
    resume_here(root / "step-28")  # the newest: nothing changes
    assert (root / "latest").read_text().strip() == "step-28"
    resume_here(root / "step-20")
    assert (root / "latest").read_text().strip() == "step-20" and find_resume_checkpoint(tmp_path) == root / "step-20"


def test_a_full_disk_while_writing_final_is_one_stop_message_and_no_partial_folder(tmp_path):
    from types import SimpleNamespace

    from gspo.train.checkpoint import CheckpointError
    from gspo.train.run_state import save_final
    from gspo.train.distributed import Dist

    class FullDisk:
        def save_pretrained(self, path, **kw):
            Path(path).mkdir(parents=True)
            (Path(path) / "model.safetensors").write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    run = SimpleNamespace(cfg=SimpleNamespace(run_dir=tmp_path, lora=SimpleNamespace(enabled=False), logging=SimpleNamespace(
                              console=False), output=SimpleNamespace(final_dtype="auto")),
                          generator_model=FullDisk(), policy=None, remote=None, dist=Dist(), tokenizer=None)
    with pytest.raises(CheckpointError, match=r"could not write .*final: OSError: .*\(disk full\?\); .*resume=auto"):
        save_final(run)
    assert not (tmp_path / "final.partial").exists() and not (tmp_path / "final").exists()
