"""SuperGLUE loading: official jsonl files or the Hugging Face Hub copy, flattened to one `Example` per scored
item, plus the paper's 90/10 train/validation split (the official validation set serves as the test set)."""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HUB_DATASET = "aps/super_glue"
SPLITS = ("train", "val", "test")
_HUB_SPLITS = {"train": "train", "val": "validation", "test": "test"}


@dataclass(frozen=True)
class TaskInfo:
    """Where a task lives and how its labels are named (label id = position in `labels`)."""

    folder: str
    labels: tuple[str, ...]
    raw_labels: tuple[Any, ...]  # the label values in the official jsonl, in label-id order
    hub_config: str


_BOOL = ("False", "True")
_CB = ("entailment", "contradiction", "neutral")
_RTE = ("entailment", "not_entailment")
TASKS: dict[str, TaskInfo] = {
    "boolq": TaskInfo("BoolQ", _BOOL, (False, True), "boolq"),
    "cb": TaskInfo("CB", _CB, _CB, "cb"),
    "copa": TaskInfo("COPA", ("choice1", "choice2"), (0, 1), "copa"),
    # MultiRC answer labels are the ints 0/1 in the official file (not bools like BoolQ/WiC/WSC).
    "multirc": TaskInfo("MultiRC", _BOOL, (0, 1), "multirc"),
    "rte": TaskInfo("RTE", _RTE, _RTE, "rte"),
    "wic": TaskInfo("WiC", _BOOL, (False, True), "wic"),
    # wsc.fixed is the Hub config lm-eval uses; it corrects a few span indices of the original HF conversion.
    "wsc": TaskInfo("WSC", _BOOL, (False, True), "wsc.fixed"),
    # ReCoRD has no fixed label set: an example's label indexes its own `candidates`.
    "record": TaskInfo("ReCoRD", (), (), "record"),
}

# Fields copied into Example.fields: the texts the templates use, plus the offsets lm-eval's WiC/WSC
# prompts need.
_TEXT_FIELDS = {
    "boolq": ("question", "passage"),
    "cb": ("premise", "hypothesis"),
    "copa": ("premise", "choice1", "choice2", "question"),
    "multirc": ("paragraph", "question", "answer"),
    "rte": ("premise", "hypothesis"),
    "wic": ("word", "sentence1", "sentence2"),
    "wsc": ("text", "span1_text", "span2_text"),
    "record": ("passage", "query"),
}
_INT_FIELDS = {"wic": ("start1", "end1"), "wsc": ("span2_index",)}
_GROUPED = ("multirc", "record")  # several examples share one passage: split by passage, never inside it


class DataNotFoundError(FileNotFoundError):
    """The requested SuperGLUE split is neither in the data folder nor reachable on the Hub."""


class DataFormatError(ValueError):
    """A data file (or Hub row) does not follow the official SuperGLUE format."""


@dataclass(frozen=True)
class Example:
    """One scored item: a sentence pair, one MultiRC answer option, one COPA question or one ReCoRD query.

    `group` is the question id for grouped metrics (MultiRC "p<par>-q<question>", ReCoRD
    "p<passage>-q<query>"), `doc` the shared passage id ("p<par>") the train/validation split keeps whole.
    `label` is None when the split has no labels (test). For ReCoRD, `label` indexes `candidates` (the first
    gold answer among them).
    """

    task: str
    idx: int | str
    fields: dict[str, str | int]
    label: int | None
    group: str | None = None
    doc: str | None = None
    candidates: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The SuperGLUE folder to read: the argument, else env CAPT_DATA_DIR, else None (use the Hub)."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get("CAPT_DATA_DIR")
    return Path(env).expanduser() if env else None


def load_split(task: str, split: str, data_dir: str | os.PathLike[str] | None = None) -> list[Example]:
    """Load one official split ("train", "val" or "test") of `task` as a list of Examples.

    Reads `<data_dir>/<Task>/<split>.jsonl` when a data folder is given (argument or CAPT_DATA_DIR),
    otherwise the Hub dataset aps/super_glue. Raises DataNotFoundError when neither has the split and
    DataFormatError (naming file and line) for malformed input.
    """
    task = _check_task(task)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = resolve_data_dir(data_dir)
    if root is not None:
        examples, source = _load_local(task, split, root), str(root / TASKS[task].folder / f"{split}.jsonl")
    else:
        examples, source = _load_hub(task, split), f"{HUB_DATASET}/{TASKS[task].hub_config} {split}"
    if not examples:
        raise DataFormatError(f"{source}: no examples")
    seen: set[int | str] = set()
    for ex in examples:
        if ex.idx in seen:
            raise DataFormatError(f"{source}: duplicate idx {ex.idx!r}")
        seen.add(ex.idx)
    return examples


