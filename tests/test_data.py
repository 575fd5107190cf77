"""gspo.data: loading, validation, prompt formatting. The sampler and built-in tasks:
tests/test_sampler_and_tasks.py."""

import json

import pytest

from gspo.data import DataError, PromptStream, filter_long_prompts, format_prompt, load_rows, validate_rows

ROWS = [
    {"prompt": "1+1=", "answer": "2", "meta": {"id": 0, "tags": ["a"]}},
    {"prompt": "2+3=", "answer": "5", "meta": {"id": 1, "tags": []}},
]
CHAT_ROWS = [
    {"question": [{"role": "user", "content": "hi"}], "answer": "1"},
    {"question": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}], "answer": "2"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def char_tokenizer():
    """Every character is a token; the chat template renders '<role>content\\n' per message."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789+-=:<>|/ \n"))
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                   chat_template=template)


# ------------------------------------------------------------------------------ load_rows


def test_jsonl_round_trip_passes_extra_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_rows(path) == ROWS


def test_jsonl_renames_prompt_column_and_keeps_chat(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS)
    rows = load_rows(str(path), prompt_column="question")
    assert [r["prompt"] for r in rows] == [r["question"] for r in CHAT_ROWS]
    assert all("question" not in r and r.keys() == {"prompt", "answer"} for r in rows)


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(path) == ROWS


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    renamed = [{"text": r["prompt"], "answer": r["answer"]} for r in ROWS]
    datasets.Dataset.from_list(renamed).save_to_disk(str(tmp_path / "ds"))
    rows = load_rows(tmp_path / "ds", prompt_column="text")
    assert rows == [{"prompt": r["prompt"], "answer": r["answer"]} for r in ROWS]

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                               "test": datasets.Dataset.from_list(ROWS[1:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd") == ROWS[:1]  # default split "train"
    assert load_rows(tmp_path / "dd", split="test") == ROWS[1:]
    with pytest.raises(DataError, match=r"no split 'valid' \(data.split\).*train, test"):
        load_rows(tmp_path / "dd", split="valid")
    with pytest.raises(DataError, match=r"data.split='test': .*ds is a single dataset with no splits"):
        load_rows(tmp_path / "ds", prompt_column="text", split="test")  # (it was ignored: the whole set)


def test_a_built_in_tasks_held_out_split_and_what_is_said_when_it_is_short(capsys):
    """Held-out prompts are ones training never sees; the guessing game's prompts are all alike
    (its secret is a column), so its held-out rows are fresh games. Fewer than eval.num_prompts,
    or none, is said at start-up."""
    from gspo.config import load_config
    from gspo.train.prompts import load_prompt_rows, say_held_out

    cfg = load_config(None, ["data.source=arithmetic", "data.num_prompts=500", "eval.num_prompts=50"])
    train, held = load_prompt_rows(cfg)
    assert len(held) == 50 and not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    say_held_out(cfg, held)
    assert capsys.readouterr().err == ""
    cfg = load_config(None, ["data.source=guess", "data.num_prompts=200", "eval.num_prompts=40"])
    train, held = load_prompt_rows(cfg)
    assert len(held) == 40 and len({r["secret"] for r in held}) > 1  # every game's prompt is a training prompt
    cfg = load_config(None, ["data.source=arithmetic", "data.num_prompts=20000", "eval.num_prompts=100"])
    train, held = load_prompt_rows(cfg)
    assert 0 < len(held) < 100  # the task has run out of unseen prompts at this difficulty
    say_held_out(cfg, held)
    assert f"{len(held)} held-out prompts, not eval.num_prompts=100: the task arithmetic has no more" in capsys.readouterr().err
    say_held_out(load_config(None, ["data.source=rows.jsonl"]), [])
    assert "no held-out prompts (data.source rows.jsonl has no held-out split: name one with data.eval_source)" \
        in capsys.readouterr().err
    say_held_out(load_config(None, ["data.source=rows.jsonl", "eval.enabled=false"]), [])
    assert capsys.readouterr().err == ""


def test_a_runs_held_out_rows_come_from_data_eval_split_of_a_dataset_dict(tmp_path):
    import datasets

    from gspo.config import load_config
    from gspo.train.prompts import load_prompt_rows

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "dd"))
    base = [f"data.source={tmp_path / 'dd'}", f"data.eval_source={tmp_path / 'dd'}"]
    train, held = load_prompt_rows(load_config(None, [*base, "data.eval_split=test"]))
    assert train == rows[:4] and held == rows[4:]
    assert load_prompt_rows(load_config(None, base))[1] == rows[4:]  # unset: held-out data's default, its test split
    assert load_prompt_rows(load_config(None, [*base, "data.eval_split=train"]))[1] == rows[:4]
    # data.eval_source unset: the source's own test split is held out, as `gspo eval --config` reads it
    assert load_prompt_rows(load_config(None, base[:1])) == (rows[:4], rows[4:])
    single = tmp_path / "rows.jsonl"
    write_jsonl(single, rows)
    assert load_prompt_rows(load_config(None, [f"data.source={single}"])) == (rows, [])  # a file holds none out
    assert load_prompt_rows(load_config(None, [*base[:1], "data.split=test"])) == (rows[4:], [])


def test_missing_file_names_path(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        load_rows(tmp_path / "nope.jsonl")


def test_a_missing_path_names_the_field_where_it_looked_and_what_a_hub_id_needs(tmp_path):
    with pytest.raises(DataError, match=r"data.eval_source: dataset path .*nope.jsonl' does not exist \(a relative path "
                                        r"is looked for in the working directory"):
        load_rows(tmp_path / "nope.jsonl", field="data.eval_source")
    with pytest.raises(DataError, match="a hub dataset id is not downloaded: save the dataset with datasets' save_to_disk"):
        load_rows("openai/gsm8k")


def test_gzipped_and_upper_case_files_are_read_and_a_split_of_a_file_is_refused(tmp_path):
    import gzip

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "d.csv.gz", "wt") as f:
        f.write("prompt,answer\n1+1=,2\n2+2=,4\n")
    (tmp_path / "D.JSONL").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("d.jsonl.gz", "d.csv.gz", "D.JSONL"):
        assert load_rows(tmp_path / name) == rows, name
    with pytest.raises(DataError, match=r"data.eval_split='test': .*D.JSONL is a single file with no splits"):
        load_rows(tmp_path / "D.JSONL", split="test", field="data.eval_source", split_field="data.eval_split")


def test_a_hub_style_folder_is_read_by_split(tmp_path):
    """A dataset as the hub lays it out (data/<split>-0000i-of-0000n.parquet): the split's files
    in order, as one dataset; a folder whose files name no split is read whole."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows[:2]), hub / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:4]), hub / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[4:]), hub / "data" / "test-00000-of-00001.parquet")
    (hub / "README.md").write_text("a dataset card")
    assert load_rows(hub) == rows[:4] and load_rows(hub, split="test") == rows[4:]
    with pytest.raises(DataError, match=r"no data files of split 'validation' \(data.split\); splits found: test, train"):
        load_rows(hub, split="validation")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (flat / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[3:]))
    assert load_rows(flat) == rows
    from gspo.data.files import held_out_split
    assert held_out_split(hub) == "test" and held_out_split(flat) is None  # what a run holds out by default
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither a datasets save_to_disk folder nor holds data files"):
        load_rows(tmp_path / "empty")


