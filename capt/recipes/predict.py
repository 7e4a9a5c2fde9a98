"""`capt predict`: one frozen backbone serving several trained tasks, for an input file that mixes them.

Each task's CaPT run (from `capt train`) contributes its adapter to one capsule bank on one copy of the backbone;
every input line is an official SuperGLUE record with a "task" field naming the adapter that answers it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from ..bank import load_bank
from ..model import CaptModel
from ..saving import atomic_write
from .backbones import load_backbone
from .data import TASKS, DataFormatError, Example, is_choice_task, parse_record
from .data.superglue import read_jsonl
from .formats import EncoderFormat, TaskFormat, head_outputs, make_format
from .run import ADAPTER_DIR, missing_weights, read_run_config


def read_mixed_input(path: Path, tasks: set[str]) -> list[tuple[int, str, list[Example]]]:
    """(line number, task, examples) per non-empty line; a bad line names the file and line."""
    rows = []
    for where, number, record in read_jsonl(path):
        task = record.pop("task", None) if isinstance(record, dict) else None
        if task not in tasks:
            raise DataFormatError(f"{where}: field 'task' is {task!r}; this bank serves {sorted(tasks)}")
        rows.append((number, task, parse_record(task, record, where)))
    if not rows:
        raise DataFormatError(f"{path}: no records")
    return rows


@dataclass(frozen=True)
class Scored:
    """One example's answer: the predicted label (or ReCoRD entity) and every option's score."""

    idx: object
    label: str
    scores: dict[str, float]


@torch.no_grad()
def score_examples(bank: CaptModel, items: list[tuple[str, TaskFormat, Example]], batch_size: int = 32) -> list[Scored]:
    """Score (adapter name, task format, example) items in mixed-task batches: one forward, one adapter per row.

    Options are the task's labels (or a ReCoRD example's entities); scores are what the format compares (summed
    log-likelihoods for T5 and decoder LMs, logits for encoders). Shared by `capt predict` and `capt serve`.

    Example:
        >>> fmt = make_format(backbone.family, "rte", backbone.tokenizer, 256)  # doctest: +SKIP
        >>> score_examples(bank, [("rte", fmt, example)])[0].label  # doctest: +SKIP
        'entailment'
    """
    bank.eval()
    results: list[Scored | None] = [None] * len(items)
    # Encoder heads read choice and label tasks differently, so those two kinds go in separate forwards.
    kinds: dict[bool, list[int]] = {}
    for i, (_, fmt, _) in enumerate(items):
        kinds.setdefault(isinstance(fmt, EncoderFormat) and is_choice_task(fmt.task), []).append(i)
    for order in kinds.values():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            features = [items[i][1].encode(replace(items[i][2], label=None)) for i in chunk]
            fmt = items[chunk[0]][1]
            batch = fmt.collate(features)
            rows = [items[i][0] for i, f in zip(chunk, features, strict=True) for _ in f["rows"]]
            table = fmt.scores(partial(bank, adapter_names=rows), batch)
            for i, row in zip(chunk, table.tolist(), strict=True):
                _, item_fmt, example = items[i]
                names = list(example.candidates) if item_fmt.task == "record" else list(TASKS[item_fmt.task].labels)
                scores = dict(zip(names, row, strict=False))
                results[i] = Scored(example.idx, max(scores, key=scores.get), scores)
    return results


def predict_file(runs: dict[str, Path], input_path: Path, output_path: Path, batch_size: int = 32) -> int:
    """Write one prediction per example of `input_path` (in input order) to `output_path`; returns the count.
    An output that is the input (the same path, a link to it, or the same file under another name) is refused
    before anything is read: the input is never touched."""
    if output_path.resolve() == input_path.resolve() or (
        output_path.exists() and input_path.exists() and output_path.samefile(input_path)
    ):
        raise ValueError(f"--output {output_path} is the --input file {input_path}; write the predictions elsewhere")
    configs = {task: read_run_config(run) for task, run in runs.items()}
    for task, config in configs.items():
        if config.task != task or config.method != "capt":
            raise ValueError(f"{runs[task]} is a {config.method} run on {config.task}, not a CaPT run on {task}")
    models = {config.model for config in configs.values()}
    if len(models) > 1:
        raise ValueError(f"the runs use different backbones {sorted(models)}; a bank shares one")
    for run in runs.values():
        if not (run / ADAPTER_DIR).is_dir():
            raise missing_weights(run / ADAPTER_DIR)
    first = next(iter(configs.values()))
    backbone = load_backbone(first.model, num_labels=head_outputs(first.task))
    bank = load_bank(backbone.model, {task: runs[task] / ADAPTER_DIR for task in runs})
    rows = read_mixed_input(input_path, set(runs))
    formats = {
        task: make_format(backbone.family, task, backbone.tokenizer, config.max_length)
        for task, config in configs.items()
    }
    items = [(task, formats[task], ex) for _, task, examples in rows for ex in examples]
    scored = iter(score_examples(bank, items, batch_size))
    lines = [
        json.dumps({"line": number, "task": task, "idx": ex.idx, "prediction": next(scored).label}) + "\n"
        for number, task, examples in rows
        for ex in examples
    ]
    atomic_write(output_path, lambda tmp: Path(tmp).write_text("".join(lines)))
    return len(lines)
