"""Prompt datasets from files: `load_rows` reads a `.jsonl`, `.json`, `.csv` or `.parquet` file
(the first three may be gzipped), a `datasets` save_to_disk folder or a folder of data files as
the hub lays a dataset out, and `validate_rows` checks each row's prompt (plain text, or a chat
of {"role", "content"} messages) before any model loads. Every error is one `DataError` naming
the file, row or config field."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from gspo.config import DataConfig


class DataError(ValueError):
    """A dataset or data argument is unusable; the message names the file, column or argument."""


_EXTRA_HINT = "install the data extra: pip install 'gspo[data]'"


def _import_optional(module: str, purpose: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"reading {purpose} needs the '{module}' package; {_EXTRA_HINT}") from e


# ---------------------------------------------------------------------------------------------
# Loading


def _open(path: Path, mode: str = "rb", **kw):
    """`path` opened for reading, through gzip when its name ends in .gz."""
    if path.name.lower().endswith(".gz"):
        import gzip

        return gzip.open(path, mode if "b" in mode else "rt", **kw)
    return path.open(mode, **kw)


def _kind(path: Path) -> str:
    """The format a file's name gives: its suffix, lower-cased, before a final .gz."""
    name = path.name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return Path(name).suffix


class _Rows(list):
    """A file's rows, and the line each starts on (`lines`), which data errors name beside the
    row's number (rows count from 0, as datasets and pandas index them)."""

    def __init__(self, rows, lines):
        super().__init__(rows)
        self.lines = list(lines)


def _at(rows, i: int) -> str:
    """Row `i` as errors name it: with its file line where the file has lines."""
    lines = getattr(rows, "lines", None)
    return f"row {i} (line {lines[i]})" if lines is not None and i < len(lines) else f"row {i}"


def _read_jsonl(path: Path) -> list[dict]:
    rows, lines = [], []
    with _open(path) as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM some editors write
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not UTF-8 (byte {raw[e.start]:#04x} at column "
                                f"{e.start + 1}); JSONL files are UTF-8: re-save it as UTF-8") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {lineno} is a {type(row).__name__}, not a JSON object")
            rows.append(row)
            lines.append(lineno)
    return _Rows(rows, lines)


def _read_json(path: Path) -> list[dict]:
    """A `.json` file: one JSON array of objects (what `json.dump(rows)` and pandas'
    `to_json(orient="records")` write), or JSON lines under a .json name (datasets' `to_json`)."""
    try:
        with _open(path) as f:
            text = f.read().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte at offset {e.start}); JSON files are UTF-8: re-save it as UTF-8") from e
    if not text.lstrip().startswith("["):
        try:  # one object spread over lines (rows under a key) is not JSON lines: say so
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict) and "\n" in text.strip():  # (one object on one line: a row of JSON lines)
            keys = ", ".join(repr(k) for k in list(whole)[:8])
            raise DataError(f"{path}: one JSON object (keys {keys}), not an array of rows or JSON lines; write the "
                            f"rows as an array (e.g. the list under its key)")
        return _read_jsonl(path)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from e
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: item {i} of the array is a {type(row).__name__}, not a JSON object")
    return rows


def _read_csv(path: Path) -> list[dict]:
    """A `.csv` file with a header row; every value is text, as the file holds it."""
    import csv

    rows, ends = [], []  # each record, and the file line it ends on
    try:
        with _open(path, "r", newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            for row in reader:
                rows.append(row)
                ends.append(reader.line_num)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte at offset {e.start}); re-save it as UTF-8") from e
    except csv.Error as e:
        raise DataError(f"{path}: cannot read as CSV ({e})") from e
    rows = _Rows(rows, [1 + (ends[i - 1] if i else 1) for i in range(len(rows))])  # the line each record starts on
    for i, row in enumerate(rows):
        if None in row:  # more cells than the header names
            raise DataError(f"{path}: {_at(rows, i)} has more cells than the header has columns")
        if any(v is None for v in row.values()):  # fewer (an empty cell is "", not None)
            raise DataError(f"{path}: {_at(rows, i)} has fewer cells than the header has columns")
    return rows


def _read_parquet(path: Path) -> list[dict]:
    pq = _import_optional("pyarrow.parquet", f"Parquet file {path}")
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise DataError(f"{path}: cannot read as Parquet ({e})") from e


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def _read_file(path: Path) -> list[dict]:
    """The rows of one data file, by its format (`_READERS`); a gzipped one that is cut short or
    not gzip at all is one error naming the file (gzip's EOFError or BadGzipFile before)."""
    import gzip
    import zlib

    try:
        return _READERS[_kind(path)](path)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: cannot read it as gzip ({e}): the file is cut short, corrupt, has bytes after "
                        f"its gzip data, or is not gzip-compressed (then name it without .gz)") from e