def test_a_hub_style_folders_split_names_are_whole_names_and_its_configs_are_not_merged(tmp_path):
    """A file belongs to a split by its whole name (train_sft is not train), a word of it
    (gsm8k_train) or its folder; several splits or configs that a name would merge are refused
    (test rows had been trained on: gsm8k_train + gsm8k_test were read as one dataset)."""
    def write(rel, n, tag):
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(json.dumps({"prompt": f"{tag}{i}="}) + "\n" for i in range(n)))

    for split in ("train_sft", "train_gen", "test_sft"):
        write(f"ultra/data/{split}-00000-of-00001.jsonl", 2, split)
    write("gsm/gsm8k_train.jsonl", 2, "train")
    write("gsm/gsm8k_test.jsonl", 1, "test")
    (tmp_path / "gsm" / "dataset_infos.json").write_text(json.dumps({"default": {}}, indent=2))  # not data
    for config in ("main", "socratic"):
        write(f"cfgs/{config}/train-00000-of-00001.jsonl", 1, config)
    prompts = lambda rows: [r["prompt"] for r in rows]  # noqa: E731
    assert prompts(load_rows(tmp_path / "ultra", split="train_sft")) == ["train_sft0=", "train_sft1="]
    with pytest.raises(DataError, match=r"data.split='train' matches the files of several splits \(train_gen, "
                                        r"train_sft\); name one"):
        load_rows(tmp_path / "ultra")
    assert prompts(load_rows(tmp_path / "gsm")) == ["train0=", "train1="]
    assert prompts(load_rows(tmp_path / "gsm", split="test")) == ["test0="]
    with pytest.raises(DataError, match=r"holds several datasets in its folders \(main, socratic\)"):
        load_rows(tmp_path / "cfgs")
    assert prompts(load_rows(tmp_path / "cfgs" / "main")) == ["main0="]
    # shard numbering of every kind is not a split of its own, and a split word keeps its digits
    # (train2 + test2 were read as one dataset; hashed and _0/_1 shards were refused as several splits)
    for name, shards in (("hashed", ["data/train-00000-of-00002-a1b2c3d4e5f6", "data/train-00001-of-00002-0f9e8d7c6b5a"]),
                         ("under", ["train_0", "train_1"]), ("dotted", ["train.00", "train.01"])):
        for i, shard in enumerate(shards):
            write(f"{name}/{shard}.jsonl", 1, f"part{i}_")
        write(f"{name}/test.jsonl", 1, "test")
        assert prompts(load_rows(tmp_path / name)) == ["part0_0=", "part1_0="], name
    write("digits/train2.jsonl", 2, "train")
    write("digits/test2.jsonl", 1, "test")
    assert prompts(load_rows(tmp_path / "digits")) == ["train0=", "train1="]
    assert prompts(load_rows(tmp_path / "digits", held_out=True)) == ["test0="]  # held-out data's default split


