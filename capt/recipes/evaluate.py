"""Scoring a model on a split, and the tokenisation cache both training and scoring read.

load_splits(config) -> encode_cached(fmt, examples, config) -> evaluate(model, fmt, features, examples, ...),
which is score_predictions(task, predict(model, fmt, features, ...), examples), or for a generate task
ChatFormat.evaluate (loss, perplexity and greedy answers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import nn

from ..saving import atomic_write
from . import format_base, formats
from .chat import ChatFormat
from .data import Example
from .format_base import to_device
from .formats import NO_OPTION, TaskFormat
from .metrics import task_metrics
from .run import RunConfig
from .tasks import TaskSpec, builtin_tasks, get_task, preprocess, register_task, render, task_splits

FEATURES_VERSION = 2  # bump when TaskFormat.encode changes, so cached tokenisations are rebuilt


def load_splits(config: RunConfig) -> dict[str, list[Example]]:
    """The train/validation/test splits of config.task, cut to limit_train / limit_eval if set."""
    return load_task(config)[1]


def load_task(config: RunConfig) -> tuple[TaskSpec, dict[str, list[Example]], str]:
    """(the task's spec, its splits cut to limit_train / limit_eval, the split its final scores come from).

    Built-ins follow the paper (90/10 of official train, official validation as test); a user task without a
    validation file carves 10% of train by label with `split_seed`, and without a test file is scored on
    validation (the scored split is then "validation"). A user task's spec, its labels now read from the data, is
    registered under its name, so the formats and metrics see them."""
    spec, splits, scored = task_splits(get_task(config.task), seed=config.split_seed, data_dir=config.data_dir)
    if spec.name not in builtin_tasks():
        register_task(spec)
    limits = {"train": config.limit_train, "validation": config.limit_eval, "test": config.limit_eval}
    cut = {name: first_examples(examples, limits[name]) for name, examples in splits.items()}
    _warn_of_untrained_classes(spec, cut)
    return spec, cut, scored


def first_examples(examples: list[Example], limit: int | None) -> list[Example]:
    """The first `limit` examples (all for None). Where examples share a passage (`doc`: MultiRC, ReCoRD), the whole
    passages among them, and at least the first: a passage cut in two would cut questions in two, and MultiRC's exact
    match is per question. A split keeps each passage's examples together, in file order.

    Example:
        >>> rows = [Example("multirc", i, {}, 0, doc=f"p{i // 3}") for i in range(9)]  # three passages of three
        >>> len(first_examples(rows, 7)), len(first_examples(rows, 2))
        (6, 3)
    """
    if not limit or len(examples) <= limit:
        return examples
    cut_passage = examples[limit].doc
    if cut_passage is None or examples[limit - 1].doc != cut_passage:
        return examples[:limit]
    start = next(i for i in range(limit) if examples[i].doc == cut_passage)
    if start > 0:
        return examples[:start]
    end = next((i for i in range(limit, len(examples)) if examples[i].doc != cut_passage), len(examples))
    return examples[:end]


def _warn_of_untrained_classes(spec: TaskSpec, splits: dict[str, list[Example]]) -> None:
    """Warn, naming it, of a class that validation or test holds and training does not: it is never learnt, and
    its examples are scored wrong whatever the method (a choice task's labels index each example's own options)."""
    if spec.kind != "classify":
        return
    trained = {ex.label for ex in splits["train"]}
    for split in ("validation", "test"):
        untrained = sorted({ex.label for ex in splits[split] if ex.label is not None} - trained)
        for label in untrained:
            warnings.warn(
                f"{spec.name}: the {split} split holds class {spec.labels[label]!r}, which no training example "
                "has (check the data, or --limit-train): it is never learnt",
                stacklevel=3,
            )


@cache
def _template_code() -> str:
    """A hash of the code that turns examples into tokens: any edit to it invalidates the cache."""
    code = "".join(inspect.getsource(module) for module in (render, preprocess, format_base, formats))
    return hashlib.sha256(code.encode()).hexdigest()


def encode_cached(fmt: TaskFormat, examples: list[Example], config: RunConfig) -> list[dict]:
    """Tokenise once per (examples' content, template code, tokenizer, family, max length); later runs read the
    cache. A cache file that cannot be read (torn by a crash) is rebuilt."""
    key = json.dumps(
        [
            FEATURES_VERSION,
            _template_code(),
            type(fmt).__name__,
            fmt.task,
            fmt.max_length,
            getattr(fmt, "generate", None),
            fmt.cache_settings(),
            getattr(fmt, "prompt_bos", None),
            fmt.tokenizer.name_or_path,
            len(fmt.tokenizer),
            [dataclasses.asdict(ex) for ex in examples],  # every field and label, not only the ids
        ],
        default=str,
    )
    path = Path(config.cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except Exception as err:  # torn or foreign: tokenising again is cheap and always right
            warnings.warn(f"rebuilding the unreadable feature cache {path} ({err})", stacklevel=2)
    features = [fmt.encode(ex) for ex in examples]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(features, tmp))
    return features


@torch.no_grad()
def predict(
    model: nn.Module, fmt: TaskFormat, features: list[dict], batch_size: int, device: torch.device | str = "cpu"
) -> list[int]:
    """The format's prediction for every feature, in input order (batched in length order, for less padding)."""
    model.eval()
    order = sorted(range(len(features)), key=lambda i: fmt.length(features[i]))
    predictions: dict[int, int] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = to_device(fmt.collate([features[i] for i in chunk]), device)
        predictions.update(zip(chunk, fmt.predict(model, batch), strict=True))
    return [predictions[i] for i in range(len(features))]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    fmt: TaskFormat,
    features: list[dict],
    examples: list[Example],
    batch_size: int,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Predict every example and compute the task's metrics; a generate task (`ChatFormat`) scores its answers'
    loss, perplexity, exact match and token F1 (`ChatFormat.evaluate`)."""
    if isinstance(fmt, ChatFormat):
        return fmt.evaluate(model, features, batch_size, device)
    return score_predictions(fmt.task, predict(model, fmt, features, batch_size, device), examples)


def score_predictions(task: str, predictions: list[int], examples: list[Example]) -> dict[str, float]:
    """The task's metrics for one prediction per example: a label id, or for ReCoRD an index into the example's
    entities; NO_OPTION (a generated answer that is none of the options) counts as wrong."""
    if get_task(task).metrics[0] == "record":
        entities = [ex.candidates[p] if p != NO_OPTION else "" for ex, p in zip(examples, predictions, strict=True)]
        return task_metrics(task, entities, [list(ex.answers) for ex in examples])
    return task_metrics(task, predictions, [ex.label for ex in examples], groups=[ex.group for ex in examples])
