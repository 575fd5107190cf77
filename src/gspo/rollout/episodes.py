"""Multi-turn episodes with tool calls, token in, token out.

An episode starts from a chat prompt rendered with the tools' schemas (``tools=`` of the chat
template). Each turn the model continues the episode's own token ids (`HFGenerator.generate_ids`:
nothing is re-tokenised); the calls in its turn are parsed and run (`gspo.rollout.tools`), and
their replies are rendered by the chat template and appended as tokens. The learner sees exactly
those ids: ``[prompt | turn 1 | tool replies | turn 2 | ...]``, with `Rollout.loss_mask` 1 on the
tokens the model sampled and 0 on the ones inserted between turns, so GSPO's |y|, its sequence
ratio, the token clip fraction and the length metrics count only the model's tokens.

What is inserted after a turn is the chat template's own text: the conversation rendered with
the tool messages (and the next generation prompt) minus the conversation rendered up to the
assistant turn, starting after the EOS the model sampled. A template whose rendering of the
earlier turns changes when a message is added (not prefix-stable) cannot be continued token
for token; such an episode ends with finish reason ``error``.

Finish reasons: ``done`` (a turn without a tool call), ``max_turns`` (the model still called a
tool in its last allowed turn), ``length`` (a turn or the episode's token budget ran out) and
``error`` (the template could not render the replies).
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Callable, Sequence

import torch

from gspo.config import ConfigError
from gspo.data import encode_texts, template_kwargs
from gspo.rollout import Rollout, chunk_seed, left_pad
from gspo.rollout.tool_calls import ToolCall, ToolParserError
from gspo.rollout.tools import OUTCOMES, ToolRunner, env_tools, method_schema, tool_schema


class _Episode:
    __slots__ = ("prompt_ids", "ids", "model", "logp", "messages", "new", "finish", "turns", "calls", "outcomes")

    def __init__(self, prompt_ids: list[int], messages: list[dict]):
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []      # every token after the prompt
        self.model: list[int] = []    # 1 where the model wrote it
        self.logp: list[float] = []   # the sampler's log-prob (0 on inserted tokens)
        self.messages = list(messages)  # the whole conversation, for the template
        self.new: list[dict] = []     # the messages of the episode (TRL's conversational completion)
        self.finish: str | None = None
        self.turns = 0
        self.calls = 0
        self.outcomes: Counter = Counter()


def _parse(parser: Callable, text: str) -> list:
    """The tool calls `parser` reads in a turn. A parser that raises on the model's text makes it
    one malformed call (its error is the reply, as for unreadable JSON); one that returns
    anything but a list of `ToolCall` is a bug in the parser, which stops the run at once."""
    try:
        calls = parser(text)
    except Exception as e:  # the model's text, not the run, is at fault
        return [ToolCall("", error=f"the tool parser could not read this turn ({type(e).__name__}: {e})")]
    if not isinstance(calls, (list, tuple)) or not all(isinstance(c, ToolCall) for c in calls):
        raise ToolParserError(f"config field 'rollout.tool_parser': the parser returned {str(calls)[:120]!r}, "
                              "not a list of gspo.rollout.tool_calls.ToolCall")
    return list(calls)


def call_messages(calls: Sequence[ToolCall]) -> list[dict]:
    """The `tool_calls` of an assistant message, in the form chat templates read."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def render(tokenizer, messages: list[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt, **template_kwargs(tokenizer))
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
    return text


def episode_schemas(tools: Sequence[Callable], env) -> list[dict]:
    """The schemas the template shows the model: the tools', then the environment's methods'."""
    return [tool_schema(fn) for fn in tools] + [method_schema(fn, f"rollout.environment method {fn.__name__!r}")
                                                for fn in env_tools(env)]


