"""The `capt` command: train, eval, predict, compare and serve, on built-in tasks or your own data.

    capt train --task rte --method capt --epochs 3
    capt train --train-file pairs.csv --text-fields sentence1,sentence2 --label-field label --model tiny-llama
    capt train --task my-task.yaml                     # a task file (docs/your-data.md)
    capt tasks                                         # the built-in tasks
    capt train --config configs/minilm.yaml --task cb --seeds 3
    capt eval --adapter runs/rte-capt --task rte
    capt lm-eval --model capt --model_args adapter=runs/copa-capt --tasks copa --limit 100
    capt compare --tasks cb,copa,rte,wic --methods capt,deep-prompt,prompt,lora --seeds 3
    capt sweep --tasks cb --methods capt,lora --lr-grid "capt=3e-3,1e-2,3e-2;lora=1e-4,5e-4,1e-3" --seeds 3
    capt sweep --config configs/smollm2-study.yaml --seeds 3 --extend-grid 1   # the whole study: the file's plan

Settings come from RunConfig's defaults, then the YAML file given by --config (and its per_method and per_task
sections for each run), then the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import MissingExtraError, MissingPackageError, require_train_extra

if TYPE_CHECKING:
    from .settings import RunConfig


# The configs of configs/ ship inside the package (capt/recipes/configs links to them in a checkout).
SHIPPED_CONFIGS = Path(__file__).parent / "configs"


def main(argv: list[str] | None = None) -> int:
    """Run one `capt` command; returns the exit status. Errors print one line; `--debug` (or CAPT_DEBUG=1) shows
    the traceback instead, for bug reports."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("CAPT_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        require_train_extra()  # before any recipe module is imported: they need the extra
    except MissingExtraError as err:
        print(f"capt: error: {err}", file=sys.stderr)
        return 1
    if argv[:1] == ["bench"]:  # the benchmark harness has its own flags (capt bench --help)
        from .bench import main as bench

        return bench(argv[1:])
    if argv[:1] == ["lm-eval"]:  # lm-evaluation-harness parses its own flags (capt lm-eval --help)
        args = argparse.Namespace(command="lm-eval", handler=_lm_eval, harness_args=argv[1:])
    else:
        parser = _parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # weight-loading reports would drown the progress output
    try:
        return args.handler(args)
    except Exception as err:
        if debug:
            raise
        if isinstance(err, (ValueError, OSError, FloatingPointError, MissingPackageError)):
            print(f"capt {args.command}: error: {err}", file=sys.stderr)
        else:  # a bug, not bad input: one line, and how to get the details
            print(
                f"capt {args.command}: internal error: {type(err).__name__}: {err} "
                "(rerun with --debug or CAPT_DEBUG=1 for the traceback)",
                file=sys.stderr,
            )
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capt", description="Capsule Prompt-Tuning on SuperGLUE", epilog="--debug: show tracebacks"
    )
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("bench", help="training-step and generate cost of every method (see benchmarks/README.md)")
    commands.add_parser("lm-eval", help="lm-evaluation-harness on a CaPT run or adapter: --model capt (see --help)")

    train = commands.add_parser("train", help="train one task with one method (one or more seeds)")
    _add_run_flags(train)
    _add_data_flags(train)
    train.add_argument(
        "--resume", action="store_true", help="continue an interrupted run from its checkpoint (default: off)"
    )
    train.set_defaults(handler=_train)

    tasks = commands.add_parser("tasks", help="list the built-in tasks (--task NAME), or check a task file")
    tasks.add_argument("file", nargs="?", help="a task YAML file to check and show as it resolves")
    tasks.set_defaults(handler=_tasks)

    evaluate = commands.add_parser("eval", help="score a finished run on a task's test split (official val)")
    evaluate.add_argument("--adapter", required=True, help="a run folder written by `capt train`")
    evaluate.add_argument("--task", help="default: the run's task")
    evaluate.add_argument("--data-dir", help="SuperGLUE folder (default: the run's, or CAPT_DATA_DIR)")
    evaluate.add_argument(
        "--split",
        choices=("test", "validation"),
        default="test",
        help="the split to score; a task without a test file scores its validation split (default: %(default)s)",
    )
    evaluate.set_defaults(handler=_eval)

    compare = commands.add_parser("compare", help="several methods on several tasks -> one results table")
    _add_cell_flags(compare)
    _add_run_flags(compare, exclude=("task", "method"))
    compare.set_defaults(handler=_compare)

    sweep = commands.add_parser(
        "sweep", help="tune the learning rate per method x task on validation, then train the chosen rate over seeds"
    )
    _add_cell_flags(sweep)
    sweep.add_argument(
        "--lr-grid",
        default="",
        help="METHOD=LR,LR,...;METHOD=... (default per method: DEFAULT_LR / 3, DEFAULT_LR, 3 x DEFAULT_LR)",
    )
    sweep.add_argument(
        "--extend-grid",
        type=int,
        default=0,
        metavar="N",
        help="when a cell's best rate is at an end of its grid, train one more rate beyond that end (at the grid's "
        "outer ratio: 0.27 when 0.09 wins 0.01,0.03,0.09), up to N times per cell (default 0: the grid as given)",
    )
    sweep.add_argument(
        "--references",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add the zero-shot backbone and the majority class per task (default: on)",
    )
    sweep.add_argument(
        "--finished-only",
        action="store_true",
        help="train nothing: tabulate the cells whose results.json exists and name the others (a study that "
        "spans sessions reports where it stands); the reference rows still score the backbone unless "
        "--no-references",
    )
    _add_run_flags(sweep, exclude=("task", "method", "lr", "seed"))
    sweep.set_defaults(handler=_sweep)
    predict = commands.add_parser("predict", help="a run's answers for new inputs (or several CaPT runs as one bank)")
    source = predict.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a run folder from `capt train`; --input rows hold its task's own fields")
    source.add_argument(
        "--adapters", help="task=RUN_DIR pairs of CaPT runs (capt or capt-rms), e.g. rte=runs/a,cb=runs/b (mixed input)"
    )
    predict.add_argument(
        "--input",
        required=True,
        help="with --run: the task's rows (jsonl, json, csv, tsv, parquet); with --adapters: jsonl records, each "
        "with a 'task' field",
    )
    predict.add_argument("--output", required=True, help="jsonl of predictions, one per example, in input order")
    predict.set_defaults(handler=_predict)
    _add_serve_parser(commands)

    _add_analyze_parser(commands)
    return parser


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    """Your own data, as a task built from flags (instead of --task)."""
    group = parser.add_argument_group("your own data (instead of --task; see docs/your-data.md)")
    group.add_argument("--train-file", help="training rows: jsonl, json, csv, tsv or parquet, or a save_to_disk folder")
    group.add_argument(
        "--validation-file", help="default: 10%% of the training rows, stratified by label (--split-seed)"
    )
    group.add_argument("--test-file", help="default: none; the run then reports its validation scores, and says so")
    group.add_argument("--text-fields", help="comma-separated text columns, e.g. sentence1,sentence2 (or the context)")
    group.add_argument("--label-field", help="the label column (classify), or the answer's index (choice)")
    group.add_argument("--choices-field", help="choice: a column holding the list of options, or option columns a,b")
    group.add_argument("--task-type", choices=("classify", "choice", "generate"), help="default: from the fields")
    group.add_argument("--task-name", help="the task's name in results (default: the training file's name)")


