"""`capt predict`: one frozen backbone serving several trained tasks, for an input file that mixes them.

Each task's CaPT run (from `capt train`) contributes its adapter to one capsule bank on one copy of the backbone;
every input line is an official SuperGLUE record with a "task" field naming the adapter that answers it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ..bank import load_bank
from ..saving import atomic_write
from .backbones import load_backbone
from .data import TASKS, DataFormatError, Example, parse_record
from .data.superglue import read_jsonl
from .formats import head_outputs, make_format
from .run import ADAPTER_DIR, read_run_config


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


@torch.no_grad()
def predict_file(runs: dict[str, Path], input_path: Path, output_path: Path, batch_size: int = 32) -> int:
    """Write one prediction per example of `input_path` (in input order) to `output_path`; returns the count."""
    configs = {task: read_run_config(run) for task, run in runs.items()}
    for task, config in configs.items():
        if config.task != task or config.method != "capt":
            raise ValueError(f"{runs[task]} is a {config.method} run on {config.task}, not a CaPT run on {task}")
    models = {config.model for config in configs.values()}
    if len(models) > 1:
        raise ValueError(f"the runs use different backbones {sorted(models)}; a bank shares one")
    first = next(iter(configs.values()))
    backbone = load_backbone(first.model, num_labels=head_outputs(first.task))
    bank = load_bank(backbone.model, {task: runs[task] / ADAPTER_DIR for task in runs})
    rows = read_mixed_input(input_path, set(runs))

    predictions: dict[tuple[int, int], str] = {}
    for task, config in configs.items():
        fmt = make_format(backbone.family, task, backbone.tokenizer, config.max_length)
        bank.set_adapter(task)
        bank.eval()
        items = [((n, i), ex) for n, t, examples in rows if t == task for i, ex in enumerate(examples)]
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            batch = fmt.collate([fmt.encode(replace(ex, label=None)) for _, ex in chunk])
            for (key, ex), choice in zip(chunk, fmt.predict(bank, batch), strict=True):
                predictions[key] = ex.candidates[choice] if task == "record" else TASKS[task].labels[choice]

    lines = [
        json.dumps({"line": number, "task": task, "idx": ex.idx, "prediction": predictions[(number, i)]}) + "\n"
        for number, task, examples in rows
        for i, ex in enumerate(examples)
    ]
    atomic_write(output_path, lambda tmp: Path(tmp).write_text("".join(lines)))
    return len(predictions)
