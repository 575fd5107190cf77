"""A run's prompt rows, from its config: loaded (`load_prompt_rows`), checked against what the
rewards and one rollout need (`check_reward_columns`, `enough_rows`), and cut to the prompts that
fit data.max_prompt_tokens (`fitting_prompts`). Training (`gspo.train.run.build_run`) and
`gspo eval` take their rows through here.
"""

from __future__ import annotations

import re
import sys

from gspo.config import Config, ConfigError
from gspo.data import DataError, encode_texts, filter_long_prompts, format_prompt, load_rows, prefill, template_kwargs
from gspo.data.files import held_out_split
from gspo.rewards.shaping import length_limit
from gspo.tasks import SAME_PROMPT_TASKS, TASKS, make_task


def load_prompt_rows(cfg: Config, *, train: bool = True) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows. A built-in task's held-out split has up to eval.num_prompts
    rows whose prompts training never sees (fewer where the task runs out of them: `say_held_out`
    tells), or fresh draws for a task whose prompts are all alike (`SAME_PROMPT_TASKS`).
    A dataset folder's held-out split (its test split, else validation, ...: `held_out_split`)
    is the held-out data unless data.eval_source names other. `train=False` with a
    data.eval_source (`gspo eval`): the held-out rows alone, the training source not even read."""
    d = cfg.data
    if not train and d.eval_source:
        train = []
    elif d.source in TASKS:
        train = make_task(d.source, d.num_prompts, seed=cfg.seed, difficulty=d.difficulty)
        n_held = cfg.eval.num_prompts
        held = make_task(d.source, n_held * 3, seed=cfg.seed + 1_000_003, difficulty=d.difficulty)
        if d.source not in SAME_PROMPT_TASKS:
            seen = {r["prompt"] for r in train}
            held = [r for r in held if r["prompt"] not in seen]
        held = held[:n_held]
    else:
        train = load_rows(d.source, prompt_column=d.prompt_column, split=d.split)  # (field: data.source)
        held = []
        split = source_held_out_split(cfg)  # a folder's own test split, as `gspo eval --config` reads it
        if not d.eval_source and split:  # (all of them: eval.num_prompts is taken from those that fit, `first_fitting`)
            held = load_rows(d.source, prompt_column=d.prompt_column, split=split, field="data.source",
                             held_out=True)
    if d.eval_source:
        held = (make_task(d.eval_source, cfg.eval.num_prompts, seed=cfg.seed + 1_000_003, difficulty=d.difficulty)
                if d.eval_source in TASKS else load_rows(d.eval_source, prompt_column=d.prompt_column, split=d.eval_split,
                                                         field="data.eval_source", split_field="data.eval_split",
                                                         held_out=True))
    return train, held


def source_held_out_split(cfg: Config) -> str | None:
    """The split of data.source that is held out from training (`held_out_split`: its test split,
    else validation, ...), unless training reads that very split (data.split); None if none."""
    split = held_out_split(cfg.data.source)
    return split if split != (cfg.data.split or "train") else None


def say_held_out(cfg: Config, held: list[dict], dropped: int = 0, cap: tuple[int, str] | None = None) -> None:
    """With evaluation on, say where it will have fewer held-out prompts than eval.num_prompts
    (none at all: the run logs no eval/ metrics), and how many were too long (`dropped`, over
    `cap`)."""
    if not cfg.eval.enabled:
        return
    d = cfg.data
    if dropped and cap:
        print(f"dropped {dropped} held-out prompts ({rows_source(cfg, True)}) longer than {cap[0]} tokens ({cap[1]})",
              file=sys.stderr)
    if len(held) >= cfg.eval.num_prompts:
        return
    if not held:
        why = (f"every prompt of {rows_source(cfg, True)} is too long" if dropped else
               f"data.source {d.source} has no held-out split: name one with data.eval_source"
               if d.source not in TASKS or d.eval_source else
               f"the task {d.source} has no prompt left that training does not see")
        print(f"warning: no held-out prompts ({why}); the run logs no eval/ metrics", file=sys.stderr)
    elif not d.eval_source and d.source in TASKS:
        print(f"warning: {len(held)} held-out prompts, not eval.num_prompts={cfg.eval.num_prompts}: the task "
              f"{d.source} has no more that training does not see (data.num_prompts={d.num_prompts}, "
              f"data.difficulty={d.difficulty})", file=sys.stderr)
    else:
        print(f"warning: {len(held)} held-out prompts, fewer than eval.num_prompts={cfg.eval.num_prompts}",
              file=sys.stderr)


def enough_rows(cfg: Config, n: int, which: str = "") -> None:
    """A rollout draws rollout.prompts_per_step distinct prompts: the data must hold that many."""
    if n < cfg.rollout.prompts_per_step:
        raise DataError(f"data.source {cfg.data.source}: {n} prompts{which}, fewer than one rollout's "
                        f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}")


def completion_budget(cfg: Config) -> tuple[int, str]:
    """The most tokens a completion (an episode's, after its prompt) may add to a prompt
    (`length_limit`), and the field that sets it."""
    r = cfg.rollout
    field = "rollout.max_new_tokens"
    if r.tools or r.environment:
        field = "rollout.max_episode_tokens" if r.max_episode_tokens else "rollout.max_turns x rollout.max_new_tokens"
    return length_limit(r), field


def prompt_cap(cfg: Config, positions: int | None = None) -> tuple[int, str]:
    """The most tokens a kept prompt may have, and why: data.max_prompt_tokens, or less where the
    model has `positions` learned positions (`gspo.models.position_limit`) and a prompt of
    data.max_prompt_tokens would not leave room for the completion (rollout.max_new_tokens, or an
    episode's rollout.max_episode_tokens). A completion budget that leaves no room for any prompt
    is one error naming its field."""
    cap, why = cfg.data.max_prompt_tokens, f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
    if positions is None:
        return cap, why
    budget, field = completion_budget(cfg)
    if budget >= positions:
        raise ConfigError(f"config field '{field.split(' ')[0]}': {cfg.model.name_or_path} has {positions} learned "
                          f"positions, and {field} = {budget} completion tokens leave no room for a prompt; "
                          f"set it below {positions}")
    if positions - budget < cap:
        cap, why = positions - budget, f"the model's {positions} learned positions less {field} = {budget}"
    return cap, why


def model_prompt_cap(cfg: Config, model, *, say: bool = True, rows: list[dict] = (), tok=None,
                     schemas: list[dict] | None = None) -> tuple[int, str]:
    """`prompt_cap` under the loaded `model`'s positions: a learned table's hard limit
    (`gspo.models.position_limit`). With relative positions (RoPE) a sequence may run past the
    length the model was trained for (`gspo.models.trained_length`): a warning (`say`) where the longest of
    the prompts kept (`rows`, counted with `tok` as the sampler counts them; with none given,
    data.max_prompt_tokens) plus the completion budget would."""
    from gspo.models import position_limit, trained_length

    limit = position_limit(model)
    cap = prompt_cap(cfg, limit)
    trained = trained_length(getattr(model, "config", None))
    budget, field = completion_budget(cfg)
    if say and limit is None and trained and trained < cap[0] + budget:
        longest, which = cap[0], f"prompts of up to {cap[0]} tokens ({cap[1]})"
        if rows and tok is not None:  # (counted only where the caps alone would pass it)
            longest = max(len(x) for x in encode_texts(tok, [format_prompt(r["prompt"], tok, schemas) for r in rows]))
            which = f"the longest prompt kept, {longest} tokens,"
        if longest + budget > trained:
            print(f"warning: {which} and {field}={budget} run to {longest + budget} tokens, past the {trained} "
                  f"positions {cfg.model.name_or_path} was trained for (max_position_embeddings): lower "
                  f"data.max_prompt_tokens or {field.split(' ')[0]} to keep within it", file=sys.stderr)
    return cap


def rows_source(cfg: Config, held: bool = False) -> str:
    """Where a run's prompt rows come from, as errors name it: data.eval_source for held-out rows
    read from it, else data.source (a file, or the built-in task whose held-out split they are)."""
    d = cfg.data
    return f"data.eval_source {d.eval_source}" if held and d.eval_source else f"data.source {d.source}"


def first_fitting(rows: list[dict], n: int, tok, cap: int, schemas: list[dict] | None, *,
                  source: str) -> tuple[list[dict], int]:
    """The first `n` rows whose prompt fits in `cap` tokens (`filter_long_prompts`), and how many
    before them did not: held-out data is cut to eval.num_prompts from the prompts that fit, and
    a large file is read only as far as that takes."""
    kept, dropped, i = [], 0, 0
    while len(kept) < n and i < len(rows):
        chunk = rows[i:i + n - len(kept)]
        fit, out = filter_long_prompts(chunk, tok, cap, schemas, source=source, first_row=i)
        kept, dropped, i = kept + fit, dropped + out, i + len(chunk)
    return kept, dropped


def fitting_prompts(cfg: Config, rows: list[dict], tok, schemas: list[dict] | None, *, say: bool = True,
                    cap: tuple[int, str] | None = None, held: bool = False, notes: bool = True,
                    limit: int | None = None) -> list[dict]:
    """The rows whose prompt (with the tools' schemas of an episode) fits `cap` (`prompt_cap`:
    data.max_prompt_tokens, or the room the model's learned positions leave), saying how many
    were dropped; one error when none fits. Training and `gspo eval` alike. `held`: the rows are
    the held-out ones (for the errors' `rows_source`). `notes`: also the warnings about the
    prompts' rendering (a second pass leaves them out). `limit`: the first that many that fit."""
    cap, why = cap or prompt_cap(cfg)
    rows, dropped = (filter_long_prompts(rows, tok, cap, schemas, source=rows_source(cfg, held)) if limit is None else
                     first_fitting(rows, limit, tok, cap, schemas, source=rows_source(cfg, held)))
    if dropped and say:
        print(f"dropped {dropped} prompts longer than {cap} tokens ({why})", file=sys.stderr)
    if not rows:
        raise DataError(f"{rows_source(cfg, held)}: no prompt fits in {cap} tokens ({why})")
    say_prefills(cfg, rows, held, say and notes)
    if say and notes:
        say_no_generation_prompt(rows, tok)
    return rows


def say_no_generation_prompt(rows: list[dict], tok) -> None:
    """A warning where the chat template writes nothing for add_generation_prompt=True and its
    rendering ends by closing a turn (an EOS or end-of-turn token): prompts then end without the
    assistant's header, and the model writes it into its completion, where rewards read it."""
    chat = next((r["prompt"] for r in rows if isinstance(r["prompt"], list) and prefill(r["prompt"]) is None), None)
    if chat is None:
        return
    try:
        with_header, without = (tok.apply_chat_template(list(chat), tokenize=False, add_generation_prompt=g,
                                                        **template_kwargs(tok)) for g in (True, False))
    except Exception:  # noqa: BLE001 (format_prompt reports a template that fails)
        return
    tail = with_header.rstrip()  # a turn left closed (Llama-2's and Mistral's end with [/INST], which opens one)
    closers = {t for t in getattr(tok, "all_special_tokens", ()) if re.search(r"end|eot", t, re.I)} | {tok.eos_token}
    closers.discard(None)
    if with_header == without and any(tail.endswith(t) for t in closers):
        name = getattr(tok, "name_or_path", "") or type(tok).__name__
        print(f"warning: the chat template of {name} writes nothing for add_generation_prompt=True, so prompts end "
              "without the assistant's header and the model writes it into each completion (rewards read it): "
              "use a template that opens the assistant turn", file=sys.stderr)


def say_prefills(cfg: Config, rows: list[dict], held: bool = False, say: bool = True) -> None:
    """A note where chat prompts end with an assistant turn: the model continues that turn (as
    TRL does), and reward functions get it whole (`gspo.data.reward_view`)."""
    n = sum(prefill(r["prompt"]) is not None for r in rows)
    if n and say:
        print(f"note: {n} of {len(rows)} prompts ({rows_source(cfg, held)}) end with an assistant turn: the model "
              f"continues that turn, and reward functions get it whole (drop the turn for a fresh answer)",
              file=sys.stderr)


ANSWER_REWARDS = ("exact_answer", "math_verify")  # built-ins that compare with the `answer` column


def check_reward_columns(cfg: Config, rows: list[dict], held: bool = False, specs=None) -> None:
    """What the reward functions read of the rows, checked before the model loads: the answers
    an answer reward compares with (`check_answer_column`), no column named like a built-in's
    option (`check_option_columns`), and with the resolved `specs`, that each reward model's or
    judge's chat template renders the rows' kind of conversation (`check_scorer_templates`).
    `held`: the rows are the held-out ones."""
    check_answer_column(cfg, rows, held)
    check_option_columns(cfg, rows, held)
    check_named_columns(cfg, rows, held)
    check_scorer_templates(cfg, rows, held, specs or [])


def check_scorer_templates(cfg: Config, rows: list[dict], held: bool, specs) -> None:
    """A `model:` or `judge:` reward whose chat template refuses the first row (a template that
    takes no system turn, given data with one) used to stop the run after the first rollout;
    one error naming the entry instead, before the policy loads."""
    from gspo.data import reward_view

    for i, spec in enumerate(specs):
        if not (rows and getattr(spec.scorer, "chat", False)):
            continue
        prompt, completion = reward_view(rows[0]["prompt"], "")
        try:
            spec.scorer.encode([prompt], [completion])
        except Exception as e:  # noqa: BLE001 (jinja's TemplateError, or what the template raises)
            raise ConfigError(f"config field 'rewards.functions[{i}].name': {spec.name}'s chat template cannot render "
                              f"{rows_source(cfg, held)} row 0 with a completion: {type(e).__name__}: {e}") from None


TRL_ONLY_ARGUMENTS = ("trainer_state", "completion_ids", "log_extra", "log_metric")  # what TRL passes besides columns


def check_named_columns(cfg: Config, rows: list[dict], held: bool = False) -> None:
    """A reward function's required argument that no column (nor its kwargs) supplies, which
    would fail at the first scoring, after a rollout: one error before the model loads, naming
    the function and the argument. code_tests needs a `tests` column."""
    import inspect

    from gspo.rewards import by_keyword, is_code_tests, resolve_reward

    columns = {k for r in rows for k in r} - {"prompt"}
    if cfg.rollout.environment:  # the trainer adds the environment's own reward after the episodes
        columns.add("env_reward")
    for i, f in enumerate(cfg.rewards.functions):
        if f.name.startswith(("model:", "judge:")) or not rows:
            continue
        try:
            fn = resolve_reward(f.name)
            params = list(inspect.signature(fn).parameters.values())
        except Exception:  # noqa: BLE001 (an unresolvable name is the name check's to report)
            continue
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        skip = set() if by_keyword(fn) else set(positional[:2])  # (prompts and completions, as the runner passes them)
        needed = [p.name for p in params if p.default is p.empty and p.name not in skip | {"prompts", "completions"}
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in f.kwargs]
        if is_code_tests(fn) and "tests" not in f.kwargs:  # (None: no tests, so no score)
            needed.append("tests")
        prompt = cfg.data.prompt_column
        if any(p.name == prompt and p.name not in skip | {"prompts", "completions"} | set(f.kwargs)
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
            needed.insert(0, prompt)  # with a default too: it would be that default on every call
        missing = [n for n in needed if n not in columns]
        if missing:
            n = missing[0]
            at = f"config field 'rewards.functions[{i}].name': '{f.name}' needs the argument {n!r}"
            if n == prompt:  # (validate_rows renamed it "prompt", which is no keyword column)
                raise DataError(f"{at}: {n!r} is the prompt column (data.prompt_column), which reward functions "
                                "receive as `prompts`, never under its own name: name the argument prompts")
            why = (f"gspo passes a reward function the prompts, the completions and every dataset column; {n!r} is "
                   "one TRL adds, which gspo does not" if n in TRL_ONLY_ARGUMENTS else
                   f"{rows_source(cfg, held)} has no column {n!r} (its columns: {', '.join(sorted(columns)) or 'none'})")
            raise DataError(f"{at}: {why}; give it a default, or set it in rewards.functions[{i}].kwargs")


def check_option_columns(cfg: Config, rows: list[dict], held: bool = False) -> None:
    """A dataset column named like a built-in reward's option (`format`'s `pattern`, `code_tests`'
    `timeout_s` or `memory_mb`) would replace that option for every call: one error naming the
    column, before the model loads (options are set in the function's kwargs)."""
    from gspo.rewards import builtin_options

    columns = {k for r in rows[:1000] for k in r}
    for i, f in enumerate(cfg.rewards.functions):
        clash = sorted(columns & set(builtin_options(f.name)))
        if clash:
            raise DataError(f"{rows_source(cfg, held)}: column {clash[0]!r} has the name of an option of the reward "
                            f"'{f.name}' (rewards.functions[{i}]), which a column would replace; rename the column "
                            f"(set the option in rewards.functions[{i}].kwargs)")


def check_answer_column(cfg: Config, rows: list[dict], held: bool = False) -> None:
    """A built-in reward that compares with the `answer` column, on data that has none (or only
    empty cells), would score nothing (every reward missing): one error before the model loads.
    `held`: the rows are the held-out ones."""
    from gspo.rewards.builtins import gold_answers

    for i, f in enumerate(cfg.rewards.functions):
        if f.name in ANSWER_REWARDS and f.weight != 0 and rows and not any(gold_answers(r.get("answer")) for r in rows):
            columns = sorted({k for r in rows[:100] for k in r})
            blank = any("answer" in r for r in rows)
            what = "has, but with every cell empty" if blank else "does not have"
            hint = ("fill it in" if blank else "name the reference answer 'answer' (MATH's is in 'solution', GSM8K's "
                    "after '####' in 'answer')")
            raise DataError(f"config field 'rewards.functions[{i}].name': {f.name} compares completions with the "
                            f"dataset's 'answer' column, which {rows_source(cfg, held)} {what} (its columns: "
                            f"{', '.join(columns)}); {hint}")
        sample = [a for r in rows[:1000] if isinstance(a := r.get("answer"), str)]
        solutions = sum("####" in a for a in sample)
        if f.name in ANSWER_REWARDS and f.weight != 0 and solutions and 2 * solutions >= len(sample):
            raise DataError(f"config field 'rewards.functions[{i}].name': {f.name} compares completions with the whole "
                            f"'answer' cell, and {solutions} of {len(sample)} cells of {rows_source(cfg, held)} are "
                            "GSM8K-style worked solutions ending in '#### ANSWER', which no completion matches; keep "
                            "the part after '####' in the 'answer' column")