def task_from_flags(args: argparse.Namespace) -> str:
    """Build, check and register the task that --train-file and its companions describe; returns its name.

    A label field means classify, a choices field choice; a `messages` column, or `prompt` and `completion`
    columns, mean generate."""
    from .tasks import TaskSpec, TaskSpecError, builtin_tasks, read_rows, register_task, resolved_spec

    if args.task:
        raise TaskSpecError("--task and --train-file: give one (a task, or your data's files)")
    train = Path(args.train_file)
    fields = _comma_list(args.text_fields, "--text-fields") if args.text_fields else []
    choices = _comma_list(args.choices_field, "--choices-field") if args.choices_field else []
    kind = args.task_type
    # Without named fields, the first row's columns say whether the rows are chat or prompt/completion data.
    first_rows = read_rows(train)[:1] if train.is_file() and not fields and not args.label_field else []
    columns = set(first_rows[0][1]) if first_rows else set()
    if kind is None:
        if {"messages"} <= set(fields) | columns or {"prompt", "completion"} <= set(fields) | columns:
            kind = "generate"
        else:
            kind = "choice" if choices else "classify"
    if kind == "generate" and not fields:
        fields = ["messages"] if "messages" in columns else ["prompt", "completion"]
    if kind != "generate" and not fields:
        raise TaskSpecError(
            "--text-fields: name the text column(s) of your data, e.g. --text-fields sentence1,sentence2"
        )
    name = args.task_name or (train.parent.name if train.stem in ("train", "data") else train.stem)
    name = name.replace(" ", "-").replace(".", "-")
    if name in builtin_tasks():
        raise TaskSpecError(f"--task-name: {name!r} is a built-in task; name your task with --task-name")
    source = {"train": str(train.resolve())}
    for split, value in (("validation", args.validation_file), ("test", args.test_file)):
        if value:
            source[split] = str(Path(value).resolve())
    if train.is_dir():
        source = {"dataset": str(train.resolve())}
    spec = TaskSpec(
        name=name,
        kind=kind,
        source=source,
        text_fields=fields,
        label_field=args.label_field or ("label" if kind == "choice" else None),
        options_field=choices[0] if len(choices) == 1 else None,
        option_fields=choices if len(choices) > 1 else (),
    )
    return register_task(resolved_spec(spec)).name


