"""One folder per analysis run: the PNGs, the numbers as JSON, and a `report.md` that shows both.

`write_attention_report` and `write_instance_token_report` are what `capt analyze attention` and
`capt analyze instance-token` run; their options dataclasses mirror the command-line flags.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ...model import CaptModel
from ..evaluate import encode_cached, evaluate, load_splits
from ..run import RESULTS_NAME, RunConfig, load_run
from .anchors import GROUPS, METRICS
from .attention import (
    AttentionStudy,
    Subject,
    analyze_attention,
    bare_subject,
    sample_examples,
    subjects_from_runs,
)
from .instance_token import instance_token_scores
from .plots import plot_by_layer, plot_instance_tokens, plot_layer_maps, plot_role_matrices, plot_token_map

REPORT_NAME = "report.md"
STREAM_TITLES = {
    "encoder": "encoder self-attention",
    "decoder": "decoder self-attention (causal)",
    "cross": "decoder cross-attention (decoder tokens -> encoder tokens)",
}
BY_LAYER_METRICS = {
    "to_anchor": "(a) others -> anchor",
    "anchor_to_structural": "(b) anchor -> structural",
    "anchor_to_anchor": "(c) anchor -> anchor",
}


MAX_INSTANCE_TOKENS = 64  # each one is a token per layer in front of the prompts: more is no longer an analysis


@dataclass
class AttentionOptions:
    """`capt analyze attention`: runs to analyse (their base model comes along), or a bare `model`."""

    output_dir: str
    runs: list[str] = field(default_factory=list)
    model: str | None = None
    task: str | None = None
    examples: int = 32
    seed: int = 0
    split: str = "test"
    max_length: int | None = None
    max_tokens: int = 48
    data_dir: str | None = None

    def __post_init__(self) -> None:
        for name, low in (("examples", 1), ("max_tokens", 1), ("seed", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if self.max_length is not None and self.max_length < 8:
            raise ValueError(f"--max-length must be >= 8, got {self.max_length}")

    def command(self) -> str:
        return _command("capt analyze attention", self, repeated={"runs": "--run"})


@dataclass
class InstanceTokenOptions:
    """`capt analyze instance-token`: a trained run and the numbers k of instance tokens to try."""

    run: str
    output_dir: str
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 4])
    split: str = "test"
    data_dir: str | None = None

    def __post_init__(self) -> None:
        bad = [k for k in self.ks if not 0 <= k <= MAX_INSTANCE_TOKENS]
        if bad or not self.ks:
            raise ValueError(f"--ks takes numbers of instance tokens from 0 to {MAX_INSTANCE_TOKENS}, got {self.ks}")

    def command(self) -> str:
        return _command("capt analyze instance-token", self, joined={"ks"})


def write_attention_report(options: AttentionOptions) -> Path:
    """Analyse, then write attention.json, the PNGs and report.md into options.output_dir; returns report.md.

    Example:
        >>> write_attention_report(AttentionOptions("reports/rte", runs=["runs/rte-capt"]))  # doctest: +SKIP
        PosixPath('reports/rte/report.md')
    """
    if options.runs:
        subjects = subjects_from_runs(options.runs, options.task, options.max_length)
    elif options.model and options.task:
        subjects = [bare_subject(options.model, options.task, options.max_length or RunConfig.max_length)]
    else:
        raise ValueError("give --run (one or more trained runs) or --model with --task")
    run = subjects[0].run
    data = replace(run, task=subjects[0].fmt.task, data_dir=options.data_dir or run.data_dir, limit_eval=None)
    examples = sample_examples(load_splits(data)[options.split], options.examples, options.seed)
    study = analyze_attention(subjects, examples)

    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = _attention_figures(study, out, options.max_tokens)
    numbers = {
        "command": options.command(),
        "task": study.task,
        "split": options.split,
        "seed": options.seed,
        "max_length": study.max_length,
        "truncated_examples": study.truncated,
        "example_ids": study.example_ids,
        "shown_example": study.example_ids[0],
        "metrics": METRICS,
        "groups": GROUPS,
        "subjects": {
            s.name: {**_subject_facts(s), "streams": {k: asdict(v) for k, v in study.summaries[s.name].items()}}
            for s in study.subjects
        },
    }
    (out / "attention.json").write_text(json.dumps(numbers, indent=2) + "\n")
    report = out / REPORT_NAME
    report.write_text(_attention_markdown(study, options, figures))
    return report


def write_instance_token_report(options: InstanceTokenOptions) -> Path:
    """Score the run with k = each of options.ks instance tokens; write instance_tokens.json, the bar chart
    and report.md into options.output_dir; returns report.md."""
    config, model, fmt = load_run(options.run)
    if not isinstance(model, CaptModel):
        raise ValueError(f"{options.run}: method {config.method!r}; instance tokens need a deep-prompt (or capt) run")
    config = replace(config, data_dir=options.data_dir or config.data_dir)
    examples = load_splits(config)[options.split]
    features = encode_cached(fmt, examples, config)
    plain = evaluate(model, fmt, features, examples, config.eval_batch_size)
    scores = instance_token_scores(model, fmt, features, examples, options.ks, config.eval_batch_size)

    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{config.task} / {config.method} on {config.model}: {options.split} score"
    chart = plot_instance_tokens(out / "instance_tokens.png", {k: s["score"] for k, s in scores.items()}, title)
    subject = Subject(config.method, model, fmt, [], run=config, run_dir=options.run)
    numbers = {
        "command": options.command(),
        "split": options.split,
        "examples": len(examples),
        "run": _subject_facts(subject),
        "plain_evaluation": plain,
        "scores": {str(k): s for k, s in scores.items()},
    }
    (out / "instance_tokens.json").write_text(json.dumps(numbers, indent=2) + "\n")
    report = out / REPORT_NAME
    report.write_text(_instance_token_markdown(options, config, subject, plain, scores, chart.name, len(examples)))
    return report


# ---------------------------------------------------------------------- attention report parts


def _attention_figures(study: AttentionStudy, out: Path, max_tokens: int) -> dict[str, dict[str, list[str]]]:
    """Draw every figure; returns stream -> {"summary": [...], subject name: [...]} file names."""
    figures: dict[str, dict[str, list[str]]] = {}
    shown = study.example_ids[0]
    for stream in next(iter(study.summaries.values())):
        summaries = {name: streams[stream] for name, streams in study.summaries.items()}
        title = f"{study.task}: {STREAM_TITLES[stream]}, {len(study.example_ids)} examples"
        by_layer = plot_by_layer(out / f"{stream}-by-layer.png", summaries, BY_LAYER_METRICS, title)
        roles = plot_role_matrices(out / f"{stream}-roles.png", summaries, title + ", all layers")
        figures[stream] = {"summary": [by_layer.name, roles.name]}
        for name, maps in study.shown.items():
            slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
            label = f"{name}, {STREAM_TITLES[stream]}, example {shown}"
            average = plot_token_map(out / f"{stream}-{slug}.png", maps[stream], label + ", mean of layers", max_tokens)
            layers = plot_layer_maps(out / f"{stream}-{slug}-layers.png", maps[stream], label, max_tokens)
            figures[stream][name] = [average.name, layers.name]
    return figures


def _attention_markdown(study: AttentionStudy, options: AttentionOptions, figures: dict) -> str:
    lines = [
        f"# Attention analysis: {study.task}, {', '.join(s.name for s in study.subjects)}",
        "",
        f"Made with `{options.command()}`.",
        "",
        f"- {len(study.example_ids)} examples of the {options.split} split, sampled with seed {options.seed} "
        f"(ids {', '.join(study.example_ids)}). Attention is averaged over heads, then over examples; "
        '"mean" is the mean over layers.',
        f"- Inputs are cut at {study.max_length} tokens: {study.truncated} of {len(study.example_ids)} examples "
        "reached that length and were truncated.",
        f"- Token-level maps show example {study.example_ids[0]} (tokens differ between examples); at most "
        f"{options.max_tokens} tokens are drawn, a title says when a map is cut. Colour scale: square root.",
        "- Tick labels: slots in red, structural tokens (special tokens and template words) in blue, input in black.",
        "- The *anchor* is the slot(s) of an adapter; for the base model it is the first token, which the slot "
        "displaces from position 0. Anchor, structural and input groups are disjoint: for the base model, "
        '"structural" means the structural tokens other than the first one.',
        "",
        "## Models",
        "",
        "| name | slots | trained with | test score | trainable params |",
        "|---|---|---|---|---|",
    ]
    for subject in study.subjects:
        facts = _subject_facts(subject)
        score = facts.get("test_score")
        lines.append(
            f"| {subject.name} | {' '.join(subject.slot_names) or 'none'} | "
            f"{_provenance(subject, facts)} | "
            f"{'n/a' if score is None else f'{100 * score:.2f}'} | {facts.get('trainable_params', 'n/a')} |"
        )
    lines += ["", "## Metrics", ""]
    lines += [f"- `{name}`: {text}" for name, text in METRICS.items()]
    lines.append(
        "- structural share: structural tokens among the tokens besides the anchor, i.e. `anchor_to_structural` "
        "under uniform attention"
    )
    for stream, stream_figures in figures.items():
        summaries = {name: streams[stream] for name, streams in study.summaries.items()}
        lines += ["", f"## {STREAM_TITLES[stream]}", ""]
        if stream == "decoder":
            lines += ["Causal attention: the anchor at the front attends only to itself (and earlier slots).", ""]
        lines += _mean_table(summaries) + [""] + _layer_table(summaries) + [""]
        lines += [f"![{name}]({name})" for name in stream_figures["summary"]]
        for name in study.shown:
            lines += ["", f"### {name}", ""] + [f"![{file}]({file})" for file in stream_figures[name]]
    return "\n".join(lines) + "\n"


def _provenance(subject: Subject, facts: dict[str, Any]) -> str:
    if facts.get("train_command"):
        return f"`{facts['train_command']}`" + _train_time(facts)
    if subject.adapter_disabled:
        return "the runs' frozen backbone, adapter disabled"
    return "no adapter"


def _train_time(facts: dict[str, Any]) -> str:
    return f" ({facts['wall_time_s'] / 60:.1f} min)" if "wall_time_s" in facts else ""


def _mean_table(summaries: dict) -> list[str]:
    lines = ["| model | " + " | ".join(METRICS) + " | structural share |", "|---" * (len(METRICS) + 2) + "|"]
    for name, summary in summaries.items():
        cells = " | ".join(_cell(summary.mean[m]) for m in METRICS)
        lines.append(f"| {name} | {cells} | {_cell(summary.structural_share)} |")
    return lines


def _layer_table(summaries: dict) -> list[str]:
    layers = len(next(iter(summaries.values())).per_layer["to_anchor"])
    header = "| model | metric | " + " | ".join(f"layer {i + 1}" for i in range(layers)) + " | mean |"
    lines = [header, "|---" * (layers + 3) + "|"]
    for name, summary in summaries.items():
        for metric, values in summary.per_layer.items():
            if all(v is None for v in values):
                continue
            cells = " | ".join(_cell(v) for v in values)
            lines.append(f"| {name} | {metric} | {cells} | {_cell(summary.mean[metric])} |")
    return lines


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


# ---------------------------------------------------------------------- instance-token report parts


def _instance_token_markdown(
    options: InstanceTokenOptions,
    config: RunConfig,
    subject: Subject,
    plain: dict[str, float],
    scores: dict[int, dict[str, float]],
    chart: str,
    examples: int,
) -> str:
    facts = _subject_facts(subject)
    reproduced = 0 in scores and scores[0] == plain
    metrics = list(plain)
    lines = [
        f"# Training-free instance tokens (Finding II): {config.task}, {config.method} on {config.model}",
        "",
        f"Made with `{options.command()}`.",
        "",
        f"- Model trained with `{facts['train_command']}`{_train_time(facts)}.",
        f"- Scored on all {examples} examples of the {options.split} split. k instance-aware tokens (each the "
        "masked mean of the layer input, no parameters, no training) sit in front of the learned slots.",
        f"- Plain evaluation score: {100 * plain['score']:.2f}."
        + (f" k = 0 reproduces it exactly: {'yes' if reproduced else 'NO'}." if 0 in scores else ""),
        "",
        "| k | " + " | ".join(metrics) + " | change in score |",
        "|---" * (len(metrics) + 2) + "|",
    ]
    reference = scores.get(0, plain)["score"]
    for k, result in scores.items():
        cells = " | ".join(f"{100 * result[m]:.2f}" for m in metrics)
        lines.append(f"| {k} | {cells} | {100 * (result['score'] - reference):+.2f} |")
    lines += ["", f"![instance tokens]({chart})"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- shared


def _subject_facts(subject: Subject) -> dict[str, Any]:
    """Where a subject comes from: its run folder, training command and budget, test score."""
    facts: dict[str, Any] = {"slots": subject.slot_names, "adapter_disabled": subject.adapter_disabled}
    if subject.run_dir is None:
        return facts
    facts.update(run=subject.run_dir, train_command=train_command(subject.run))
    results_file = Path(subject.run_dir) / RESULTS_NAME
    if results_file.is_file():
        results = json.loads(results_file.read_text())
        facts.update(
            test_score=results["score"]["mean"],
            trainable_params=results["trainable_params"],
            epochs_run=results["epochs_run"],
            wall_time_s=results["wall_time_s"],
        )
    return facts


def train_command(config: RunConfig) -> str:
    """The `capt train` command that reproduces `config` (the settings that differ from the defaults).

    Example:
        >>> train_command(RunConfig(task="rte", method="capt", epochs=2, limit_train=400))
        'capt train --task rte --method capt --epochs 2 --limit-train 400'
    """
    defaults = RunConfig(task=config.task, method=config.method)
    flags = ["--task", config.task, "--method", config.method]
    for spec in fields(RunConfig):
        value = getattr(config, spec.name)
        if spec.name in ("task", "method", "cache_dir") or value == getattr(defaults, spec.name):
            continue
        flag = "--" + spec.name.replace("_", "-")
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return "capt train " + " ".join(flags)


def _command(prefix: str, options: Any, repeated: dict[str, str] | None = None, joined: set[str] = frozenset()) -> str:
    """The command line that reproduces `options` (one flag per field that is set)."""
    repeated = repeated or {}
    parts = [prefix]
    for spec in sorted(fields(options), key=lambda spec: spec.name == "output_dir"):  # the folder goes last
        value = getattr(options, spec.name)
        flag = "--" + spec.name.replace("_", "-")
        if spec.name in repeated:
            parts += [f"{repeated[spec.name]} {v}" for v in value]
        elif spec.name in joined:
            parts.append(f"{flag} {','.join(map(str, value))}")
        elif value is not None:
            parts.append(f"{flag} {value}")
    return " ".join(parts)
