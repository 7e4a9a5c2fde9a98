"""`capt analyze attention`: attention maps and anchor numbers of trained adapters and their base model.

    subjects (CaPT / Deep Prompt-Tuning runs, the base model with the adapter disabled, or a bare model)
    -> sampled examples -> attention per stream with the slots kept (capture.py), averaged over heads
    -> anchor numbers per layer (anchors.py), averaged over examples -> `AttentionStudy`

Token-level maps differ in length and content between examples, so the maps kept for plotting are those of
one example (`show`); the numbers and the role matrices are averaged over all sampled examples.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from ...model import CaptModel
from ..backbones import load_backbone
from ..data import Example
from ..formats import T5Format, TaskFormat, head_outputs, make_format
from ..run import RunConfig, load_run
from .anchors import METRICS, anchor_metrics, role_matrix, structural_share
from .capture import capture_attention, use_eager_attention
from .tokens import roles, slot_names, special_positions, structural_positions

# Which sequence axes a stream's queries and keys run along: the source (input_ids) or the T5 target.
_AXES = {"encoder": ("source", "source"), "decoder": ("source", "source"), "cross": ("target", "source")}
_T5_AXES = {**_AXES, "decoder": ("target", "target")}


@dataclass
class Subject:
    """One model to analyse. `adapter_disabled` runs a `CaptModel` as its base model (the no-slot reference)."""

    name: str
    model: nn.Module
    fmt: TaskFormat
    slot_names: list[str]
    adapter_disabled: bool = False
    run: RunConfig | None = None  # the training run it comes from, for the report
    run_dir: str | None = None


@dataclass
class StreamMap:
    """One example's attention in one stream, averaged over heads: (layers, queries, keys), slots included."""

    attention: torch.Tensor
    query_tokens: list[str]
    key_tokens: list[str]
    query_roles: list[str]
    key_roles: list[str]
    cross: bool  # queries are T5 decoder tokens, keys the encoder memory


@dataclass
class StreamSummary:
    """A stream's numbers averaged over examples: per layer, over layers, and the group-to-group matrix."""

    per_layer: dict[str, list[float | None]]  # None where a number is undefined (no anchor rows in cross-attention)
    mean: dict[str, float | None]
    role_matrix: list[list[float | None]]  # GROUPS x GROUPS, averaged over layers and examples
    structural_share: float  # structural tokens among the keys besides the anchor, mean over examples


@dataclass
class AttentionStudy:
    task: str
    max_length: int
    example_ids: list[str]
    truncated: int  # sampled examples that reached max_length tokens and were cut
    subjects: list[Subject]
    summaries: dict[str, dict[str, StreamSummary]] = field(default_factory=dict)  # subject -> stream -> numbers
    shown: dict[str, dict[str, StreamMap]] = field(default_factory=dict)  # subject -> stream -> example map


def subjects_from_runs(run_dirs: list[str], task: str | None = None, max_length: int | None = None) -> list[Subject]:
    """One subject per CaPT / Deep Prompt-Tuning run, then the first run's base model (adapter disabled).

    `task` (default: the runs' own) and `max_length` (default: the runs') change what the models read.

    Example:
        >>> subjects = subjects_from_runs(["runs/rte-capt", "runs/rte-deep"])  # doctest: +SKIP
        >>> [s.name for s in subjects]  # doctest: +SKIP
        ['capt', 'deep-prompt', 'base']
    """
    subjects = []
    for run_dir in run_dirs:
        config, model, fmt = load_run(run_dir)
        if not isinstance(model, CaptModel):
            raise ValueError(f"{run_dir}: method {config.method!r}; attention analysis reads capt and deep-prompt runs")
        first = subjects[0].run if subjects else config
        if (config.model, config.task) != (first.model, first.task):
            raise ValueError(f"{run_dir}: all runs must share one model and task; got {config.model}/{config.task}")
        fmt = replace(fmt, task=task or fmt.task, max_length=max_length or fmt.max_length)
        taken = [s.name for s in subjects]
        name = config.method if config.method not in taken else f"{config.method} ({Path(run_dir).name})"
        subjects.append(Subject(name, model, fmt, slot_names(model.capt_config), run=config, run_dir=run_dir))
    first = subjects[0]
    subjects.append(Subject("base", first.model, first.fmt, [], adapter_disabled=True, run=first.run))
    for subject in subjects:
        use_eager_attention(subject.model)
    return subjects


def bare_subject(model_name: str, task: str, max_length: int) -> Subject:
    """A model with no adapter, loaded by backbone name (`minilm`, `tiny-t5`, a local folder, ...).

    Example:
        >>> bare_subject("tiny-llama", "rte", 64).slot_names
        []
    """
    backbone = load_backbone(model_name, num_labels=head_outputs(task))
    use_eager_attention(backbone.model)
    fmt = make_format(backbone.family, task, backbone.tokenizer, max_length)
    run = RunConfig(task=task, model=model_name, max_length=max_length)
    return Subject("base", backbone.model, fmt, [], run=run)


def sample_examples(examples: list[Example], count: int, seed: int) -> list[Example]:
    """`count` examples drawn without replacement with `seed`, in split order (all if there are fewer).

    Example:
        >>> pool = [Example("rte", i, {}, 0) for i in range(10)]
        >>> [ex.idx for ex in sample_examples(pool, 3, seed=0)]
        [0, 6, 9]
    """
    picked = random.Random(seed).sample(range(len(examples)), min(count, len(examples)))
    return [examples[i] for i in sorted(picked)]