def _add_cell_flags(parser: argparse.ArgumentParser) -> None:
    """--tasks and --methods of `compare` and `sweep` (optional where the --config file has a plan)."""
    note = "; with a --config plan: narrows it (default: all of it)"
    parser.add_argument("--tasks", help="comma-separated, e.g. cb,copa,rte,wic" + note)
    parser.add_argument("--methods", help="comma-separated, e.g. capt,deep-prompt,prompt,lora" + note)


def _add_run_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per RunConfig field (defaults None: only flags the user gave override the YAML file); the help
    shows RunConfig's default, which applies when neither the flag nor the --config file sets the field."""
    from .settings import RunConfig, field_help, field_kind

    parser.add_argument(
        "--config",
        help=f"YAML file of RunConfig settings, or the name of a shipped one ({', '.join(shipped_configs())}); "
        "default: none, RunConfig's defaults",
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="train seeds seed..seed+N-1; report mean and std (default: %(default)s)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace results already in --output-dir (default: off)"
    )
    for spec in dataclasses.fields(RunConfig):
        if spec.name in exclude:
            continue
        flag = "--" + spec.name.replace("_", "-")
        kind, _ = field_kind(spec.name)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field_help(spec.name))
        else:
            parser.add_argument(flag, type=kind, default=None, help=field_help(spec.name))


def shipped_configs() -> list[str]:
    """The names of the run configs shipped inside the package, for `--config NAME` (e.g. `minilm`)."""
    return sorted(p.name.removesuffix(".yaml") for p in SHIPPED_CONFIGS.iterdir() if p.name.endswith(".yaml"))


def resolve_config(path_or_name: str) -> Path:
    """The file a `--config` value means: a path as given, or else a shipped config's name (`smollm2-study`).

    A value that exists, or that looks like a path (a suffix or a folder part), is taken as a path, so a local
    file always wins over a shipped one of the same name.
    """
    path = Path(path_or_name)
    if path.exists() or path.suffix or len(path.parts) != 1:
        return path
    shipped = SHIPPED_CONFIGS / f"{path_or_name}.yaml"
    if shipped.is_file():
        return shipped
    raise ValueError(
        f"--config {path_or_name}: no such file, and no shipped config of that name "
        f"(shipped: {', '.join(shipped_configs())})"
    )