SPLITS = ("train", "validation", "valid", "dev", "test", "eval")
# shard numbering: train-00000-of-00002(-<hash>), train_0, train.00
_SHARD = re.compile(r"(?:[-_.]\d+[-_]of[-_]\d+(?:[-_][0-9a-f]{6,})?|[-_.]\d+)$")
_METADATA = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}


def _is_saved_dataset(path: Path) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset's state.json, a DatasetDict's dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _split_name(file: Path) -> str:
    """A data file's own name less its format suffixes and shard numbering: 'train_sft' for
    data/train_sft-00000-of-00001.parquet, 'gsm8k_train' for gsm8k_train.jsonl.gz."""
    name = file.name
    while Path(name).suffix.lower() in (*_READERS, ".gz"):
        name = Path(name).stem
    return _SHARD.sub("", name)


def _words(text: str) -> list[str]:
    """The words of a name, a split word's own digits dropped (train2 is train, as the hub reads it)."""
    words = [w for w in re.split(r"[-._ ]+", text.lower()) if w]
    return [m.group(1) if (m := re.fullmatch(rf"({'|'.join(SPLITS)})\d+", w)) else w for w in words]


HELD_OUT = ("test", "validation", "valid", "dev", "eval")  # held-out data's default split, the first there is


def _data_files(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file() and _kind(f) in _READERS and f.name not in _METADATA
                  and not any(part.startswith(".") for part in f.relative_to(path).parts))


def _first_held_out(files: list[Path], path: Path) -> str | None:
    """The first split of `HELD_OUT` that a folder's file names (or folders) name, if any."""
    present = {w for f in files for w in _words(_split_name(f))
               + [w for part in f.relative_to(path).parts[:-1] for w in _words(part)]}
    return next((s for s in HELD_OUT if s in present), None)


def held_out_split(source: str | Path) -> str | None:
    """The split a source holds out (its test, else validation, ... split: `HELD_OUT`), read as
    held-out data by default; None for a single file, a single dataset, a built-in task name, or
    a folder without one."""
    path = Path(source)
    if not path.is_dir():
        return None
    if _is_saved_dataset(path):
        try:  # a DatasetDict's splits, as save_to_disk lists them (a Dataset has none)
            names = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            names = []
        return next((s for s in HELD_OUT if s in names), None)
    return _first_held_out(_data_files(path), path)


def _read_data_folder(path: Path, split: str | None, split_field: str, held_out: bool = False) -> list[dict]:
    """A folder of data files as the hub lays a dataset out: the files of `split` (default train),
    in name order, read as one dataset. A file belongs to split S when its name less shard
    numbering is S (data/train-00000-of-00002.parquet), when S is a word of that name
    (gsm8k_train.jsonl) or of a folder on its way down (train/part-0.jsonl). A name that only
    contains S among other words (train_sft, validation_matched) is its own split: asked for by
    name, and refused as ambiguous when S matches several. A folder whose files name no split is
    one dataset, read whole when no split is asked for; one that holds several datasets in
    subfolders (configs) is refused."""
    files = _data_files(path)
    if not files:
        raise DataError(f"{path}: a folder that is neither a datasets save_to_disk folder nor holds data files "
                        f"({', '.join(_READERS)})")
    names = {f: _split_name(f) for f in files}
    folders = {f: [w for part in f.relative_to(path).parts[:-1] for w in _words(part)] for f in files}
    if split is None and held_out:  # held-out data: its test (or validation, ...) split where it has one
        split = _first_held_out(files, path)
    want = (split or "train").lower()
    exact = [f for f in files if names[f].lower() == want or (want in folders[f] and not any(
        w in SPLITS for w in _words(names[f]) if w != want))]
    worded = [f for f in files if want in _words(names[f])]
    known = sorted({n for f, n in names.items() if any(w in SPLITS for w in _words(n))}
                   | {w for ws in folders.values() for w in ws if w in SPLITS})
    if exact:
        chosen = exact
    elif len({names[f] for f in worded}) == 1:
        chosen = worded
    elif worded:
        raise DataError(f"{path}: {split_field}={want!r} matches the files of several splits "
                        f"({', '.join(sorted({names[f] for f in worded}))}); name one of them in {split_field}")
    elif split is None and not known:
        chosen = files  # no split anywhere: one dataset
    else:
        raise DataError(f"{path}: no data files of split {want!r} ({split_field}); splits found: "
                        f"{', '.join(known) if known else 'none (the files name no split)'}")
    configs = sorted({f.relative_to(path).parts[0] for f in chosen if len(f.relative_to(path).parts) > 1
                      and f.relative_to(path).parts[0] not in ("data", *SPLITS)})
    if len(configs) > 1:
        raise DataError(f"{path}: holds several datasets in its folders ({', '.join(configs)}); name one of those "
                        f"folders in {split_field.replace('split', 'source')}")
    parts = [(f, _read_file(f)) for f in chosen]
    differ = [what for what, n in (("formats", len({_kind(f) for f in chosen})),
                                   ("columns", len({frozenset(k for row in rows for k in row) for _, rows in parts})))
              if n > 1]
    if differ:  # (a hub dataset's shards share one format and schema)
        print(f"note: {path}: read {len(chosen)} files of different {' and '.join(differ)} as one dataset "
              f"({', '.join(f.name for f in chosen[:4])}{', ...' if len(chosen) > 4 else ''}); name one file, or a "
              f"folder of one dataset's files, to read less", file=sys.stderr)
    return [row for _, rows in parts for row in rows]


