"""A task's examples: the official SuperGLUE loader for the built-ins, a user's own files for the rest.

User files are jsonl, json, csv, tsv or parquet, or a `datasets.save_to_disk` folder. Text files are read line by
line here so that every problem names its file, line and field (a bad byte, a ragged row, a JSON label of another
type); parquet files and saved datasets go through `datasets`, and their rows are named by row number. Every
check runs before training starts, so bad data never leaves a half-written run.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..data.superglue import DataFormatError, Example, paper_splits, parse_record, validation_mask
from .preprocess import PREPROCESSORS
from .spec import TaskSpec, close_name

SPLIT_NAMES = ("train", "validation", "test")
ROLES = ("system", "user", "assistant", "tool", "developer")
Row = tuple[str, dict[str, Any]]  # ("file:line", row)


def read_rows(path: str | Path) -> list[Row]:
    """("file:line", row) for every row of a jsonl, json, csv, tsv or parquet file.

    Example:
        >>> import tempfile, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "d.csv"
        >>> _ = f.write_text("text,label\\nhi,yes\\n")
        >>> read_rows(f)[0][1]
        {'text': 'hi', 'label': 'yes'}
    """
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _dataset_rows(path, "parquet")
    if suffix not in (".jsonl", ".json", ".csv", ".tsv"):
        raise DataFormatError(f"{path}: unknown file type {suffix or '(none)'}; use jsonl, json, csv, tsv or parquet")
    text = _decoded(path)
    if suffix == ".jsonl" or (suffix == ".json" and not text.lstrip().startswith("[")):
        return _jsonl_rows(path, text)
    if suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from err
        rows = []
        for number, item in enumerate(items, start=1):
            if not isinstance(item, dict):
                raise DataFormatError(f"{path}: item {number} is {type(item).__name__}, expected an object")
            rows.append((f"{path} item {number}", item))
        return rows
    return _csv_rows(path, text, "\t" if suffix == ".tsv" else ",")


def _decoded(path: Path) -> str:
    """The file as text: UTF-8, a leading BOM dropped; a bad byte names its line."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DataFormatError(
            f"{path}:{line}: byte 0x{data[err.start]:02x} is not UTF-8; save the file as UTF-8"
        ) from err
    return text.removeprefix("\ufeff")


def _jsonl_rows(path: Path, text: str) -> list[Row]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{where}: malformed JSON ({err.msg})") from err
        if not isinstance(row, dict):
            raise DataFormatError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        rows.append((where, row))
    return rows


def _csv_rows(path: Path, text: str, delimiter: str) -> list[Row]:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = next(reader, None)
    if not header:
        raise DataFormatError(f"{path}: empty file (no header row)")
    rows = []
    line = reader.line_num
    for values in reader:
        start, line = line + 1, reader.line_num
        if not values:  # a blank line
            continue
        if len(values) != len(header):
            raise DataFormatError(
                f"{path}:{start}: {len(values)} fields, the header has {len(header)} ({', '.join(header)}); "
                "quote a field that holds the delimiter"
            )
        rows.append((f"{path}:{start}", dict(zip(header, values, strict=True))))
    return rows


def _dataset_rows(path: Path, builder: str) -> list[Row]:
    import datasets

    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # arrow and datasets errors: all mean "this file cannot be read"
        raise DataFormatError(f"{path}: cannot read it as {builder} ({type(err).__name__}: {err})") from err
    return [(f"{path} row {i + 1}", row) for i, row in enumerate(table)]