def _read_yaml(path: str) -> dict[str, Any]:
    """A YAML mapping of settings; syntax errors, tags (never executed) and duplicate keys name the file."""
    import yaml

    path = str(resolve_config(path))

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ValueError(f"{path}, line {key_node.start_mark.line + 1}: duplicate key {key!r}")
                seen.add(key)
            return super().construct_mapping(node, deep)

    if not Path(path).is_file():
        raise ValueError(f"--config {path}: {'a folder' if Path(path).is_dir() else 'no such file'}; give a YAML file")
    from .data.superglue import decode_utf8

    try:
        loaded = yaml.load(decode_utf8(Path(path).read_bytes(), path), Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not a valid settings file: {' '.join(str(err).split())}") from err
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")
    return loaded


# The YAML sections of settings that differ by task or by method, so that one file holds a study whose tasks need
# other lengths, subsets or epochs, and whose methods other heads:
# `per_task: {copa: {max_length: 32}}`, `per_method: {full: {decoder_head: classifier}}`.
PER_TASK_KEY = "per_task"
PER_METHOD_KEY = "per_method"
# The YAML map of a study's cells, task -> methods: `plan: {cb: [capt, lora], rte: [capt]}`. `compare` and `sweep`
# run the plan when --tasks and --methods are left out; given, they pick among its cells.
PLAN_KEY = "plan"


@dataclasses.dataclass(frozen=True)
class SettingsFile:
    """A --config file, checked: its settings, its per-task and per-method sections and its plan."""

    settings: dict[str, Any]
    per_task: dict[str, dict[str, Any]]
    per_method: dict[str, dict[str, Any]]
    plan: dict[str, list[str]]


def read_settings_file(path: str) -> SettingsFile:
    """Read and check a --config file; every error names the file and the key."""
    from .settings import METHODS, RunConfig
    from .tasks import task_names

    names = {f.name for f in dataclasses.fields(RunConfig)}
    loaded = _read_yaml(path)
    # Built-in and registered tasks, and task files (a study of your own tasks names their YAML files).
    named = [k for key in (PER_TASK_KEY, PLAN_KEY) if isinstance(loaded.get(key), dict) for k in loaded[key]]
    known_tasks = [*task_names(), *filter(_is_file, named)]
    per_task = _section_settings(loaded.pop(PER_TASK_KEY, {}), path, PER_TASK_KEY, "task", known_tasks, names)
    per_method = _section_settings(loaded.pop(PER_METHOD_KEY, {}), path, PER_METHOD_KEY, "method", METHODS, names)
    plan = _plan(loaded.pop(PLAN_KEY, {}), path, known_tasks, METHODS)
    unknown = sorted(set(loaded) - names)
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}")
    # Which of two sections wins would be an arbitrary rule a reader must remember: a setting lives in one.
    both = sorted({k for s in per_task.values() for k in s} & {k for s in per_method.values() for k in s})
    if both:
        raise ValueError(f"{path}: {both} set in both {PER_TASK_KEY} and {PER_METHOD_KEY}; set each in one of them")
    return SettingsFile(loaded, per_task, per_method, plan)


def _keyed_by(section: Any, path: str, key: str, noun: str, known: Any, values: str) -> dict[str, Any]:
    """A section that maps task (or method) names to `values`, checked: a mapping, of known names only."""
    if not isinstance(section, dict):
        raise ValueError(f"{path}: {key} must map {noun} names to {values}, got {type(section).__name__}")
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise ValueError(f"{path}: {key} names unknown {noun}s {unknown}; known: {', '.join(known)}")
    return section


def _section_settings(
    section: Any, path: str, key: str, noun: str, known: Any, names: set[str]
) -> dict[str, dict[str, Any]]:
    """A `per_task` or `per_method` section, checked: known task (method) names, each a mapping of known settings."""
    for name, settings in _keyed_by(section, path, key, noun, known, "settings").items():
        if not isinstance(settings, dict):
            raise ValueError(f"{path}: {key}.{name} must be a mapping of settings")
        fixed = sorted(set(settings) & {"task", "method"})
        if fixed:
            raise ValueError(f"{path}: {key}.{name} sets {fixed}: a section holds its {noun}'s settings")
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"{path}: {key}.{name}: unknown settings {unknown}")
    return section


