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
    from gspo.rollout.tools import ToolCall, parse_llama3_json

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