def _saved_dataset(folder: Path) -> dict[str, list[Row]]:
    """The splits of a `datasets.save_to_disk` folder ("validation" may also be called "val" or "dev")."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(folder))
    except Exception as err:
        raise DataFormatError(f"{folder}: not a datasets.save_to_disk folder ({type(err).__name__}: {err})") from err
    if isinstance(saved, datasets.Dataset):
        saved = {"train": saved}
    names = {"train": "train", "validation": "validation", "val": "validation", "dev": "validation", "test": "test"}
    unknown = sorted(set(saved) - set(names))
    if unknown or "train" not in saved:
        raise DataFormatError(f"{folder}: splits {sorted(saved)}; expected train and optionally validation, test")
    return {
        names[split]: [(f"{folder} {split} row {i + 1}", row) for i, row in enumerate(table)]
        for split, table in saved.items()
    }


# ---------------------------------------------------------------------------------------------------- examples


def required_fields(spec: TaskSpec) -> list[str]:
    """The columns every row of the task must have."""
    names = list(spec.text_fields) + list(spec.option_fields)
    names += [spec.options_field] if spec.options_field else []
    if spec.preprocess:
        names += [n for n in PREPROCESSORS[spec.preprocess].reads if n not in names]
    return names


def _check_columns(spec: TaskSpec, rows: list[Row], labelled: bool) -> None:
    """Every required column in every row; a misspelt one is named with the close column the file has."""
    wanted = required_fields(spec) + ([spec.label_field] if labelled and spec.label_field else [])
    for where, row in rows:
        for name in wanted:
            if name not in row:
                raise DataFormatError(
                    f"{where}: missing field {name!r}{close_name(name, row)}; the row has {', '.join(map(str, row))}"
                )
            if name != spec.label_field and row[name] is None:
                raise DataFormatError(f"{where}: field {name!r} is empty (null)")


def _label_id(spec: TaskSpec, where: str, value: Any, labels: tuple[Any, ...]) -> int:
    for label_id, label in enumerate(labels):
        if type(value) is type(label) and value == label:  # True == 1 must not pass as a label
            return label_id
    for label_id, label in enumerate(labels):  # csv and tsv cells are text: "1" is the label 1
        if isinstance(value, str) and not isinstance(label, str) and value == _text(label):
            return label_id
    raise DataFormatError(
        f"{where}: field {spec.label_field!r}: unknown label {value!r}; the task's labels are "
        f"{', '.join(map(repr, labels))} (from the training file, or the spec's labels)"
    )


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def infer_labels(spec: TaskSpec, rows: list[Row]) -> tuple[Any, ...]:
    """The label set of a training split: its distinct values, sorted; a column of mixed types is refused."""
    first: tuple[str, Any] | None = None
    seen: dict[Any, None] = {}
    for where, row in rows:
        value = row.get(spec.label_field)
        if value is None or isinstance(value, (list, dict, float)):
            kind = "empty" if value is None else type(value).__name__
            raise DataFormatError(f"{where}: field {spec.label_field!r} is {kind}; a label is a string or integer")
        if first is None:
            first = (where, value)
        elif type(value) is not type(first[1]):
            raise DataFormatError(
                f"{where}: field {spec.label_field!r} is {type(value).__name__} {value!r}, but {first[0]} has "
                f"{type(first[1]).__name__} {first[1]!r}: a label column holds one type"
            )
        seen.setdefault(value)
    if len(seen) < 2:
        raise DataFormatError(
            f"{rows[0][0]}: field {spec.label_field!r} has {len(seen)} distinct label(s); a classify task needs "
            "two or more"
        )
    return tuple(sorted(seen))


def _examples(spec: TaskSpec, split: str, rows: list[Row], source: str) -> list[Example]:
    if not rows:
        raise DataFormatError(f"{source}: the {split} split is empty")
    labelled = spec.label_field is not None and (split != "test" or spec.label_field in rows[0][1])
    _check_columns(spec, rows, labelled)
    examples = []
    for number, (where, row) in enumerate(rows):
        fields = {name: row[name] for name in required_fields(spec) if name != spec.options_field}
        label, candidates = None, ()
        if spec.kind == "choice":
            candidates = _options(spec, where, row)
            if labelled:
                label = _answer_index(
                    spec, where, row.get(spec.label_field), len(candidates) or len(spec.option_fields)
                )
        elif spec.kind == "classify" and labelled:
            label = _label_id(spec, where, row[spec.label_field], spec.labels)
        elif spec.kind == "generate":
            fields = _generate_fields(spec, where, row)
        examples.append(Example(spec.name, number, fields, label, candidates=candidates))
    return examples


def _options(spec: TaskSpec, where: str, row: dict[str, Any]) -> tuple[str, ...]:
    if not spec.options_field:
        return ()
    value = row[spec.options_field]
    if isinstance(value, str):  # a csv cell: the options as a JSON list
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, list) or len(value) < 2 or not all(isinstance(o, str) and o for o in value):
        raise DataFormatError(f"{where}: field {spec.options_field!r} must be a list of two or more non-empty strings")
    return tuple(value)


def _answer_index(spec: TaskSpec, where: str, value: Any, count: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < count:
        raise DataFormatError(
            f"{where}: field {spec.label_field!r} is {value!r}; the answer is an option's index, 0 to {count - 1}"
        )
    return value


def _generate_fields(spec: TaskSpec, where: str, row: dict[str, Any]) -> dict[str, Any]:
    if "messages" not in spec.text_fields:
        for name in ("prompt", "completion"):
            if not isinstance(row[name], str):
                raise DataFormatError(f"{where}: field {name!r} is {type(row[name]).__name__}, expected text")
        return {"prompt": row["prompt"], "completion": row["completion"]}
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataFormatError(f"{where}: field 'messages'[{turn}] needs a text 'content'")
        if message.get("role") not in ROLES:
            raise DataFormatError(
                f"{where}: field 'messages'[{turn}]: unknown role {message.get('role')!r}"
                f"{close_name(str(message.get('role')), ROLES)}; roles are {', '.join(ROLES)}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataFormatError(f"{where}: field 'messages' has no assistant turn: nothing to learn from this row")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}


def _user_rows(spec: TaskSpec) -> dict[str, tuple[list[Row], str]]:
    """{split: (rows, where they came from)} of the splits the spec's source has."""
    source = spec.source
    if source.get("dataset"):
        return {split: (rows, source["dataset"]) for split, rows in _saved_dataset(Path(source["dataset"])).items()}
    if not source.get("train"):
        raise DataFormatError(f"{spec.name}: the task's source names no train file (--train-file, or source.train)")
    return {split: (read_rows(source[split]), source[split]) for split in SPLIT_NAMES if source.get(split)}