def _read_saved_dataset(path: Path, split: str | None, split_field: str = "data.split",
                        held_out: bool = False) -> list[dict]:
    datasets = _import_optional("datasets", f"the saved dataset folder {path}")
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{path}: not a folder made by datasets' save_to_disk ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        split = split or next((s for s in (HELD_OUT if held_out else ()) if s in ds), "train")
        if split not in ds:
            raise DataError(f"{path}: no split {split!r} ({split_field}); splits found: {', '.join(ds)}")
        ds = ds[split]
    elif split is not None:
        raise DataError(f"{split_field}={split!r}: {path} is a single dataset with no splits; leave {split_field} "
                        f"unset")
    return ds.to_list()


def _prompt_kind(prompt: Any) -> str | None:
    """'text', 'chat', or None when the value is neither."""
    if isinstance(prompt, str):
        return "text" if prompt.strip() else None
    if isinstance(prompt, (list, tuple)) and prompt:
        ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)
        return "chat" if ok else None
    return None


def validate_rows(rows: Sequence[dict], *, source: str, prompt_column: str = DataConfig.prompt_column) -> list[dict]:
    """Check `rows` and return copies with `prompt_column` renamed to "prompt".

    Raises DataError when the rows are empty, the prompt column is missing, a prompt is not a
    non-empty string or a non-empty list of {"role", "content"} messages, or when plain-text
    and chat prompts are mixed. `source` names the dataset in messages.
    """
    if not rows:
        raise DataError(f"{source}: the dataset is empty")
    if prompt_column != "prompt" and any("prompt" in r for r in rows):
        raise DataError(
            f"{source}: prompt_column is {prompt_column!r} but a 'prompt' column also exists; "
            "rename one of them"
        )
    first_kind = None
    out = []
    for i, row in enumerate(rows):
        if prompt_column not in row:
            found = sorted({k for r in rows for k in r})
            raise DataError(
                f"{source}: {_at(rows, i)} has no prompt column {prompt_column!r}; columns found: {found} "
                f"(data.prompt_column names the column that holds the prompts)"
            )
        prompt = row[prompt_column]
        kind = _prompt_kind(prompt)
        if kind is None:
            raise DataError(
                f"{source}: {_at(rows, i)}, column {prompt_column!r}: a prompt must be a non-empty string "
                f"or a non-empty list of {{'role', 'content'}} messages, got {str(prompt)[:100]!r}"
            )
        if first_kind is None:
            first_kind = kind
        elif kind != first_kind:
            raise DataError(
                f"{source}: {_at(rows, i)}, column {prompt_column!r} is a {kind} prompt but row 0 is a "
                f"{first_kind} prompt; a dataset must not mix plain-text and chat prompts"
            )
        new = {("prompt" if k == prompt_column else k): v for k, v in row.items()}
        clash = sorted({"prompts", "completions"} & new.keys())
        if clash:
            raise DataError(f"{source}: {_at(rows, i)} has a column {clash[0]!r}, which reward functions receive as "
                            f"their own argument (fn(prompts, completions, **columns)); rename the column")
        if kind == "chat":
            new["prompt"] = [_message(m, f"{source}: {_at(rows, i)}, column {prompt_column!r}, message {j}")
                             for j, m in enumerate(prompt)]
            if _empty_last_turn(new["prompt"]):  # a placeholder for the answer: the generation prompt
                new["prompt"] = new["prompt"][:-1]
            if all(m.get("role") in ("system", "developer") for m in new["prompt"]):
                raise DataError(f"{source}: {_at(rows, i)}, column {prompt_column!r}: the conversation has only system "
                                f"messages; a prompt needs a user (or assistant) turn")
        elif _looks_like_messages(prompt):
            raise DataError(f"{source}: {_at(rows, i)}, column {prompt_column!r} is text that holds a JSON list of chat "
                            f"messages, which would be trained on as plain text; store the list itself (JSONL, "
                            f"Parquet or a saved dataset; a CSV cell can only hold text)")
        out.append(new)
    return out