def _plan(section: Any, path: str, tasks: Any, methods: Any) -> dict[str, list[str]]:
    """The `plan` section, checked: known tasks, each a list of known methods, none twice."""
    for task, planned in _keyed_by(section, path, PLAN_KEY, "task", tasks, "lists of methods").items():
        if not isinstance(planned, list) or not planned:
            raise ValueError(f"{path}: {PLAN_KEY}.{task} must be a list of methods, e.g. [capt, lora]")
        unknown = sorted({str(m) for m in planned} - set(methods))
        if unknown:
            raise ValueError(f"{path}: {PLAN_KEY}.{task} names unknown methods {unknown}; known: {', '.join(methods)}")
        _refuse_duplicates(planned, f"{path}: {PLAN_KEY}.{task}")
    return section


def _is_file(name: Any) -> bool:
    return isinstance(name, str) and name.endswith((".yaml", ".yml"))


def run_config(args: argparse.Namespace, **fixed: Any) -> RunConfig:
    """RunConfig from defaults < YAML (--config) < its `per_method` and `per_task` sections for the run's method
    and task < flags < `fixed`."""
    from .settings import RunConfig

    names = {f.name for f in dataclasses.fields(RunConfig)}
    flags = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    settings: dict[str, Any] = {}
    if args.config:
        study = read_settings_file(args.config)
        settings.update(study.settings)

        def chosen(key: str) -> Any:
            return fixed.get(key, flags.get(key, settings.get(key, getattr(RunConfig, key))))

        settings.update(study.per_method.get(chosen("method"), {}))
        settings.update(study.per_task.get(chosen("task"), {}))
    settings.update(flags)
    settings.update(fixed)
    try:
        config = RunConfig(**settings)
    except ValueError as err:
        raise ValueError(f"{args.config}: {err}" if args.config else str(err)) from err
    out = Path(config.output_dir)
    existing = next(p for p in (out, *out.parents) if p.exists())  # the folder, or where it would be made
    if not existing.is_dir():
        raise ValueError(f"--output-dir {out}: {existing} is a file, not a folder")
    return config