def paper_splits(
    task: str, data_dir: str | os.PathLike[str] | None = None, seed: int = 0, val_fraction: float = 0.1
) -> dict[str, list[Example]]:
    """The paper's protocol: {"train": 90% of official train, "validation": 10%, "test": official val}.

    The validation part is stratified by label (per class within one example of its share; a class with >= 2
    examples keeps at least one on each side). MultiRC and ReCoRD are split by whole passages, chosen at
    random without stratification, so no question (or passage) is seen on both sides; there the fraction
    counts passages, not answers. Deterministic for a seed; both parts keep the file order.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    task = _check_task(task)
    train = load_split(task, "train", data_dir)
    test = load_split(task, "val", data_dir)
    is_val = validation_mask(train, val_fraction, seed, grouped=task in _GROUPED)
    return {
        "train": [ex for ex, v in zip(train, is_val, strict=True) if not v],
        "validation": [ex for ex, v in zip(train, is_val, strict=True) if v],
        "test": test,
    }


def validation_mask(examples: list[Example], fraction: float, seed: int, grouped: bool = False) -> list[bool]:
    """Which examples the paper's rule carves out of a training split for validation: `fraction` of them, stratified
    by label (per class within one example of its share; a class with >= 2 examples keeps at least one on each
    side), or with `grouped`, whole `doc`s chosen at random. Deterministic for a seed.

    Example:
        >>> exs = [Example("t", i, {}, i % 2) for i in range(10)]
        >>> sum(validation_mask(exs, 0.2, seed=0))
        2
    """
    rng = random.Random(seed)
    if grouped:
        docs = sorted({str(ex.doc) for ex in examples})
        rng.shuffle(docs)
        chosen_docs = set(docs[: _clamp(round(len(docs) * fraction), len(docs))])
        return [ex.doc in chosen_docs for ex in examples]
    by_label: dict[int | None, list[int]] = defaultdict(list)
    for i, ex in enumerate(examples):
        by_label[ex.label].append(i)
    counts = {label: len(ids) for label, ids in by_label.items()}
    quotas = _stratified_quotas(counts, fraction)
    chosen: set[int] = set()
    for label in sorted(by_label, key=str):  # fixed class order so the rng draws are reproducible
        ids = by_label[label]
        rng.shuffle(ids)
        chosen.update(ids[: quotas[label]])
    return [i in chosen for i in range(len(examples))]


def _clamp(n_val: int, n: int) -> int:
    """Keep at least one item on each side when there are two or more; a single item stays in train."""
    return min(max(n_val, 1), n - 1) if n >= 2 else 0


def _stratified_quotas(counts: dict[Any, int], fraction: float) -> dict[Any, int]:
    """Validation size per class by largest remainder, so the total is round(N * fraction) when possible."""
    exact = {k: n * fraction for k, n in counts.items()}
    quotas = {k: int(v) for k, v in exact.items()}
    missing = round(sum(counts.values()) * fraction) - sum(quotas.values())
    for k in sorted(counts, key=lambda k: (quotas[k] - exact[k], str(k)))[:missing]:
        quotas[k] += 1
    return {k: _clamp(q, counts[k]) for k, q in quotas.items()}


def _check_task(task: str) -> str:
    name = task.lower()
    if name not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASKS)}")
    return name


def _get(obj: Any, key: str, where: str, kind: type = str) -> Any:
    """obj[key], checked to exist and to be of `kind`, else a DataFormatError naming the place and field."""
    if not isinstance(obj, dict) or key not in obj:
        raise DataFormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DataFormatError(f"{where}: field {key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _label(row: dict[str, Any], task: str, split: str, allowed: tuple[Any, ...], where: str) -> int | None:
    """Label id of `row`; None only for a test row without label (the official test files have none)."""
    if split == "test" and "label" not in row:
        return None
    raw = _get(row, "label", where, object)
    for label_id, value in enumerate(allowed):
        if type(raw) is type(value) and raw == value:  # type check: True == 1 must not pass as a COPA label
            return label_id
    raise DataFormatError(f"{where}: unknown {task} label {raw!r}; allowed: {list(allowed)}")


def _flat_example(
    task: str,
    row: dict[str, Any],
    where: str,
    label: int | None,
    idx: int | str,
    group: str | None = None,
    doc: str | None = None,
) -> Example:
    fields: dict[str, str | int] = {key: _get(row, key, where) for key in _TEXT_FIELDS[task]}
    fields.update({key: _get(row, key, where, int) for key in _INT_FIELDS.get(task, ())})
    if task == "copa" and fields["question"] not in ("cause", "effect"):
        raise DataFormatError(f"{where}: COPA question {fields['question']!r}; allowed: ['cause', 'effect']")
    return Example(task, idx, fields, label, group, doc)


def _record_example(row: dict[str, Any], split: str, where: str, passage_id: int, query_id: int) -> Example:
    """ReCoRD query with sorted unique candidate entities and gold answers (as the HF builder dedups them)."""
    candidates = tuple(sorted(set(_get(row, "entities", where, list))))
    answers = tuple(sorted(set(_get(row, "answers", where, list))))
    gold = [i for i, c in enumerate(candidates) if c in answers]
    if answers and not gold:
        raise DataFormatError(f"{where}: no gold answer {list(answers)} is among the entities")
    if not answers and split != "test":
        raise DataFormatError(f"{where}: query {query_id} has no gold answers")
    ex = _flat_example(
        "record",
        row,
        where,
        gold[0] if gold else None,
        f"p{passage_id}-q{query_id}",
        group=f"p{passage_id}-q{query_id}",
        doc=f"p{passage_id}",
    )
    return replace(ex, candidates=candidates, answers=answers)


def _local_examples(task: str, record: Any, split: str, where: str) -> list[Example]:
    """Examples from one line of an official jsonl file (MultiRC/ReCoRD lines hold a whole passage)."""
    allowed = TASKS[task].raw_labels
    if task == "multirc":
        passage = _get(record, "passage", where, dict)
        paragraph, pid = _get(passage, "text", where), _get(record, "idx", where, int)
        out = []
        for question in _get(passage, "questions", where, list):
            qid = _get(question, "idx", where, int)
            for answer in _get(question, "answers", where, list):
                aid = _get(answer, "idx", where, int)
                at = f"{where} (question {qid}, answer {aid})"
                row = {
                    "paragraph": paragraph,
                    "question": _get(question, "question", at),
                    "answer": _get(answer, "text", at),
                }
                out.append(
                    _flat_example(
                        task,
                        row,
                        at,
                        _label(answer, task, split, allowed, at),
                        f"p{pid}-q{qid}-a{aid}",
                        group=f"p{pid}-q{qid}",
                        doc=f"p{pid}",
                    )
                )
        return out
    if task == "record":
        passage = _get(record, "passage", where, dict)
        text = _get(passage, "text", where)
        # Entity spans are inclusive of `end` in the official release.
        entities = [
            text[_get(e, "start", where, int) : _get(e, "end", where, int) + 1]
            for e in _get(passage, "entities", where, list)
        ]
        out = []
        for qa in _get(record, "qas", where, list):
            qid = _get(qa, "idx", where, int)
            at = f"{where} (query {qid})"
            # Official test queries come without answers; elsewhere they are required.
            golds = qa.get("answers", []) if split == "test" else _get(qa, "answers", at, list)
            row = {
                "passage": text,
                "query": _get(qa, "query", at),
                "entities": entities,
                "answers": [_get(a, "text", at) for a in golds],
            }
            out.append(_record_example(row, split, at, _get(record, "idx", where, int), qid))
        return out
    label = _label(record, task, split, allowed, where)
    if task == "wsc":  # the official file nests the spans under "target"
        record = {**record, **_get(record, "target", where, dict)}
    return [_flat_example(task, record, where, label, _get(record, "idx", where, int))]


def parse_record(task: str, record: dict[str, Any], where: str = "record") -> list[Example]:
    """Examples from one record in the official jsonl format (a line of <Task>/<split>.jsonl); the label is
    optional, as in a test file. `where` names the record in error messages (e.g. "file.jsonl:3")."""
    return _local_examples(_check_task(task), record, "test", where)


def _load_local(task: str, split: str, root: Path) -> list[Example]:
    path = root / TASKS[task].folder / f"{split}.jsonl"
    if not path.is_file():
        raise DataNotFoundError(
            f"{path} not found: data folder {root} has no SuperGLUE {TASKS[task].folder} {split} split "
            "(expected the official layout <dir>/<Task>/<split>.jsonl)"
        )
    examples: list[Example] = []
    for where, _, record in read_jsonl(path):
        new = _local_examples(task, record, split, where)
        if not new:  # e.g. a MultiRC paragraph without questions: say so rather than yield nothing
            raise DataFormatError(f"{where}: record holds no examples")
        examples.extend(new)
    return examples


def read_jsonl(path: Path) -> Iterator[tuple[str, int, Any]]:
    """("file:line", line number, record) per non-empty line; malformed JSON or text that is not UTF-8 raises
    DataFormatError saying where."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            line = decode_utf8(raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw, str(path), lineno)
            if not line.strip():
                continue
            try:
                yield where, lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{where}: malformed JSON ({exc.msg})") from exc