def resolved_spec(spec: TaskSpec, rows: dict[str, tuple[list[Row], str]] | None = None) -> TaskSpec:
    """The spec with its label set filled in from the training data where it names none."""
    if spec.kind != "classify" or spec.labels:
        return spec
    rows = rows or _user_rows(spec)
    train, where = rows["train"]
    if not train:
        raise DataFormatError(f"{where}: the train split is empty")
    _check_columns(spec, train, labelled=True)
    return replace(spec, labels=infer_labels(spec, train))


def task_splits(
    spec: TaskSpec, seed: int = 0, data_dir: str | None = None
) -> tuple[TaskSpec, dict[str, list[Example]], str]:
    """(the spec with its labels resolved, {"train", "validation", "test"}, the scored split) for `spec`.

    Built-ins follow the paper (`paper_splits`). User data without a validation file gives the paper's rule: 10% of
    train (`validation_fraction`), stratified by label, drawn with `seed`. Without a test file, "test" is the
    validation split itself, and the scored split is "validation" (else "test").
    """
    if spec.source.get("superglue"):
        return spec, paper_splits(spec.name, data_dir, seed=seed, val_fraction=spec.validation_fraction), "test"
    rows = _user_rows(spec)
    spec = resolved_spec(spec, rows)
    splits = {split: _examples(spec, split, *rows[split]) for split in SPLIT_NAMES if split in rows}
    if "validation" not in splits:
        train = splits["train"]
        is_val = validation_mask(train, spec.validation_fraction, seed)
        splits["train"] = [ex for ex, v in zip(train, is_val, strict=True) if not v]
        splits["validation"] = [ex for ex, v in zip(train, is_val, strict=True) if v]
        if not splits["validation"]:
            raise DataFormatError(
                f"{rows['train'][1]}: too few rows to carve a validation split; give --validation-file"
            )
    scored = "test" if "test" in splits else "validation"
    splits.setdefault("test", splits["validation"])
    return spec, splits, scored


def parse_task_record(spec: TaskSpec, record: dict[str, Any], where: str) -> list[Example]:
    """Examples from one input record of a task (`capt predict`, `/v1/classify`): an official record for a
    SuperGLUE task, the task's own fields for a user task; a label is optional."""
    if spec.source.get("superglue"):
        return parse_record(spec.name, record, where)
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: a record must be an object of the task's fields")
    examples = _examples(spec, "test", [(where, record)], where)
    return [replace(ex, idx=where) for ex in examples]