def example_maps(subject: Subject, example: Example) -> dict[str, StreamMap]:
    """The head-averaged attention of every stream of `subject` on `example` (its gold option for choice
    tasks and label-word formats), with each position's token and role.

    Example:
        >>> subject = bare_subject("tiny-t5", "rte", 64)
        >>> ex = Example("rte", 0, {"premise": "A cat sat.", "hypothesis": "A cat."}, 0)
        >>> sorted(example_maps(subject, ex))
        ['cross', 'decoder', 'encoder']
    """
    fmt = subject.fmt
    features = fmt.encode(example)
    row = example.label if len(features["rows"]) > 1 and example.label is not None else 0
    batch = fmt.collate([{**features, "rows": [features["rows"][row]], "label": 0}])
    inputs = batch["model_inputs"] if "model_inputs" in batch else batch["train_inputs"]
    ids = {"source": inputs["input_ids"][0].tolist()}
    structural = {"source": structural_positions(fmt, example, row)}
    if isinstance(fmt, T5Format):
        # Passed explicitly (as T5 would derive them) so the decoder tokens are known.
        inputs["decoder_input_ids"] = subject.model.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
        ids["target"] = inputs["decoder_input_ids"][0].tolist()
        structural["target"] = special_positions(fmt.tokenizer, ids["target"])
    with subject.model.disable_adapter() if subject.adapter_disabled else nullcontext():
        captured = capture_attention(subject.model, inputs)

    axes = _T5_AXES if isinstance(fmt, T5Format) else _AXES
    lengths = {axes[stream][1]: weights.shape[-1] for stream, weights in captured.items()}
    tokens, axis_roles = {}, {}
    for axis, length in lengths.items():
        slots = length - len(ids[axis])
        if slots not in (0, len(subject.slot_names)):
            raise RuntimeError(f"{subject.name}: {slots} slot positions, expected {len(subject.slot_names)}")
        tokens[axis] = subject.slot_names[:slots] + fmt.tokenizer.convert_ids_to_tokens(ids[axis])
        axis_roles[axis] = roles(len(ids[axis]), slots, structural[axis])
    maps = {}
    for stream, weights in captured.items():
        query_axis, key_axis = axes[stream]
        maps[stream] = StreamMap(
            weights[:, 0].mean(1).float(),
            tokens[query_axis],
            tokens[key_axis],
            axis_roles[query_axis],
            axis_roles[key_axis],
            cross=stream == "cross",
        )
    return maps


def analyze_attention(subjects: list[Subject], examples: list[Example], show: int = 0) -> AttentionStudy:
    """Run every subject on every example; average the anchor numbers over examples; keep example `show`'s maps.

    Example:
        >>> subject = bare_subject("tiny-llama", "rte", 64)
        >>> ex = Example("rte", 0, {"premise": "A cat sat.", "hypothesis": "A cat."}, 0)
        >>> study = analyze_attention([subject], [ex])
        >>> len(study.summaries["base"]["decoder"].per_layer["to_anchor"])  # one number per layer
        2
    """
    fmt = subjects[0].fmt
    study = AttentionStudy(
        task=fmt.task,
        max_length=fmt.max_length,
        example_ids=[str(ex.idx) for ex in examples],
        truncated=sum(fmt.length(fmt.encode(ex)) >= fmt.max_length for ex in examples),
        subjects=subjects,
    )
    for subject in subjects:
        metrics: dict[str, list[dict[str, torch.Tensor]]] = {}
        matrices: dict[str, list[torch.Tensor]] = {}
        shares: dict[str, list[float]] = {}
        for position, example in enumerate(examples):
            maps = example_maps(subject, example)
            if position == show:
                study.shown[subject.name] = maps
            for stream, m in maps.items():
                query_roles = m.query_roles if m.cross else None
                metrics.setdefault(stream, []).append(anchor_metrics(m.attention, m.key_roles, query_roles))
                matrices.setdefault(stream, []).append(role_matrix(m.attention, m.key_roles, query_roles))
                shares.setdefault(stream, []).append(structural_share(m.key_roles))
        study.summaries[subject.name] = {
            stream: _summarize(metrics[stream], torch.stack(matrices[stream]), shares[stream]) for stream in metrics
        }
    return study


def _summarize(
    per_example: list[dict[str, torch.Tensor]], matrices: torch.Tensor, shares: list[float]
) -> StreamSummary:
    per_layer = {name: torch.stack([m[name] for m in per_example]).nanmean(0) for name in METRICS}
    return StreamSummary(
        per_layer={name: _floats(values) for name, values in per_layer.items()},
        mean={name: _floats(values.nanmean())[0] for name, values in per_layer.items()},
        role_matrix=[_floats(row) for row in matrices.nanmean((0, 1))],
        structural_share=round(sum(shares) / len(shares), 4),
    )


def _floats(values: torch.Tensor) -> list[float | None]:
    """Plain floats rounded for the report; NaN (undefined) becomes None (null in JSON, n/a in tables)."""
    return [round(v, 4) if v == v else None for v in values.reshape(-1).tolist()]
