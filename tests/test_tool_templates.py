"""Chat templates in tool episodes (gspo.rollout.episodes): the text a template puts between
turns, templates that rewrite the last turn, the check a template must pass before any
sampling, and the prompt-length limit counted as the template renders an episode's prompt."""

from __future__ import annotations

import pytest

from gspo.models.tiny import build_char_tokenizer
from gspo.rollout.tools import tool_schema
from test_tools import CHARS, add, call


# A template in the Qwen2.5 / Hermes style (written here, not copied): tools in a system block,
# <|im_start|>role ... <|im_end|> turns, consecutive tool replies in one user turn inside
# <tool_response> tags.
QWEN_STYLE = (  # newlines as {{ '\n' }}: transformers renders templates with trim_blocks
    "{% if tools %}<|im_start|>system{{ '\\n' }}# Tools{{ '\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}"
    "{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m.content }}{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


def test_what_goes_between_turns_in_a_qwen_style_template():
    """The inserted text is the template's own: after the sampled <|im_end|>, its newline, the
    replies grouped in one user turn, and the next generation prompt."""
    from gspo.rollout.episodes import inserted_text

    tok = build_char_tokenizer(CHARS)
    tok.chat_template = QWEN_STYLE
    schema = [tool_schema(add)]
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": call("add", a=2, b=3)}]
    replies = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "6"}]
    got = inserted_text(tok, messages, replies, schema, "<|im_end|>")
    assert got == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>"
                   "<|im_end|>\n<|im_start|>assistant\n")


# Qwen3's trait, in a template of our own: the last assistant turn gets an empty <think> block
# (reasoning is shown for the turn being written), earlier ones lose it.
THINK_STYLE = QWEN_STYLE.replace(
    "{% else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}",
    "{% else %}<|im_start|>{{ m.role }}{{ '\\n' }}{% if m.role == 'assistant' and loop.last %}<think>{{ '\\n\\n' }}"
    "</think>{{ '\\n\\n' }}{% endif %}{{ m.content }}")


def test_a_template_that_rewrites_the_last_turn_once_replies_follow_still_gives_the_text_between():
    from gspo.rollout.episodes import inserted_text

    tok = build_char_tokenizer(CHARS)
    tok.chat_template = THINK_STYLE
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": call("add", a=2, b=3)}]
    replies = [{"role": "tool", "name": "add", "content": "5"}]
    assert "<think>" in tok.apply_chat_template(messages, tokenize=False)  # the trait is there
    got = inserted_text(tok, messages, replies, [tool_schema(add)], "<|im_end|>")
    assert got == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # a template that rewrites an earlier turn as well: no text, the episode ends as an error
    tok.chat_template = THINK_STYLE.replace("{{ m.content }}<|im_end|>", "{{ m.content }}{{ messages | length }}<|im_end|>")
    assert inserted_text(tok, messages, replies, [tool_schema(add)], "<|im_end|>") is None


def test_the_chat_template_is_checked_for_tool_episodes_before_any_sampling():
    """It must render a tool's reply (else: one config error); one that ignores tools= is said."""
    from gspo.config import ConfigError
    from gspo.rollout.episodes import check_tool_template

    tok = build_char_tokenizer(CHARS)
    schema = [tool_schema(add)]
    tok.chat_template = QWEN_STYLE
    assert check_tool_template(tok, schema) is None and check_tool_template(tok, []) is None
    tok.chat_template = QWEN_STYLE.replace("{% if tools %}", "{% if false %}")  # never shows the schemas
    assert "ignores tools=" in check_tool_template(tok, schema)
    tok.chat_template = ("{% for m in messages %}{% if m.role != 'tool' %}{{ m.role }}: {{ m.content }}{{ '\\n' }}"
                         "{% endif %}{% endfor %}")  # a Llama-2-style template: no tool turns at all
    with pytest.raises(ConfigError, match="'rollout.tools': the tokenizer's chat template drops messages of role"):
        check_tool_template(tok, schema)
    tok.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('ids!') }}{% endif %}" \
                        "{{ m.content }}{% endfor %}"
    with pytest.raises(ConfigError, match="chat template fails on a tool's reply .*ids!"):
        check_tool_template(tok, schema)


def test_with_tools_the_prompt_length_limit_counts_the_schemas_the_template_shows():
    from gspo.data import filter_long_prompts

    tok = build_char_tokenizer(CHARS)
    tok.chat_template = QWEN_STYLE
    rows = [{"prompt": "2+3?"}, {"prompt": [{"role": "user", "content": "4+4?"}]}]
    assert filter_long_prompts(rows[1:], tok, 100) == (rows[1:], 0)  # 54 tokens alone: it fits
    assert filter_long_prompts(rows, tok, 100, [tool_schema(add)]) == ([], 2)  # 392 with the schemas
    assert filter_long_prompts(rows, tok, 392, [tool_schema(add)]) == (rows, 0)


# A template in the Llama 3.1 style (written here): header-delimited turns ended by <|eot_id|>, a
# tool's reply in an "ipython" turn, the model's call a bare JSON object (rollout.tool_parser=llama3_json).
LLAMA_STYLE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{% set role = 'ipython' if m.role == 'tool' else m.role %}"
    "<|start_header_id|>{{ role }}<|end_header_id|>{{ '\\n\\n' }}"
    "{% if loop.first and tools %}Tools: {% for t in tools %}{{ t | tojson }}{% endfor %}{{ '\\n\\n' }}{% endif %}"
    "{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)