def test_a_json_object_and_a_short_csv_row_are_refused_saying_what_they_are(tmp_path):
    (tmp_path / "obj.json").write_text(json.dumps({"data": [{"prompt": "x"}], "version": 1}, indent=2))
    with pytest.raises(DataError, match=r"one JSON object \(keys 'data', 'version'\), not an array of rows"):
        load_rows(tmp_path / "obj.json")
    # one object on one line is one row of JSON lines (datasets' to_json of one row), whatever its columns hold
    (tmp_path / "row.json").write_text(json.dumps({"conversation": [{"role": "user", "content": "x"}], "tests": [{}]}))
    assert load_rows(tmp_path / "row.json", prompt_column="conversation")[0]["tests"] == [{}]
    (tmp_path / "short.csv").write_text("prompt,answer,level\n1+1=,2,1\n2+2=,4\n")
    with pytest.raises(DataError, match=r"row 1 \(line 3\) has fewer cells than the header has columns"):
        load_rows(tmp_path / "short.csv")


def test_unknown_extension(tmp_path):
    (tmp_path / "d.tsv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"d\.tsv.*\.jsonl, \.json, \.csv or \.parquet"):
        load_rows(tmp_path / "d.tsv")


def test_json_arrays_json_lines_and_csv_are_read(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "a, \"b\"", "answer": "3"}]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "l.json").write_text("".join(json.dumps(r) + "\n" for r in rows))  # datasets' to_json
    (tmp_path / "c.csv").write_bytes(b"\xef\xbb\xbfprompt,answer\r\n1+1=,2\r\n\"a, \"\"b\"\"\",3\r\n")
    for name in ("a.json", "l.json", "c.csv"):
        assert load_rows(tmp_path / name) == rows, name
    (tmp_path / "bad.json").write_text('[{"prompt": "x"}, 3]')
    with pytest.raises(DataError, match=r"bad\.json: item 1 of the array is a int"):
        load_rows(tmp_path / "bad.json")
    (tmp_path / "wide.csv").write_text("prompt\nx,y\n")  # (row 0, as the content errors number it: records from 0)
    with pytest.raises(DataError, match=r"wide\.csv: row 0 \(line 2\) has more cells"):
        load_rows(tmp_path / "wide.csv")


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"d\.jsonl: line 2"):
        load_rows(path)


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes('{"prompt": "a"}\n{"prompt": "caf\u00e9"}\n'.encode("utf-8") + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"d\.jsonl: line 3 is not UTF-8 \(byte 0xe9 at column 16\)"):
        load_rows(path)


