"""A run's multi-turn episodes from the config (rollout.tools / rollout.environment): the tools,
the parser of a turn's calls and the environment class, loaded and checked before any compute
(`load_episode_tools`); the schemas the prompts are rendered with, once the chat template is
known to play episodes (`checked_schemas`); the `Tools` the step plays episodes with."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from gspo.config import Config, ConfigError
from gspo.data import as_messages
from gspo.rollout.tool_calls import ToolConfigError, resolve_parser, writes_call_ids
from gspo.rollout.tools import ToolRunner, env_tools, load_environment, load_tools


def checked_schemas(cfg: Config, tools, tok, say: bool = True) -> list[dict] | None:
    """The schemas an episode's prompt is rendered with (None: no episodes), once the chat
    template is known to play tool episodes (`check_tool_template`: a refusal, or a warning);
    training and `gspo eval` alike."""
    if tools is None:
        return None
    from gspo.rollout.episodes import check_tool_template, episode_schemas

    schemas = episode_schemas(tools[0], tools[2])
    warning = check_tool_template(tok, schemas, call_ids=writes_call_ids(cfg.rollout.tool_parser))
    if warning and say:
        print(f"warning: {warning}", file=sys.stderr)
    return schemas


@dataclass
class Tools:
    """What multi-turn episodes call: the tool functions, the parser of a turn's calls, the
    runner (which also hosts the episodes' environments)."""

    functions: list
    parser: Any
    runner: Any


def episode_tools(cfg: Config, loaded=None) -> Tools | None:
    """The Tools of rollout.tools / rollout.environment, their worker processes started (None
    without either): on the learner in sync mode, on each generator in async mode."""
    loaded = loaded or load_episode_tools(cfg)
    if loaded is None:
        return None
    r = cfg.rollout
    return Tools(loaded[0], loaded[1], ToolRunner(loaded[0], timeout_s=r.tool_timeout_s, num_workers=r.tool_workers,
                                                  env_class=loaded[2], max_reply_chars=r.tool_reply_max_chars))


def play_episodes(cfg: Config, generator, tokenizer, tools: Tools, rows: list[dict], *, seed: int, offset: int,
                  group_size: int | None = None):
    """rollout.group_size episodes of each row's prompt (`gspo.rollout.episodes.run_episodes`)."""
    from gspo.rollout.episodes import run_episodes

    r = cfg.rollout
    return run_episodes(generator, tokenizer, [as_messages(x["prompt"]) for x in rows], group_size or r.group_size,
                        tools=tools.functions, runner=tools.runner, parser=tools.parser, max_turns=r.max_turns,
                        max_tokens=r.max_episode_tokens or r.max_turns * r.max_new_tokens, seed=seed, offset=offset,
                        rows=rows)


def load_episode_tools(cfg: Config):
    """(functions, parser, environment class) of rollout.tools / rollout.environment, checked
    before any compute; None without either."""
    r = cfg.rollout
    if not r.tools and not r.environment:
        return None
    try:
        env = load_environment(r.environment) if r.environment else None
        tools = load_tools(list(r.tools))
    except ToolConfigError as e:
        raise ConfigError(f"config field {e}") from None
    methods = {fn.__name__ for fn in env_tools(env)}
    for i, fn in enumerate(tools):  # a call of that name would go to the environment's method alone
        if fn.__name__ in methods:
            raise ConfigError(f"config field 'rollout.tools[{i}]': {fn.__name__!r} is also a method of "
                              f"rollout.environment {r.environment}, which the model's calls of that name reach; "
                              "rename one of them")
    if tools and r.max_turns == 1:  # the last turn's calls are not run: there is no turn left to read them
        print("warning: rollout.max_turns=1 with rollout.tools: no call is ever run (a turn's calls are run only "
              "when a turn is left to read their replies); set rollout.max_turns=2 or more", file=sys.stderr)
    try:
        return tools, resolve_parser(r.tool_parser), env
    except ToolConfigError as e:
        raise ConfigError(f"config field {e}") from None
