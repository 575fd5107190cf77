"""`gspo train | eval | demo | report`."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see gspo/__init__.py)

import argparse
import json
import sys
import textwrap


def _fields_help() -> str:
    from gspo.config import field_docs

    lines = ["config fields (override any with key=value):"]
    section = None
    for name, default, help in field_docs():
        top = name.split(".")[0] if "." in name else ""
        if top != section:
            section = top
            lines.append("")
        lines.append(f"  {name} = {default}")
        lines.append(textwrap.indent(textwrap.fill(help, 88), "      "))
    return "\n".join(lines)


def cmd_train(args) -> int:
    from gspo.config import check_run_config, load_config
    from gspo.train import train

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # no config file, only overrides
    cfg = load_config(config, overrides)
    check_run_config(config, cfg, overrides)  # a copied or moved run's own config.yaml
    run_dir = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the job
        print(f"run directory: {run_dir}")
    return 0


def cmd_eval(args) -> int:
    from types import SimpleNamespace

    from gspo.config import ConfigError, load_config
    from gspo.data import column_names
    from gspo.train.evaluate import evaluate, evaluate_episodes
    from gspo.models import load_policy
    from gspo.rewards.runner import RewardRunner
    from gspo.train.prompts import (check_reward_columns, fitting_prompts, load_prompt_rows, model_prompt_cap, prompt_cap,
                                    source_held_out_split)
    from gspo.train.reward_specs import checked_reward_specs
    from gspo.train.run import checked_schemas, episode_tools, hf_generator, load_episode_tools, policy_tokenizer
    from gspo.rollout import chunk_seed
    from gspo.tasks import TASKS
    from gspo.train.threads import setup_threads

    flags = {"eval.num_prompts": args.num_prompts, "eval.pass_k": args.pass_k,
             "rollout.max_new_tokens": args.max_new_tokens}  # unset flags keep the config's values
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--pass-k", args.pass_k, 0),
                               ("--max-new-tokens", args.max_new_tokens, 1)):
        if value is not None and value < least:
            raise ConfigError(f"gspo eval {flag}: must be >= {least}, got {value}")
    data, extra = args.data, []
    if data is not None and "=" in data and not os.path.exists(data):  # `gspo eval MODEL key=value`: no dataset
        data, extra = None, [data]
    if data is None and args.config is None:
        data = "arithmetic"  # no dataset named anywhere: the built-in task
    # a dataset named here is the one evaluated, as the held-out data (read with data.eval_split); a
    # built-in task's is its held-out split, the prompts a run's own evaluation draws
    named = [] if data is None else [f"data.source={data}", "data.eval_source=null"] if data in TASKS else \
        [f"data.eval_source={data}"]
    overrides = [f"model.name_or_path={args.model}", *named,
                 *(f"{k}={v}" for k, v in flags.items() if v is not None), *extra, *args.overrides]
    cfg = load_config(args.config, overrides)
    if not cfg.data.eval_source and cfg.data.source not in TASKS:  # a config's dataset: its held-out split
        cfg.data.eval_source = cfg.data.source
        if source_held_out_split(cfg) is None:  # (none, or the run trained on the split held-out data would read)
            print(f"warning: data.source {cfg.data.source} holds out no split but the one training reads, so this "
                  "evaluates on the rows training reads; name held-out data as gspo eval's DATA argument (or "
                  "data.eval_source)", file=sys.stderr)
    setup_threads(cfg.threads)
    loaded = load_episode_tools(cfg)  # rollout.tools / rollout.environment: multi-turn episodes, as in training
    rows, held = load_prompt_rows(cfg, train=False)
    rows = held or rows
    specs = checked_reward_specs(cfg)  # before the model loads, naming the field
    check_reward_columns(cfg, rows, held=bool(held), specs=specs)
    tok = policy_tokenizer(cfg)  # the prompts are checked with it before the model loads
    schemas = checked_schemas(cfg, loaded, tok)  # a template that cannot play episodes: refused, as training does
    every, columns = rows, column_names(rows)  # (every reward call gets the data's columns, as in training)
    rows = fitting_prompts(cfg, every, tok, schemas, cap=prompt_cap(cfg), held=bool(held),
                           limit=cfg.eval.num_prompts)  # as training does: the first that fit
    model, tok = load_policy(cfg.model.name_or_path, dtype=cfg.model.dtype, device=cfg.model.device,
                             trust_remote_code=cfg.model.trust_remote_code, tokenizer=tok)
    cap = model_prompt_cap(cfg, model, rows=rows, tok=tok, schemas=schemas)
    if cap != prompt_cap(cfg):  # a learned position table: prompt + completion must fit in it
        rows = fitting_prompts(cfg, every, tok, schemas, cap=cap, held=bool(held), notes=False,
                               limit=cfg.eval.num_prompts)
    rw = cfg.rewards
    with RewardRunner(specs, timeout_s=rw.timeout_s, on_error=rw.on_error,
                      num_workers=rw.num_workers) as runner:
        if loaded is None:
            m = evaluate(model, tok, rows, runner, max_new_tokens=cfg.rollout.max_new_tokens,
                         pass_k=cfg.eval.pass_k, generator=hf_generator(cfg, model, tok),
                         seed=chunk_seed(cfg.seed, 0, 2), columns=columns)  # (pass@k's samples: seeded)
        else:
            tools = episode_tools(cfg, loaded)
            try:  # what a run's own evaluation reads of it
                run = SimpleNamespace(cfg=cfg, tokenizer=tok, tools=tools, rewards=runner, generator_model=model,
                                      chat=True, eval_columns=columns)
                m = evaluate_episodes(run, rows, hf_generator(cfg, model, tok))
            finally:
                tools.runner.close()
    m["eval/num_prompts"] = len(rows)
    if m.get("eval/missing_frac") == 1.0:
        why = (f"the reward functions failed on {m['eval/reward_failures']} of them (rewards.on_error={rw.on_error})"
               if m.get("eval/reward_failures") else "they returned None, or the data has no answers")
        print(f"warning: no prompt got a reward ({why}): accuracy and reward are null", file=sys.stderr)
    print(json.dumps({k: None if isinstance(v, float) and v != v else v for k, v in m.items()}, indent=2))  # JSON: no NaN
    return 0


def cmd_demo(args) -> int:
    from gspo.demo import run_demo

    summary = run_demo(out_dir=args.out, overrides=args.overrides, quick=args.quick,
                       warmup_steps=args.warmup_steps)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_report(args) -> int:
    from gspo.report import html as report

    return report.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gspo", description="Group Sequence Policy Optimization for Hugging Face causal LMs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model with GSPO", epilog=_fields_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="gspo train CONFIG.yaml [key=value ...]   e.g. algo.eps_high=5e-4 rollout.group_size=16")
    t.add_argument("config", nargs="?", help="YAML config (optional: defaults train the tiny model on arithmetic)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="accuracy and pass@k of a model on a task or dataset")
    e.add_argument("model", help="HF model id or local path (e.g. runs/NAME/final)")
    e.add_argument("data", nargs="?", default=None,
                   help="built-in task name or dataset path, read with data.eval_split (default: the --config's "
                        "held-out data: data.eval_source, or data.source's held-out split; else arithmetic)")
    e.add_argument("--config", default=None, help="YAML config for rewards and sampling settings")
    e.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default: eval.num_prompts)")
    e.add_argument("--pass-k", type=int, default=None, help="also report pass@k (default: eval.pass_k)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="default: rollout.max_new_tokens")
    e.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    e.set_defaults(fn=cmd_eval)

    d = sub.add_parser("demo", help="offline CPU demo: a tiny model learns arithmetic with GSPO")
    d.add_argument("--out", default="runs/demo", help="output directory")
    d.add_argument("--quick", action="store_true", help="a much smaller run (for tests)")
    d.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up steps before GSPO")
    d.add_argument("overrides", nargs="*", help="dotted key=value overrides of the GSPO phase")
    d.set_defaults(fn=cmd_demo)

    from gspo.report.html import add_arguments as report_arguments

    r = sub.add_parser("report", help="plots and an HTML page for one or more runs",
                       description="Plot one or more gspo runs into a self-contained HTML report.")
    report_arguments(r)
    r.set_defaults(fn=cmd_report)
    return p


class PipeSafe:
    """A console stream that outlives its reader: `gspo train ... | head` closes the pipe, and a
    write then raised BrokenPipeError (rich turned it into SystemExit), stopping a run over its
    log. After the first such error the stream writes to /dev/null, and the run goes on."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """The `gspo` command. Called without `argv` it is the process's entry point (the console
    script, `python -m gspo`), and ends the process itself where the interpreter's own exit would
    abort it (`async_job.LEFT_PENDING`)."""
    try:
        rc = _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while torch and transformers import, before a command runs
        print("gspo: interrupted", file=sys.stderr)
        rc = 130
    except Exception:
        if argv is not None or not _left_pending():
            raise
        import traceback

        traceback.print_exc()
        rc = 1
    if argv is None and _left_pending():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)
    return rc


def _left_pending() -> bool:
    job = sys.modules.get("gspo.train.async_job")  # (imported only by a run in async mode)
    return bool(getattr(job, "LEFT_PENDING", False))


def _main(argv: list[str] | None) -> int:
    from gspo.config import ConfigError

    from gspo.train.checkpoint import CheckpointError
    from gspo.rewards import RewardError
    from gspo.train import TrainingError
    from gspo.train.async_job import GeneratorError
    from gspo.train.stops import Interrupted
    from gspo.rollout.tool_calls import ToolParserError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after a --flag (argparse ends a positional list at the first flag)
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # gspo draws its own progress; HF's per-file bars are noise
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (PipeSafe(x) if not isinstance(x, PipeSafe) else x for x in streams)
    try:
        return args.fn(args)
    except (ConfigError, ValueError, FileNotFoundError, PermissionError) as e:
        # bad input: one clear message, no traceback (GSPO_TRACEBACK=1 shows it)
        if os.environ.get("GSPO_TRACEBACK"):
            raise
        print(f"gspo {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # a second Ctrl-C / SIGTERM: stopped at once, no traceback
        print(f"gspo {args.command}: stopped at once by a second signal; {e or 'earlier checkpoints are intact'}",
              file=sys.stderr)
        return 130
    except (TrainingError, RewardError, CheckpointError, GeneratorError, ToolParserError) as e:
        # the run stopped for a stated reason; its last good state is on disk
        if os.environ.get("GSPO_TRACEBACK"):
            raise
        if not (getattr(e, "everywhere", False) and os.environ.get("RANK", "0") != "0"):  # (said once per job)
            print(f"gspo {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (after Interrupted: gspo train stops on its own terms; this is eval, report)
        print(f"gspo {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