def check_tool_template(tokenizer, schemas: list[dict], call_ids: bool | None = False) -> str | None:
    """Whether the chat template can play tool episodes, checked on a probe conversation before
    any sampling: it must render a tool's reply (one that drops or refuses role "tool" messages
    would hide every reply from the model: ConfigError). Returns a warning when it ignores
    `tools=` (the model is then not shown the schemas, unless the prompts carry them).
    `call_ids`: whether the tool parser gives each call an id, which the reply then carries
    (`parse_mistral`: True); None for a parser of the user's, which may (either form passes)."""
    if not schemas:
        return None
    probe, name = "gspo-probe-reply-7d3", schemas[0]["function"]["name"]
    talk = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
            {"role": "tool", "name": name, "content": probe}]
    with_ids = [talk[0], {**talk[1], "tool_calls": call_messages([ToolCall(name, id="gspoProbe")])},
                {**talk[2], "tool_call_id": "gspoProbe"}]
    for t in {True: [with_ids], False: [talk], None: [talk, with_ids]}[call_ids]:
        try:
            shown, talk = probe in render(tokenizer, t, schemas, generation_prompt=True), t
            break
        except Exception as e:  # e.g. a template that wants ids on tool calls (Mistral's)
            error = e
    else:
        hint = ("" if call_ids or not getattr(tokenizer, "chat_template", None) else  # (none: nothing to pair)
                "; a template that pairs replies with call ids, as Mistral's does, needs rollout.tool_parser=mistral")
        raise ConfigError(f"config field 'rollout.tools': the tokenizer's chat template fails on a tool's reply "
                          f"({type(error).__name__}: {error}){hint}") from None
    if not shown:
        raise ConfigError("config field 'rollout.tools': the tokenizer's chat template drops messages of role "
                          "'tool', so the model would never see the tools' replies; use a model whose template "
                          "renders them (tokenizer.chat_template)")
    if render(tokenizer, talk[:1], schemas, generation_prompt=True) == render(tokenizer, talk[:1], None,
                                                                              generation_prompt=True):
        return ("the tokenizer's chat template ignores tools=: the model is not shown the tools' schemas "
                "(put them in the prompts, or use a template that renders tools)")
    return None


def inserted_text(tokenizer, messages: list[dict], replies: list[dict], tools: list[dict] | None,
                  eos_text: str | Sequence[str]) -> str | None:
    """The template's text between the model's EOS that ended its turn (`messages[-1]`, the
    assistant's) and the next generation prompt, tool replies included. `eos_text`: the EOS
    the model sampled, or several texts, the sampled one first: the first that the template
    writes is the turn's end (a model may stop at <|endoftext|> where the template closes the
    turn with <|im_end|>).

    Some templates render a turn differently once it is no longer the last: Qwen3's writes an
    empty ``<think>`` block into the last assistant turn only. Then the text is what follows
    that turn's EOS in the rendering with the replies, provided the turns before it render
    the same. None when they do not (the template rewrites history: the model's context and
    the template's would part ways)."""
    before = render(tokenizer, messages, tools, generation_prompt=False)
    after = render(tokenizer, messages + replies, tools, generation_prompt=True)
    texts = [eos_text] if isinstance(eos_text, str) else list(eos_text)
    eos_text = next((t for t in texts if t and t in before), "")
    cut = before.rfind(eos_text) if eos_text else -1
    if cut < 0:  # no EOS text in the rendering: what the replies add, if it only adds
        return after[len(before):] if after.startswith(before) else None
    prev = before.rfind(eos_text, 0, cut)  # the end of the turn before the model's
    start = prev + len(eos_text) if prev >= 0 else 0
    end = after.find(eos_text, start)  # the model's turn, as rendered with the replies after it
    if after[:start] != before[:start] or end < 0:
        return None
    return after[end + len(eos_text):]