def test_a_byte_order_mark_some_editors_write_is_read_past(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n'.encode("utf-8"))
    assert [r["prompt"] for r in load_rows(path)] == ["a", "b"]
    bad = tmp_path / "e.jsonl"
    bad.write_bytes('{"prompt": "a"}\n'.encode("utf-8") + b"\xef\xbb\xbf" + b'{"prompt": "b"}\n')
    with pytest.raises(DataError, match=r"e\.jsonl: line 2"):  # only a file's first line may start with one
        load_rows(bad)


@pytest.mark.parametrize("column", ["completions", "prompts"])
def test_a_column_named_as_a_reward_argument_is_refused_naming_the_row(column):
    with pytest.raises(DataError, match=rf"src: row 1 has a column '{column}'.*rename the column"):
        validate_rows([{"prompt": "a"}, {"prompt": "b", column: "x"}], source="src")
    assert validate_rows([{"prompts": "a"}], source="src", prompt_column="prompts") == [{"prompt": "a"}]


def test_chat_content_is_text_parts_are_joined_and_anything_else_is_refused():
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "7="}]}]
    tool_turn = [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                 {"role": "tool", "content": "3"}]
    rows = validate_rows([{"prompt": text_parts}, {"prompt": tool_turn}], source="src")
    assert rows[0]["prompt"] == [{"role": "user", "content": "12+7="}]
    assert rows[1]["prompt"] == tool_turn
    assert text_parts[0]["content"][0] == {"type": "text", "text": "12+"}  # the caller's rows are not changed
    for bad in (None, [{"type": "image", "url": "x.png"}], [], 3):
        with pytest.raises(DataError, match=r"src: row 1, column 'prompt', message 0: content must be a string"):
            validate_rows([{"prompt": text_parts}, {"prompt": [{"role": "user", "content": bad}]}], source="src")


def test_sharegpt_roles_system_only_chats_and_json_encoded_messages_are_refused_naming_the_row():
    """Each went to the template or the model as it was: ShareGPT's roles (which most templates
    render as unknown roles or drop), a conversation with no turn to answer, and a message list
    written as text (a CSV cell), which trained on the JSON itself."""
    ok = {"prompt": [{"role": "user", "content": "hi"}]}
    with pytest.raises(DataError, match=r"src: row 1, column 'prompt', message 0: role 'human' is ShareGPT's"):
        validate_rows([ok, {"prompt": [{"role": "human", "content": "hi"}]}], source="src")
    with pytest.raises(DataError, match=r"src: row 1, column 'prompt': the conversation has only system messages"):
        validate_rows([ok, {"prompt": [{"role": "system", "content": "be brief"}]}], source="src")
    as_text = json.dumps([{"role": "user", "content": "2+2="}])
    with pytest.raises(DataError, match=r"src: row 0, column 'prompt' is text that holds a JSON list of chat messages"):
        validate_rows([{"prompt": as_text}], source="src")
    assert validate_rows([{"prompt": "[1, 2] + [3] ="}], source="src")[0]["prompt"] == "[1, 2] + [3] ="  # text


def test_missing_prompt_column_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"no prompt column 'prompt'.*\['answer', 'question'\] \(data\.prompt_column "):
        load_rows(path)


def test_empty_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"d\.jsonl: the dataset is empty"):
        load_rows(path)


def test_mixed_plain_and_chat_names_row(tmp_path):
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": [{"role": "user", "content": "c"}]}]
    with pytest.raises(DataError, match=r"row 2.*must not mix"):
        load_rows(write_jsonl(tmp_path / "d.jsonl", rows))