def test_a_llama_style_episode_reads_the_json_call_and_inserts_an_ipython_turn():
    from gspo.rollout.episodes import check_tool_template, inserted_text
    from gspo.rollout.tool_calls import ToolCall, parse_llama3_json

    tok = build_char_tokenizer(CHARS)
    tok.chat_template = LLAMA_STYLE
    schema = [tool_schema(add)]
    assert check_tool_template(tok, schema) is None  # renders tool replies and the schemas
    turn = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    assert parse_llama3_json(turn) == [ToolCall("add", {"a": 2, "b": 3})]
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": turn}]
    got = inserted_text(tok, messages, [{"role": "tool", "name": "add", "content": "5"}], schema, "<|eot_id|>")
    assert got == ("<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


# A template in the Mistral v3 style (written here): [INST] turns, the schemas in
# [AVAILABLE_TOOLS], an assistant turn with tool_calls rendered as [TOOL_CALLS][{..., "id"}],
# each reply in [TOOL_RESULTS] with the id of its call, which must be 9 characters; the roles
# alternate once tool turns and calls are set aside. No generation prompt: the answer follows.
MISTRAL_STYLE = (
    "{% set ns = namespace(i=0) %}"
    "{% for m in messages | rejectattr('role', 'equalto', 'tool') | selectattr('tool_calls', 'undefined') %}"
    "{% if (m.role == 'user') != (ns.i % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% set ns.i = ns.i + 1 %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}{% if loop.first and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls is defined %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{\"name\": {{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}, "
    "\"id\": {{ c.id | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, \"call_id\": {{ m.tool_call_id | tojson }}}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}"
)


def test_mistral_calls_are_read_in_both_of_its_formats_and_each_gets_a_9_character_id():
    from gspo.rollout.tool_calls import ToolCall, call_id, parse_mistral

    v3 = 'I will add. [TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, ' \
         '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}", "id": "Ab3dE6gH9"}]'
    calls = parse_mistral(v3)
    assert calls == [ToolCall("add", {"a": 2, "b": 3}, id=call_id(v3, 0)), ToolCall("add", {"a": 1, "b": 1}, id="Ab3dE6gH9")]
    assert len(calls[0].id) == 9 and calls[0].id.isalnum() and calls[0].id == parse_mistral(v3)[0].id  # the same each run
    assert call_id(v3, 0) != call_id(v3, 1) != call_id(v3 + " ", 1)
    v11 = '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]add[CALL_ID]xYz123abc[ARGS]{"a": 4, "b": 5}'
    assert parse_mistral(v11) == [ToolCall("add", {"a": 2, "b": 3}, id=call_id(v11, 0)),
                                  ToolCall("add", {"a": 4, "b": 5}, id="xYz123abc")]
    assert parse_mistral("the answer is 5") == []
    bad = parse_mistral('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2,')
    assert len(bad) == 1 and bad[0].error.startswith("not JSON") and len(bad[0].id) == 9  # its reply needs an id too
    assert parse_mistral('[TOOL_CALLS]add{"a": 1}')[0].error == "no tool name and [ARGS] after [TOOL_CALLS]"
    assert parse_mistral('[TOOL_CALLS][{"name": "add", "arguments": {}, "id": "short"}]')[0].id != "short"


def test_a_template_that_pairs_replies_with_call_ids_is_checked_with_ids_and_says_which_parser_writes_them():
    from gspo.config import ConfigError
    from gspo.rollout.episodes import check_tool_template

    tok = build_char_tokenizer(CHARS)
    tok.chat_template = MISTRAL_STYLE
    schema = [tool_schema(add)]
    assert check_tool_template(tok, schema, call_ids=True) is None
    assert check_tool_template(tok, schema, call_ids=None) is None  # a parser of the user's: either form
    with pytest.raises(ConfigError, match="length 9.*needs rollout.tool_parser=mistral"):
        check_tool_template(tok, schema)  # hermes or llama3_json: no ids


def test_a_mistral_style_episode_carries_the_call_ids_into_the_template_and_the_turns():
    from gspo.rollout.episodes import run_episodes
    from gspo.rollout.tool_calls import call_id, parse_mistral
    from gspo.rollout.tools import ToolRunner
    from test_tools import Scripted

    tok = build_char_tokenizer(CHARS)
    tok.chat_template = MISTRAL_STYLE
    first = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]'
    gen = Scripted(tok, [first, "5"])
    with ToolRunner([add], num_workers=0) as runner:
        ro = run_episodes(gen, tok, [[{"role": "user", "content": "2+3?"}]], 1, tools=[add], runner=runner,
                          parser=parse_mistral, max_turns=3, max_tokens=400)
    cid = call_id(first, 0)
    call = {"id": cid, "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    assert ro.turns[0] == [{"role": "assistant", "content": first, "tool_calls": [call]},
                           {"role": "tool", "name": "add", "content": "5", "tool_call_id": cid},
                           {"role": "assistant", "content": "5"}]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn1 = enc(first) + [tok.eos_token_id]
    inserted = enc('[TOOL_RESULTS]{"content": "5", "call_id": "' + cid + '"}[/TOOL_RESULTS]')
    want = turn1 + inserted + enc("5") + [tok.eos_token_id]
    assert ro.completion_ids[0, :len(want)].tolist() == want
    assert ro.loss_mask[0, :len(want)].tolist() == [1] * len(turn1) + [0] * len(inserted) + [1] * 2
    assert ro.finish_reason == ["done"] and ro.episode_stats["episode/tool_ok_mean"] == 1


def test_no_chat_template_at_all_gets_no_advice_about_call_ids():
    """With no template, the refusal ended with advice about Mistral's call ids, which cannot help."""
    from gspo.config import ConfigError
    from gspo.rollout.episodes import check_tool_template

    tok = build_char_tokenizer(CHARS)
    tok.chat_template = None
    with pytest.raises(ConfigError, match="fails on a tool's reply") as e:
        check_tool_template(tok, [tool_schema(add)])
    assert "call ids" not in str(e.value)