def run_episodes(generator, tokenizer, prompts: Sequence[list[dict]], group_size: int, *,
                 tools: Sequence[Callable], runner: ToolRunner, parser: Callable[[str], list[ToolCall]],
                 max_turns: int, max_tokens: int, seed: int | None = None, offset: int = 0,
                 rows: Sequence[dict] | None = None) -> Rollout:
    """`group_size` episodes of each chat prompt (B message lists): a `Rollout` whose
    completion holds every token after the prompt, `loss_mask` the model's own, `turns` each
    episode's messages and `episode_stats` the outcome counts (per-episode means). Each turn
    is at most rollout.max_new_tokens; the whole episode at most `max_tokens` after the prompt.

    With an environment (`runner.env_class`), each episode gets its own instance:
    ``reset(**row)`` (`rows`: the B dataset rows) gives a first observation, appended as a user
    message; its public methods are tools beside `tools`, with state kept across turns; a turn
    without a tool call goes to its ``step(messages) -> (new messages, done)`` when it has one
    (else the episode is done); its ``reward`` at the end is `Rollout.env_reward`. An
    environment that fails (reset, step, a lost worker) ends its episode with finish reason
    ``error``."""
    env = runner.env_class
    schemas = episode_schemas(tools, env)
    eos_ids = list(generator.eos_token_ids)
    eos_texts = [tokenizer.decode([i], skip_special_tokens=False) for i in eos_ids]
    n_ep = len(prompts) * group_size
    first = runner.reset([dict(rows[i // group_size]) if rows else {} for i in range(n_ep)]) if env is not None \
        else [("ok", None)] * n_ep
    episodes: list[_Episode] = []
    for i in range(n_ep):
        p = list(prompts[i // group_size])
        status, obs = first[i]
        if status == "ok" and obs:
            p.append({"role": "user", "content": obs})
        text = render(tokenizer, p, schemas, generation_prompt=True)
        e = _Episode(encode_texts(tokenizer, [text])[0], p)  # the prompt rule of every pass (BOS once)
        if status == "ok" and obs:  # what this episode was shown first: its messages begin with it
            e.new.append(p[-1])
        if status != "ok":
            e.finish = "error"
            e.new.append({"role": "user", "content": f"(environment reset failed: {obs})"})
        episodes.append(e)
    stepper = env is not None and callable(getattr(env, "step", None))

    for turn in range(max_turns):
        live = [i for i, e in enumerate(episodes) if e.finish is None]
        if not live:
            break
        budget = {i: max_tokens - len(episodes[i].ids) for i in live}
        limit = min(generator.max_new_tokens, max(budget.values()))
        part = generator.generate_ids([episodes[i].prompt_ids + episodes[i].ids for i in live], [""] * len(live), 1,
                                      seed=None if seed is None else chunk_seed(seed, turn), offset=offset,
                                      max_new_tokens=limit)
        for row, i in enumerate(live):
            e = episodes[i]
            n = int(part.completion_mask[row].sum())
            n = min(n, budget[i])
            new = part.completion_ids[row, :n].tolist()
            e.ids += new
            e.model += [1] * n
            e.logp += part.sampler_logp[row, :n].tolist()
            e.turns += 1
            ended = bool(n) and new[-1] in eos_ids
            body = new[:-1] if ended else new
            text = tokenizer.decode(body, skip_special_tokens=False)  # what calls are parsed from, templates re-render
            # what rewards read: without special tokens, as a single-turn completion's text
            e.new.append({"role": "assistant", "content": tokenizer.decode(body, skip_special_tokens=True)})
            e.messages.append({"role": "assistant", "content": text})
            if not ended:
                e.finish = "length"  # the turn (or the episode's budget) ran out
                continue
            calls = _parse(parser, text)
            if not calls and not stepper:
                e.finish = "done"
                continue
            last = turn == max_turns - 1
            if calls and last:
                e.finish = "max_turns"  # its calls are not run: there is no turn left to read them
                continue
            if calls:
                replies = runner.run(calls, episode=i)
                e.calls += len(calls)
                e.outcomes.update(r.outcome for r in replies)
                msgs = [{"role": "tool", "name": r.name, "content": r.content} for r in replies]
                if any(c.id for c in calls):  # a template that pairs replies with calls (Mistral's)
                    e.messages[-1]["tool_calls"] = e.new[-1]["tool_calls"] = call_messages(calls)
                    for m, c in zip(msgs, calls):
                        m["tool_call_id"] = c.id
            else:  # a game's move: the environment answers (on the last turn too: it may end the game)
                (status, got), = runner.step([i], [e.messages])
                if status != "ok":
                    e.finish = "error"
                    continue
                msgs, done = got
                if done or last:
                    e.new += msgs
                    e.finish = "done" if done else "max_turns"
                    continue
            if i in runner.lost:  # the worker holding its environment was killed
                e.new += msgs
                e.finish = "error"
                continue
            try:
                between = inserted_text(tokenizer, e.messages, msgs, schemas,
                                        [tokenizer.decode(new[-1:], skip_special_tokens=False), *eos_texts])
            except Exception:  # the template cannot render these messages
                between = None
            if between is None:
                e.finish = "error"
                continue
            ins = tokenizer(between, add_special_tokens=False)["input_ids"]
            e.messages += msgs
            e.new += msgs
            room = max_tokens - len(e.ids)
            e.ids += ins[:room]
            e.model += [0] * len(ins[:room])
            e.logp += [0.0] * len(ins[:room])
            if len(ins) >= room:  # no room left for the model's next turn
                e.finish = "length"
    for e in episodes:
        if e.finish is None:
            e.finish = "max_turns"
    env_reward, bad = runner.finish(list(range(n_ep))) if env is not None else (None, [])
    ro = _assemble(episodes, generator.pad_token_id, prompts, group_size, env_reward)
    if env is not None:
        ro.episode_stats["episode/env_reward_error_mean"] = len(bad) / n_ep
        if bad:  # (once a run: the same message from the same place)
            warnings.warn(f"rollout.environment: {env.__name__}'s reward could not be read in some episodes "
                          f"(first: {bad[0]}); they have no env_reward (episode/env_reward_error_mean counts them)",
                          stacklevel=2)
    return ro


def _assemble(episodes: list[_Episode], pad_id: int, prompts, group_size: int, env_reward) -> Rollout:
    """The episodes as one Rollout, on the CPU (the caller moves it to the learner's device)."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id, torch.device("cpu"))
    n, t = len(episodes), max([len(e.ids) for e in episodes] + [1])
    ids = torch.full((n, t), pad_id, dtype=torch.long)
    mask = torch.zeros((n, t), dtype=torch.long)
    loss = torch.zeros((n, t), dtype=torch.long)
    logp = torch.zeros((n, t), dtype=torch.float32)
    for r, e in enumerate(episodes):
        k = len(e.ids)
        ids[r, :k] = torch.tensor(e.ids, dtype=torch.long)
        mask[r, :k] = 1
        loss[r, :k] = torch.tensor(e.model, dtype=torch.long)
        logp[r, :k] = torch.tensor(e.logp, dtype=torch.float32)
    stats = {f"episode/finish_{k}": sum(e.finish == k for e in episodes) / n
             for k in ("done", "max_turns", "length", "error")}
    stats.update({"episode/turns_mean": sum(e.turns for e in episodes) / n,
                  "episode/tool_calls_mean": sum(e.calls for e in episodes) / n,
                  "episode/tool_call_frac": sum(e.calls > 0 for e in episodes) / n})
    for k in OUTCOMES:
        stats[f"episode/tool_{k}_mean"] = sum(e.outcomes[k] for e in episodes) / n
    texts = [json.dumps(p, ensure_ascii=False) if not isinstance(p, str) else p for p in prompts]
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids,
                   completion_mask=mask, sampler_logp=logp,
                   finish_reason=[e.finish for e in episodes], group_size=group_size,
                   prompts=[p for p in texts for _ in range(group_size)],
                   completions=[next((m["content"] for m in reversed(e.new) if m["role"] == "assistant"), "")
                                for e in episodes],
                   loss_mask=loss, turns=[e.new for e in episodes], episode_stats=stats, env_reward=env_reward)