@pytest.mark.parametrize("bad", ["", "   ", None, 3, [], [{"content": "no role"}], ["str"]])
def test_bad_prompt_values(bad):
    with pytest.raises(DataError, match=r"src: row 1, column 'prompt'"):
        validate_rows([{"prompt": "ok"}, {"prompt": bad}], source="src")


def test_prompt_column_clash():
    with pytest.raises(DataError, match="'prompt' column also exists"):
        validate_rows([{"q": "a", "prompt": "b"}], source="src", prompt_column="q")


# ------------------------------------------------------------------------------ formatting


def test_format_prompt_plain_and_chat(char_tokenizer):
    assert format_prompt("1+1=", char_tokenizer) == "1+1="
    text = format_prompt(CHAT_ROWS[1]["question"], char_tokenizer)
    assert text == "<system>be brief\n<user>yo\n<assistant>"


def test_format_prompt_without_chat_template(char_tokenizer):
    tok = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer, unk_token="<unk>")
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat_template"):
        format_prompt([{"role": "user", "content": "hi"}], tok)


def test_filter_long_prompts_counts_formatted_chat(char_tokenizer):
    rows = [{"prompt": "12345"}, {"prompt": "123"}, {"prompt": "1234567"}]
    kept, dropped = filter_long_prompts(rows, char_tokenizer, 5)
    assert kept == rows[:2] and dropped == 1
    chat = [{"prompt": [{"role": "user", "content": "ab"}]}]  # "<user>ab\n<assistant>" = 20 chars
    assert filter_long_prompts(chat, char_tokenizer, 20) == (chat, 0)
    assert filter_long_prompts(chat, char_tokenizer, 19) == ([], 1)


def test_a_chat_template_that_refuses_a_prompt_names_the_source_and_row(char_tokenizer):
    """Gemma's templates raise on a system turn: the error says which dataset and which row."""
    tok = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer, unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    rows = [{"prompt": m} for m in (CHAT_ROWS[0]["question"], CHAT_ROWS[1]["question"])]
    assert filter_long_prompts(rows[:1], tok, 50) == (rows[:1], 0)
    with pytest.raises(DataError, match=r"^data\.source d\.jsonl: row 1: .*System role not supported"):
        filter_long_prompts(rows, tok, 50, source="data.source d.jsonl")


def test_a_chat_template_without_a_generation_prompt_is_warned_about(char_tokenizer, capsys):
    """A template that ignores add_generation_prompt leaves the prompt without the assistant's
    header: the model writes it, and rewards got 'assistant\\n7'. Not a word was said."""
    from gspo.train.prompts import say_no_generation_prompt

    rows = [{"prompt": [{"role": "user", "content": "2+5="}]}]
    say_no_generation_prompt(rows, char_tokenizer)
    assert "add_generation_prompt" not in capsys.readouterr().err  # its template opens the assistant turn
    tok = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer, unk_token="<unk>",
                                   eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    say_no_generation_prompt(rows, tok)  # no turn is closed: [/INST] (Llama-2, Mistral) opens the answer
    assert "add_generation_prompt" not in capsys.readouterr().err
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    say_no_generation_prompt(rows, tok)
    assert "writes nothing for add_generation_prompt=True" in capsys.readouterr().err


def test_chat_template_kwargs_reach_every_rendering(char_tokenizer):
    """data.chat_template_kwargs (TRL's chat_template_kwargs): Qwen3's enable_thinking=False had no
    way in; the field was refused as unknown."""
    from gspo.config import ConfigError, load_config
    from gspo.data import use_template_kwargs
    from gspo.rollout.episodes import render

    tok = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer, unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not "
                         "enable_thinking %}<think></think>{% endif %}{% endif %}")
    chat = [{"role": "user", "content": "2+5="}]
    assert format_prompt(chat, tok) == "<user>2+5=\n<assistant>"
    cfg = load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"])
    use_template_kwargs(tok, cfg.data.chat_template_kwargs)
    assert format_prompt(chat, tok) == "<user>2+5=\n<assistant><think></think>"
    assert render(tok, chat, None, generation_prompt=True).endswith("<think></think>")  # an episode's turns
    with pytest.raises(ConfigError, match=r"data\.chat_template_kwargs.*'tools' is apply_chat_template's own"):
        load_config(None, ["data.chat_template_kwargs={tools: []}"])
    from gspo.data import template_kwargs
    from gspo.train.run import build_policy

    _, policy_tok = build_policy(load_config(None, ["tiny.hidden_size=16", "tiny.num_layers=1",
                                                    "data.chat_template_kwargs={enable_thinking: false}"]))
    assert template_kwargs(policy_tok) == {"enable_thinking": False}  # training's and gspo eval's tokenizer