def study_cells(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (task, method) cells of `compare` and `sweep`: --tasks x --methods; with a --config file that has a
    plan, the plan's cells, narrowed to the tasks and methods given. A name that picks no planned cell, or a pair
    of --tasks x --methods that the plan does not hold, is refused: a study never runs a cell its plan leaves out,
    and a typed name is never silently dropped."""
    tasks = _comma_list(args.tasks, "--tasks") if args.tasks else None
    methods = _comma_list(args.methods, "--methods") if args.methods else None
    plan = read_settings_file(args.config).plan if args.config else {}
    if not plan:
        if tasks is None or methods is None:
            raise ValueError("give --tasks and --methods, or a --config file with a plan (task -> methods)")
        return [(task, method) for task in tasks for method in methods]
    cells = [
        (task, method)
        for task, planned in plan.items()
        for method in planned
        if (tasks is None or task in tasks) and (methods is None or method in methods)
    ]
    if tasks is not None and methods is not None:
        unplanned = [f"{t}/{m}" for t in tasks for m in methods if (t, m) not in cells]
    else:
        unplanned = [n for n in tasks or [] if n not in {t for t, _ in cells}]
        unplanned += [n for n in methods or [] if n not in {m for _, m in cells}]
    if unplanned:
        raise ValueError(
            f"{args.config}: its plan does not run {', '.join(unplanned)}; add them to its {PLAN_KEY} section"
        )
    return cells


def _train(args: argparse.Namespace) -> int:
    from .experiments import train_seeds

    if args.resume and args.overwrite:  # one would silently win: continuing a run is not starting it again
        raise ValueError("--resume continues the run in --output-dir, --overwrite starts it again: give one of them")
    data_flags = (
        "validation_file",
        "test_file",
        "text_fields",
        "label_field",
        "choices_field",
        "task_type",
        "task_name",
    )
    if args.train_file:
        args.task = task_from_flags(args)
    elif any(getattr(args, flag) for flag in data_flags):
        given = next(flag for flag in data_flags if getattr(args, flag))
        raise ValueError(f"--{given.replace('_', '-')} describes your data: give --train-file too")
    config = run_config(args)
    summary = train_seeds(config, args.seeds, args.overwrite, resume=args.resume)
    _print_summary(summary)
    return 0


# Metrics printed as they are (not as percentages), with their precision.
RAW_METRICS = {"loss": 4, "perplexity": 3}


def scores_text(task: str, scores: dict[str, Any]) -> str:
    """`accuracy 62.50, macro_f1 43.50`: a run's scores as the CLI prints them (values, or {"mean", "std"} over
    seeds). Loss and perplexity print as they are, the rest as percentages; a generate task leaves out "score"
    (its headline metric restated, better when higher) and names the headline instead.

    Example:
        >>> scores_text("cb", {"accuracy": 0.625, "score": 0.53})
        'accuracy 62.50, score 53.00'
    """
    from .tasks import get_task

    spec = get_task(task)
    parts = []
    for name, value in scores.items():
        if spec.kind == "generate" and name == "score":
            continue
        digits, scale = (RAW_METRICS[name], 1) if name in RAW_METRICS else (2, 100)
        if isinstance(value, dict):
            parts.append(f"{name} {scale * value['mean']:.{digits}f} ± {scale * value['std']:.{digits}f}")
        else:
            parts.append(f"{name} {scale * value:.{digits}f}")
    headline = f" (headline: {spec.metrics[0]})" if spec.kind == "generate" else ""
    return ", ".join(parts) + headline


def _print_summary(summary: dict[str, Any]) -> None:
    metrics = scores_text(summary["task"], summary["test"])
    split = "test"
    if summary.get("scored_split", "test") != "test":
        split = "validation (no test file: these are validation scores)"
    print(
        f"{summary['task']} / {summary['method']} on {summary['model']} (seeds {summary['seeds']}): {split} {metrics}; "
        f"trainable {summary['trainable_params']:,} ({summary['trainable_percent']:.4f}%); "
        f"{summary['wall_time_s'] / 60:.1f} min"
    )


def _eval(args: argparse.Namespace) -> int:
    from ..saving import atomic_write_text
    from .evaluate import encode_cached, evaluate, load_task
    from .formats import EncoderFormat, head_outputs
    from .run import load_run
    from .tasks import get_task

    config, model, fmt = load_run(args.adapter)
    if args.task and (get_task(args.task).kind == "generate") != (get_task(config.task).kind == "generate"):
        raise ValueError(
            f"--task {args.task}: {args.adapter} was trained on {config.task}, a {get_task(config.task).kind} task; "
            "a run writes answers (generate) or scores labels, not both: score it with a run of the task's kind"
        )
    if args.task and args.task != config.task and isinstance(fmt, EncoderFormat):
        trained, asked = head_outputs(config.task), head_outputs(args.task)
        if trained != asked:  # the run's head would score the other task's labels with the wrong classes
            raise ValueError(
                f"--task {args.task}: {args.adapter} was trained on {config.task} with a {trained}-output head; "
                f"{args.task} needs {asked} outputs. Score it with a run trained on {args.task}."
            )
    config = dataclasses.replace(config, task=args.task or config.task, data_dir=args.data_dir or config.data_dir)
    fmt = dataclasses.replace(fmt, task=config.task)
    _, splits, scored = load_task(config)
    split = args.split if scored == "test" else "validation"  # a task without a test file: its validation split
    examples = splits[split]
    scores = evaluate(model, fmt, encode_cached(fmt, examples, config), examples, config.eval_batch_size)
    out = Path(args.adapter) / f"eval-{config.task}-{split}.json"
    atomic_write_text(out, json.dumps({"task": config.task, "split": split, **scores}, indent=2) + "\n")
    note = " (the task has no test file: validation scores)" if split != args.split else ""
    print(f"{config.task} {split}{note}: {scores_text(config.task, scores)}  ({out})")
    return 0


def _tasks(args: argparse.Namespace) -> int:
    from .tasks import builtin_tasks, read_task_file, resolved_spec

    if args.file:
        import yaml

        print(yaml.safe_dump(resolved_spec(read_task_file(args.file)).to_dict(), sort_keys=False), end="")
        return 0
    for name, spec in builtin_tasks().items():
        answer = f"labels {', '.join(map(str, spec.labels))}" if spec.kind == "classify" else "an option"
        print(f"{name:8} {spec.kind:8} {answer}; metrics {', '.join(spec.metrics)}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from .predict import predict_file, predict_run

    if args.run:
        count = predict_run(Path(args.run), Path(args.input), Path(args.output))
    else:
        count = predict_file(_name_pairs(args.adapters, "--adapters"), Path(args.input), Path(args.output))
    print(f"{count} predictions written to {args.output}")
    return 0


def _lm_eval(args: argparse.Namespace) -> int:
    from ..import_utils import missing_modules

    if missing_modules("lm_eval"):
        raise ValueError('capt lm-eval needs the [lm-eval] extra (lm_eval missing): pip install "capt[lm-eval]"')
    from .lm_eval import run_harness

    return run_harness(args.harness_args)


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="HTTP service: one backbone, many CaPT adapters, mixed-task batches")
    from .settings import NAMED_MODELS

    serve.add_argument(
        "--model",
        required=True,
        help=f"the backbone the adapters were trained on: a name ({', '.join(NAMED_MODELS)}), a folder or a Hub id",
    )
    serve.add_argument("--adapters", required=True, help="name=FOLDER pairs (run or adapter folders), comma-separated")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (default: $CAPT_API_KEY)")
    serve.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="how long a batch waits for more requests (default: %(default)s ms)",
    )
    serve.add_argument("--max-batch", type=int, default=16, help="requests per model batch (default: %(default)s)")
    serve.add_argument("--queue-size", type=int, default=64, help="waiting requests before 429 (default: %(default)s)")
    serve.add_argument(
        "--max-prompt-tokens", type=int, default=1024, help="longest prompt accepted (default: %(default)s)"
    )
    serve.add_argument(
        "--max-tokens", type=int, default=256, help="largest max_tokens a request may ask (default: %(default)s)"
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest request body, else 413 (default: %(default)s, 1 MiB)",
    )
    serve.add_argument(
        "--timeout", type=float, default=60.0, help="seconds before a request gets 504 (default: %(default)s)"
    )
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import os

    from ..import_utils import missing_modules

    missing = missing_modules("fastapi", "uvicorn", "prometheus_client")
    if missing:
        raise ValueError(
            f'capt serve needs the [serve] extra ({", ".join(missing)} missing): pip install "capt[serve]"'
        )
    from .serve import Limits, serve

    limits = Limits(
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens,
        queue_size=args.queue_size,
        timeout_s=args.timeout,
        batch_window_s=args.batch_window_ms / 1000,
        max_batch=args.max_batch,
    )
    api_key = args.api_key or os.environ.get("CAPT_API_KEY") or None
    serve(args.model, _name_pairs(args.adapters, "--adapters"), args.host, args.port, api_key, limits)
    return 0


def _name_pairs(text: str, flag: str) -> dict[str, Path]:
    """`a=x,b=y` -> {"a": Path("x"), "b": Path("y")}."""
    pairs = [item.split("=", 1) for item in text.split(",")]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise ValueError(f"{flag} takes name=FOLDER pairs separated by commas, got {text!r}")
    _refuse_duplicates([name for name, _ in pairs], flag)
    return {name: Path(folder) for name, folder in pairs}


def _comma_list(text: str, flag: str) -> list[str]:
    """`cb,rte` -> ["cb", "rte"]; a name given twice is refused (it would silently give one row, or one adapter)."""
    items = text.split(",")
    _refuse_duplicates(items, flag)
    return items


def _refuse_duplicates(items: list[str], flag: str) -> None:
    repeated = sorted(item for item, count in Counter(items).items() if count > 1)
    if repeated:
        raise ValueError(f"{flag} names {', '.join(repeated)} more than once; give each once")


def _compare(args: argparse.Namespace) -> int:
    from .experiments import compare

    configs = [run_config(args, task=task, method=method) for task, method in study_cells(args)]
    print(compare(configs, args.seeds, args.overwrite))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from .experiments import parse_lr_grid, sweep

    cells = study_cells(args)
    grid = parse_lr_grid(args.lr_grid)
    unknown = sorted(set(grid) - {method for _, method in cells})
    if unknown:
        raise ValueError(f"--lr-grid names methods the sweep does not run: {', '.join(unknown)}")
    if args.extend_grid < 0:
        raise ValueError(f"--extend-grid must be 0 or more extensions per cell, got {args.extend_grid}")
    configs = [run_config(args, task=task, method=method) for task, method in cells]
    print(sweep(configs, grid, args.seeds, args.overwrite, args.references, args.finished_only, args.extend_grid))
    return 0


def _add_analyze_parser(commands: argparse._SubParsersAction) -> None:
    """`capt analyze attention | instance-token`: the paper's analyses, one report folder per run."""
    analyze = commands.add_parser("analyze", help="attention anchors and instance tokens of trained adapters")
    analyses = analyze.add_subparsers(dest="analysis", required=True)

    attention = analyses.add_parser(
        "attention", help="attention maps and anchor numbers of CaPT / Deep Prompt-Tuning runs and their base model"
    )
    attention.add_argument(
        "--run",
        action="append",
        default=[],
        help="a run folder from `capt train` (repeatable; default: none, then --model)",
    )
    attention.add_argument("--model", help="without --run: a bare model (e.g. minilm, tiny-t5), needs --task")
    attention.add_argument("--task", help="default: the runs' task")
    attention.add_argument("--examples", type=int, default=32, help="examples to sample (default: %(default)s)")
    attention.add_argument("--seed", type=int, default=0, help="seed of the example sample (default: %(default)s)")
    attention.add_argument(
        "--split",
        choices=("test", "validation", "train"),
        default="test",
        help="the split to sample (default: %(default)s)",
    )
    attention.add_argument("--max-length", type=int, help="truncate inputs here (default: the runs')")
    attention.add_argument(
        "--max-tokens", type=int, default=48, help="tokens drawn per heatmap axis (default: %(default)s)"
    )
    attention.add_argument("--data-dir", help="SuperGLUE folder (default: the run's, or CAPT_DATA_DIR)")
    attention.add_argument("--output-dir", required=True, help="report folder (PNGs, attention.json, report.md)")
    attention.set_defaults(handler=_analyze_attention)

    instance = analyses.add_parser(
        "instance-token", help="score a prompt-tuned run with k training-free instance tokens (Finding II)"
    )
    instance.add_argument("--run", required=True, help="a deep-prompt run folder from `capt train`")
    instance.add_argument(
        "--ks", default="0,1,2,4", help="comma-separated numbers of instance tokens (default: %(default)s)"
    )
    instance.add_argument(
        "--split", choices=("test", "validation"), default="test", help="the split to score (default: %(default)s)"
    )
    instance.add_argument("--data-dir", help="SuperGLUE folder (default: the run's, or CAPT_DATA_DIR)")
    instance.add_argument("--output-dir", required=True, help="report folder (PNG, instance_tokens.json, report.md)")
    instance.set_defaults(handler=_analyze_instance_token)


def _analyze_attention(args: argparse.Namespace) -> int:
    from .analysis import AttentionOptions, write_attention_report

    options = AttentionOptions(
        output_dir=args.output_dir,
        runs=args.run,
        model=args.model,
        task=args.task,
        examples=args.examples,
        seed=args.seed,
        split=args.split,
        max_length=args.max_length,
        max_tokens=args.max_tokens,
        data_dir=args.data_dir,
    )
    print(f"attention report: {write_attention_report(options)}")
    return 0


def _analyze_instance_token(args: argparse.Namespace) -> int:
    from .analysis import InstanceTokenOptions, write_instance_token_report

    try:
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError as err:
        raise ValueError(f"--ks takes comma-separated integers, got {args.ks!r}") from err
    options = InstanceTokenOptions(args.run, args.output_dir, ks=ks, split=args.split, data_dir=args.data_dir)
    print(f"instance-token report: {write_instance_token_report(options)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