def _empty_last_turn(messages: list[dict]) -> bool:
    """Whether a conversation ends with an assistant turn that holds nothing (content empty or
    whitespace, no tool calls), a common placeholder for "answer here". It is dropped, so the
    prompt ends with the template's generation prompt: continued as a turn (`prefill`), it would
    render without the header's separator under templates that trim content (Llama 3 lost the
    "\n\n" after its header, Gemma the "\n"), a prompt the model never sees when it is used."""
    last = messages[-1] if messages else {}
    return (len(messages) > 1 and last.get("role") == "assistant" and not last.get("tool_calls")
            and isinstance(last.get("content"), str) and not last["content"].strip())


def _looks_like_messages(text: str) -> bool:
    """Whether a text prompt is a JSON-encoded list of {"role", "content"} messages."""
    t = text.strip()
    if not (t.startswith("[") and t.endswith("]") and '"role"' in t):
        return False
    try:
        value = json.loads(t)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def _message(m: dict, where: str) -> dict:
    """A chat message whose content is text: a string as it is; a list of text parts (the
    OpenAI / multimodal style) joined into one string, as templates that take parts render
    them; None only beside `tool_calls` (an assistant turn that only calls tools)."""
    if m.get("role") in SHAREGPT_ROLES:
        raise DataError(f"{where}: role {m['role']!r} is ShareGPT's; chat templates take "
                        f"{', '.join(repr(r) for r in SHAREGPT_ROLES.values())}: rename the roles")
    content = m["content"]
    if isinstance(content, str) or (content is None and m.get("tool_calls")):
        return m
    if isinstance(content, (list, tuple)) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return {**m, "content": "".join(p["text"] for p in content)}
    raise DataError(f"{where}: content must be a string or a list of {{'type': 'text', 'text': ...}} parts, "
                    f"got {str(content)[:100]!r}")


def load_rows(
    source: str | os.PathLike, *, prompt_column: str = DataConfig.prompt_column, split: str | None = None,
    field: str = "data.source", split_field: str = "data.split", held_out: bool = False,
) -> list[dict]:
    """Read a prompt dataset into a list of row dicts, with the prompt column named "prompt".

    `source` is a `.jsonl` file (one JSON object per line; blank lines skipped), a `.json` file
    (an array of objects, or JSON lines), a `.csv` file with a header (values are text), a
    `.parquet` file (any of them but Parquet may be gzipped, `.jsonl.gz`), a folder written by
    `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or a folder of such files as
    the hub lays a dataset out (`_read_data_folder`). `split` picks a DatasetDict's or a
    folder's split (default "train"); a single file or Dataset has none, and naming one is an
    error. Parquet and saved datasets need the optional extra `gspo[data]`. All columns other
    than the prompt column pass through unchanged. Rows of a JSONL file may have different keys
    (a reward function gets None where a row lacks a column: `gspo.rewards.reward_columns`).
    `field` and `split_field` are the config fields errors name. `held_out`: the rows are
    held-out data, whose default split is the first of `HELD_OUT` the source has (else train).
    """
    path = Path(source)
    if not path.exists():
        hint = ""
        if any(c in str(source) for c in "*?["):
            hint = "; a pattern (glob) is not expanded: put the files in one folder and name the folder"
        elif len(Path(str(source)).parts) == 2 and not _kind(path):  # owner/name: a hub id
            hint = ("; a hub dataset id is not downloaded: save the dataset with datasets' save_to_disk (or as a "
                    ".jsonl or .parquet file) and name that")
        raise DataError(f"{field}: dataset path {str(path)!r} does not exist (a relative path is looked for in the "
                        f"working directory {os.getcwd()}, then beside the config file){hint}")
    if path.is_dir():
        rows = (_read_saved_dataset(path, split, split_field, held_out) if _is_saved_dataset(path)
                else _read_data_folder(path, split, split_field, held_out))
    elif _kind(path) in _READERS and not (path.name.lower().endswith(".gz") and _kind(path) == ".parquet"):
        if split is not None:
            raise DataError(f"{split_field}={split!r}: {path} is a single file with no splits; leave {split_field} "
                            f"unset, or name the split's own file in {field}")
        rows = _read_file(path)
    else:
        raise DataError(
            f"{field}: cannot read {str(path)!r}: expected a .jsonl, .json, .csv or .parquet file (the first three "
            "may be gzipped), a folder made by datasets' save_to_disk, or a folder of such files"
        )
    return validate_rows(rows, source=str(path), prompt_column=prompt_column)
