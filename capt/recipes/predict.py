"""`capt predict`: a trained run's answers for new inputs.

- `--run R --input new.jsonl`: one run (any method, any task), inputs in the task's own fields (a SuperGLUE task's
  official records, a user task's columns), in any file type the task layer reads.
- `--adapters a=R1,b=R2 --input mixed.jsonl`: one frozen backbone serving several CaPT runs as one capsule bank;
  every input line carries a "task" field naming the adapter that answers it.
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
from .chat import ChatFormat
from .data import DataFormatError, Example
from .data.superglue import read_jsonl
from .evaluate import encode_cached, predict
from .formats import NO_OPTION, EncoderFormat, TaskFormat, head_outputs, make_format
from .run import ADAPTER_DIR, load_run, missing_weights, read_run_config
from .settings import CAPT_METHODS
from .tasks import get_task, parse_task_record, read_rows


def read_mixed_input(path: Path, tasks: set[str]) -> list[tuple[int, str, list[Example]]]:
    """(line number, task, examples) per non-empty line; a bad line names the file and line."""
    rows = []
    for where, number, record in read_jsonl(path):
        task = record.pop("task", None) if isinstance(record, dict) else None
        if task not in tasks:
            raise DataFormatError(f"{where}: field 'task' is {task!r}; this bank serves {sorted(tasks)}")
        rows.append((number, task, parse_task_record(get_task(task), record, where)))
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
        kinds.setdefault(isinstance(fmt, EncoderFormat) and fmt.spec.is_choice, []).append(i)
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
                names = option_names(item_fmt.spec, example)
                scores = dict(zip(names, row, strict=False))
                results[i] = Scored(example.idx, max(scores, key=scores.get), scores)
    return results


def option_names(spec, example: Example) -> list[str]:
    """What a prediction's index names: the label, or a choice example's option (its text where options vary)."""
    if spec.options_field:
        return list(example.candidates)
    if spec.is_choice and not spec.labels:
        return [str(example.fields[name]) for name in spec.option_fields]
    return [str(label) for label in spec.labels]


def predict_run(run_dir: Path, input_path: Path, output_path: Path) -> int:
    """Write the run's prediction for every input row (in input order) to `output_path` (jsonl); returns the count.

    Rows hold the task's own fields (a label, if present, is checked but not used). Each output line names the
    input line, the predicted label (or option) and, for a choice task, its index; for a generate task, the greedy
    answer (rows: `messages`, or a `prompt`). The input is never touched."""
    refuse_output_over_input(input_path, output_path)
    config, model, fmt = load_run(run_dir)
    spec = get_task(config.task)
    if isinstance(fmt, ChatFormat):
        return _write_answers(fmt, model, config.eval_batch_size, input_path, output_path)
    examples = []
    for where, row in read_rows(input_path):
        examples.extend((where, ex) for ex in parse_task_record(spec, row, where))
    if not examples:
        raise DataFormatError(f"{input_path}: no rows to predict")
    features = encode_cached(fmt, [ex for _, ex in examples], config)
    chosen = predict(model, fmt, features, config.eval_batch_size)
    lines = []
    for (where, ex), index in zip(examples, chosen, strict=True):
        names = option_names(spec, ex)
        record = {"row": _row_name(where), "task": spec.name}
        record["prediction"] = names[index] if index != NO_OPTION else None
        if spec.is_choice:
            record["index"] = index
        lines.append(json.dumps(record) + "\n")
    atomic_write(output_path, lambda tmp: Path(tmp).write_text("".join(lines)))
    return len(lines)


def _write_answers(
    fmt: ChatFormat, model: torch.nn.Module, batch_size: int, input_path: Path, output_path: Path
) -> int:
    """A generate run's greedy answer to every row (`messages`, or a `prompt`), in input order; returns the count."""
    rows = read_rows(input_path)
    if not rows:
        raise DataFormatError(f"{input_path}: no rows to predict")
    features = [fmt.encode_request(row, where) for where, row in rows]
    answers = predict(model, fmt, features, batch_size)
    lines = [
        json.dumps({"row": _row_name(where), "task": fmt.task, "prediction": answer}) + "\n"
        for (where, _), answer in zip(rows, answers, strict=True)
    ]
    atomic_write(output_path, lambda tmp: Path(tmp).write_text("".join(lines)))
    return len(lines)


def _row_name(where: str) -> str:
    """What a prediction names its input row by: the line number of "file:line", else the whole place."""
    return where.rsplit(":", 1)[-1] if ":" in where else where


def refuse_output_over_input(input_path: Path, output_path: Path) -> None:
    """Refuse, before anything is read, an output that is the input: the same path, a link to it, or the same file
    under another name (the input is never touched)."""
    if output_path.resolve() == input_path.resolve() or (
        output_path.exists() and input_path.exists() and output_path.samefile(input_path)
    ):
        raise ValueError(f"--output {output_path} is the --input file {input_path}; write the predictions elsewhere")


def predict_file(runs: dict[str, Path], input_path: Path, output_path: Path, batch_size: int = 32) -> int:
    """Write one prediction per example of `input_path` (in input order) to `output_path`; returns the count.
    An output that is the input (the same path, a link to it, or the same file under another name) is refused
    before anything is read: the input is never touched."""
    refuse_output_over_input(input_path, output_path)
    configs = {task: read_run_config(run) for task, run in runs.items()}
    for task, config in configs.items():
        if config.task != task or config.method not in CAPT_METHODS:
            raise ValueError(f"{runs[task]} is a {config.method} run on {config.task}, not a CaPT run on {task}")
    for task, config in configs.items():
        if get_task(config.task).kind == "generate":
            raise ValueError(
                f"--adapters: {runs[task]} is a generate run: a bank scores labels; answer its rows with "
                f"`capt predict --run {runs[task]}`"
            )
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
        task: make_format(backbone.family, task, backbone.tokenizer, config.max_length, prompt_bos=config.prompt_bos)
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