def decode_utf8(data: bytes, name: str, first_line: int = 1) -> str:
    """`data` (the text of file `name`, from line `first_line`) as UTF-8; else DataFormatError naming the file and
    the line, and saying UTF-16 where the bytes are (a byte-order mark, or NUL bytes: UTF-16 of ASCII text).

    Example:
        >>> try:
        ...     decode_utf8(b"ok\\n\\xff", "data.jsonl")
        ... except ValueError as err:
        ...     print(err)
        data.jsonl, line 2: not UTF-8 text (byte 0xff); save the file as UTF-8
    """
    utf16 = data.startswith((b"\xff\xfe", b"\xfe\xff")) and first_line == 1
    nul = data.find(b"\x00")
    if utf16 or nul >= 0:
        line = first_line + data[: max(nul, 0)].count(b"\n")
        raise DataFormatError(f"{name}, line {line}: UTF-16 or binary data, not UTF-8 text; save the file as UTF-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + data[: err.start].count(b"\n")
        raise DataFormatError(
            f"{name}, line {line}: not UTF-8 text (byte 0x{data[err.start]:02x}); save the file as UTF-8"
        ) from None


def _hub_example(task: str, row: dict[str, Any], split: str, where: str) -> Example:
    """Example from one aps/super_glue row (already flat; labels are class ids, -1 where unlabelled)."""
    if task == "record":
        ids = _get(row, "idx", where, dict)
        pid, qid = _get(ids, "passage", where, int), _get(ids, "query", where, int)
        return _record_example(row, split, where, pid, qid)
    raw = _get(row, "label", where, int)
    label = None if raw == -1 else _label(row, task, split, tuple(range(len(TASKS[task].labels))), where)
    if task == "multirc":
        ids = _get(row, "idx", where, dict)
        pid, qid, aid = (_get(ids, key, where, int) for key in ("paragraph", "question", "answer"))
        return _flat_example(task, row, where, label, f"p{pid}-q{qid}-a{aid}", f"p{pid}-q{qid}", f"p{pid}")
    return _flat_example(task, row, where, label, _get(row, "idx", where, int))


def _load_hub(task: str, split: str) -> list[Example]:
    config = TASKS[task].hub_config
    try:
        import datasets

        rows = datasets.load_dataset(HUB_DATASET, config, split=_HUB_SPLITS[split])
    except Exception as exc:  # offline, missing package, Hub error: all mean "no data here", told one way
        raise DataNotFoundError(
            f"SuperGLUE {task} {split} not available: no data folder is set and the Hub dataset "
            f"{HUB_DATASET} ({config}) could not be loaded ({type(exc).__name__}: {exc}). Either pass "
            "--data-dir / set CAPT_DATA_DIR to a folder with <Task>/<split>.jsonl (official SuperGLUE "
            f"layout), or go online so datasets can download {HUB_DATASET}."
        ) from exc
    where = f"{HUB_DATASET}/{config} {split}"
    return [_hub_example(task, row, split, f"{where} row {i}") for i, row in enumerate(rows)]