def test_a_template_that_writes_the_bos_after_a_stray_newline_gets_no_second_one():
    """A template rendering '\\n<s>...' with a tokenizer whose post-processor adds BOS gave the
    model BOS twice, though prompts get the tokenizer's BOS once."""
    from artifacts import build_tokenizer

    from gspo.data import encode_texts

    tok = build_tokenizer("llama")  # its post-processor prepends <s>
    plain, stray = encode_texts(tok, ["hi", "\n<s>[INST] hi [/INST]"])
    assert plain[0] == tok.bos_token_id and plain.count(tok.bos_token_id) == 1
    assert stray.count(tok.bos_token_id) == 1


def test_a_column_some_rows_lack_reaches_every_reward_call_as_none(tmp_path):
    """A call whose rows all lacked a column got no such keyword, so a reward that needs it
    raised mid-run (the start-up check saw the column in other rows)."""
    from gspo.rewards import reward_columns

    f = tmp_path / "ragged.jsonl"
    f.write_text('{"prompt": "a", "x": 1}\n{"prompt": "b", "y": [1]}\n{"prompt": "c"}\n{"prompt": "d", "x": null}\n')
    rows = load_rows(f)
    assert rows[2] == {"prompt": "c"}  # the rows as read: an environment's reset(**row) keeps its defaults
    stream = PromptStream(rows, batch_size=2, seed=0)
    assert stream.columns == ["x", "y"]
    assert reward_columns([rows[2], rows[0]], 2, stream.columns) == {"x": [None, None, 1, 1], "y": [None] * 4}


def test_a_missing_split_of_a_folder_per_split_layout_names_the_splits_there_are(tmp_path):
    """It named the files' own name ("part") as the splits found."""
    for split in ("train", "validation"):
        (tmp_path / "d" / split).mkdir(parents=True)
        (tmp_path / "d" / split / "part-0.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"no data files of split 'test' \(data.split\); splits found: train, validation$"):
        load_rows(tmp_path / "d", split="test")


@pytest.mark.parametrize("style", ["llama", "gemma", "qwen"])
def test_an_empty_last_assistant_turn_is_the_generation_prompt(tmp_path, style):
    """{"role": "assistant", "content": ""} at the end of a conversation is a placeholder for the
    answer: the prompt renders with the template's generation prompt, as without it. Continued
    as a turn it lost the header's separator under templates that trim content (Llama 3's
    "\\n\\n", Gemma's "\\n"). A turn with text is still continued; a system-only rest is refused."""
    from artifacts import build_tokenizer
    from gspo.data import prefill

    tok = build_tokenizer(style)
    user = [{"role": "user", "content": "What is 2+3?"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "answer": "5"}) for p in (
        user + [{"role": "assistant", "content": ""}], user + [{"role": "assistant", "content": "  \n"}],
        user + [{"role": "assistant", "content": "The answer is"}])) + "\n")
    empty, blank, started = load_rows(path)
    assert empty["prompt"] == blank["prompt"] == user and prefill(empty["prompt"]) is None
    assert format_prompt(empty["prompt"], tok) == tok.apply_chat_template(user, tokenize=False,
                                                                          add_generation_prompt=True)
    assert prefill(started["prompt"]) == "The answer is"
    path.write_text(json.dumps({"prompt": [{"role": "system", "content": "s"}, {"role": "assistant", "content": ""}]}))
    with pytest.raises(DataError, match="only system messages"):
        load_rows(path)
