"""`TaskSpec`: what a task is, as data: where its examples come from, their kind and fields, the text each backbone
family reads, and how it is scored. Built-in and user tasks are the same dataclass, read from the same YAML.
"""

from __future__ import annotations

import difflib
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .preprocess import OPTION_PREPROCESSORS, PREPROCESSORS

KINDS = ("classify", "choice", "generate")
FAMILIES = ("encoder", "t5", "decoder")
# Metric name -> whether higher is better. Classify and choice tasks compute them (capt.recipes.metrics); for
# generate only the names are checked here.
METRIC_DIRECTIONS = {
    "accuracy": True,
    "macro_f1": True,
    "accuracy_macro_f1": True,  # CB's score: the mean of accuracy and macro-F1
    "matthews": True,
    "multirc": True,  # SuperGLUE's MultiRC score: mean of F1 over answers and exact match per question
    "record": True,  # SuperGLUE's ReCoRD score: mean of token F1 and exact match, max over gold answers
    "exact_match": True,
    "token_f1": True,
    "loss": False,
    "perplexity": False,
}
GENERATE_METRICS = ("exact_match", "token_f1", "loss", "perplexity")
# The keys of each family's templates, per kind (the first of each pair is required where the kind has it).
TEMPLATE_KEYS = {
    "classify": {"encoder": ("text", "pair"), "t5": ("input", "label_words"), "decoder": ("prompt", "label_words")},
    "choice": {
        "encoder": ("text", "option"),
        "t5": ("input", "option", "label_words"),
        "decoder": ("prompt", "option"),
    },
    "generate": {},
}
SOURCE_KEYS = ("train", "validation", "test", "dataset", "superglue")
OPTION = "option"  # the field an option template names for the option itself


class TaskSpecError(ValueError):
    """A task spec (a YAML file, or flags) that cannot describe a task; the message names the key."""


def template_fields(template: str, where: str) -> list[str]:
    """The field names a format string uses, e.g. `"{premise} {hypothesis}"` -> ["premise", "hypothesis"].

    Example:
        >>> template_fields("{premise}\\nQuestion: {hypothesis}", "t")
        ['premise', 'hypothesis']
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise TaskSpecError(
            f"{where}: {template!r} is not a format string ({err}); write a literal brace as {{{{"
        ) from err
    names = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise TaskSpecError(f"{where}: {{{name}}} in {template!r}: templates name plain fields, as {{premise}}")
        names.append(name)
    return names


def close_name(name: str, known: Any) -> str:
    """`; did you mean 'x'?` for the closest of `known`, or nothing."""
    match = difflib.get_close_matches(name, [str(k) for k in known], n=1)
    return f"; did you mean {match[0]!r}?" if match else ""


@dataclass
class TaskSpec:
    """A task as data. Validated on construction; `to_dict()` / `TaskSpec.from_dict()` round-trip through YAML.

    - `kind`: `classify` (one or two `text_fields` and a `label_field` from a fixed `labels` set), `choice` (context
      `text_fields`, options in `options_field` (a list column) or in `option_fields` (one column each), the answer's
      index in `label_field`), or `generate` (`messages`, or `prompt` and `completion`).
    - `source`: `train` / `validation` / `test` files (jsonl, json, csv, tsv, parquet), or `dataset`: a
      `datasets.save_to_disk` folder; built-ins read `superglue: <Task folder>` with the official loader.
    - `templates`: per family (`encoder`, `t5`, `decoder`), format strings naming fields (see TEMPLATE_KEYS).
    - `preprocess` / `option_preprocess`: names of the Python functions that add fields data cannot carry
      (`capt.recipes.tasks.preprocess`).
    - `metrics`: names; the first is the score that early stopping and the results table use.

    Example:
        >>> spec = TaskSpec(name="pairs", kind="classify", text_fields=["s1", "s2"], label_field="label",
        ...                 labels=["no", "yes"], source={"train": "train.csv"})
        >>> spec.templates["decoder"]["label_words"]
        (' no', ' yes')
        >>> TaskSpec.from_dict(spec.to_dict()) == spec
        True
    """

    name: str
    kind: str
    source: dict[str, str | None] = field(default_factory=dict)
    text_fields: tuple[str, ...] = ()
    label_field: str | None = None
    labels: tuple[Any, ...] = ()
    options_field: str | None = None
    option_fields: tuple[str, ...] = ()
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: tuple[str, ...] = ()
    preprocess: str | None = None
    option_preprocess: str | None = None
    validation_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.replace("-", "_").isidentifier():
            raise TaskSpecError(f"task name {self.name!r}: use letters, digits, - and _ (it names files and rows)")
        if self.kind not in KINDS:
            raise TaskSpecError(f"{self.name}: kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        self.text_fields = tuple(self.text_fields)
        self.option_fields = tuple(self.option_fields)
        self.labels = tuple(self.labels)
        self.source = dict(self.source)
        unknown = sorted(set(self.source) - set(SOURCE_KEYS))
        if unknown:
            raise TaskSpecError(f"{self.name}: source keys {unknown}; expected {', '.join(SOURCE_KEYS)}")
        if not 0 < self.validation_fraction < 1:
            raise TaskSpecError(f"{self.name}: validation_fraction must be in (0, 1), got {self.validation_fraction}")
        for key, registry in (("preprocess", PREPROCESSORS), ("option_preprocess", OPTION_PREPROCESSORS)):
            name = getattr(self, key)
            if name is not None and name not in registry:
                raise TaskSpecError(f"{self.name}: {key} {name!r} is not a known function{close_name(name, registry)}")
        getattr(self, f"_check_{self.kind}")()
        self.metrics = tuple(self.metrics) or self._default_metrics()
        allowed = (
            GENERATE_METRICS
            if self.kind == "generate"
            else tuple(m for m in METRIC_DIRECTIONS if m not in GENERATE_METRICS)
        )
        for metric in self.metrics:
            if metric not in allowed:
                raise TaskSpecError(
                    f"{self.name}: metric {metric!r} does not apply to a {self.kind} task{close_name(metric, allowed)}"
                    f"; allowed: {', '.join(allowed)}"
                )
        if self.kind != "generate":
            self.templates = self._checked_templates()

    # ------------------------------------------------------------------ per kind

    def _check_classify(self) -> None:
        if not self.text_fields:
            raise TaskSpecError(f"{self.name}: a classify task needs text_fields (one or two: a text, or a pair)")
        if not self.label_field:
            raise TaskSpecError(f"{self.name}: a classify task needs a label_field")
        if self.options_field or self.option_fields:
            options = self.options_field or list(self.option_fields)
            raise TaskSpecError(
                f"{self.name}: kind classify contradicts its options {options}; a task with per-example options is "
                "kind: choice"
            )
        if self.labels and len(set(self.labels)) != len(self.labels):
            raise TaskSpecError(f"{self.name}: labels {list(self.labels)} name a label twice")

    def _check_choice(self) -> None:
        if bool(self.options_field) == bool(self.option_fields):
            raise TaskSpecError(
                f"{self.name}: a choice task needs its options in options_field (a list column) or in option_fields "
                "(one column per option), one of the two"
            )
        if not self.text_fields:
            raise TaskSpecError(f"{self.name}: a choice task needs text_fields (the context the options answer)")

    def _check_generate(self) -> None:
        fields = set(self.text_fields)
        if fields not in ({"messages"}, {"prompt", "completion"}):
            raise TaskSpecError(
                f"{self.name}: a generate task reads text_fields [messages] or [prompt, completion], got "
                f"{list(self.text_fields)}"
            )
        if self.label_field or self.labels or self.options_field or self.option_fields:
            raise TaskSpecError(
                f"{self.name}: kind generate contradicts its label or options fields; a labelled task is classify"
            )

    def _default_metrics(self) -> tuple[str, ...]:
        if self.kind == "generate":
            return ("loss", "perplexity", "exact_match", "token_f1")
        return ("accuracy", "macro_f1") if self.kind == "classify" else ("accuracy",)

    # ------------------------------------------------------------------ templates

    def _default_templates(self) -> dict[str, dict[str, Any]]:
        """Plain templates for a user task that gives none: the fields as they are, the labels as label words."""
        fields = [f"{{{name}}}" for name in self.text_fields]
        if self.kind == "classify":
            words = tuple(str(label) for label in self.labels)
            return {
                "encoder": {"text": fields[0], "pair": "\n".join(fields[1:]) or None},
                "t5": {
                    "input": " ".join([self.name, *(f"{n}: {{{n}}}" for n in self.text_fields)]),
                    "label_words": words,
                },
                "decoder": {"prompt": "\n".join(fields) + "\nAnswer:", "label_words": tuple(f" {w}" for w in words)},
            }
        context = "\n".join(fields)
        return {
            "encoder": {"text": context, "option": "{option}"},
            "t5": {"input": " ".join([self.name, *(f"{n}: {{{n}}}" for n in self.text_fields)]), "option": "{option}"},
            "decoder": {"prompt": context, "option": " {option}"},
        }

    def known_fields(self) -> set[str]:
        """Fields a template may name: the data's and those its preprocessor adds."""
        known = set(self.text_fields) | set(self.option_fields)
        if self.preprocess:
            known |= set(PREPROCESSORS[self.preprocess].adds)
        return known

    def _checked_templates(self) -> dict[str, dict[str, Any]]:
        given = {family: dict(t) for family, t in (self.templates or {}).items()}
        unknown = sorted(set(given) - set(FAMILIES))
        if unknown:
            raise TaskSpecError(f"{self.name}: templates for {unknown}; families are {', '.join(FAMILIES)}")
        defaults = None
        templates: dict[str, dict[str, Any]] = {}
        for family in FAMILIES:
            keys = TEMPLATE_KEYS[self.kind][family]
            if family not in given:
                defaults = defaults or self._default_templates()
                given[family] = defaults[family]
            entry = given[family]
            extra = sorted(set(entry) - set(keys))
            if extra:
                raise TaskSpecError(f"{self.name}: templates.{family} keys {extra}; expected {', '.join(keys)}")
            templates[family] = self._checked_family(family, entry)
        return templates

    def _checked_family(self, family: str, entry: dict[str, Any]) -> dict[str, Any]:
        where = f"{self.name}: templates.{family}"
        known = self.known_fields()
        option_known = known | {OPTION}
        if self.option_preprocess:
            option_known |= set(OPTION_PREPROCESSORS[self.option_preprocess].adds)
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if key == "label_words":
                if not value:  # none yet: filled from the labels once the data has given them
                    continue
                words = tuple(value)
                count = len(self.labels) if self.kind == "classify" else len(self.option_fields)
                if (count and len(words) != count) or not all(isinstance(w, str) for w in words):
                    raise TaskSpecError(
                        f"{where}.label_words: {count} strings, one per label in order, got {list(words)}"
                    )
                out[key] = words
                continue
            if value is None:
                out[key] = None
                continue
            if not isinstance(value, str):
                raise TaskSpecError(f"{where}.{key}: expected a format string, got {type(value).__name__}")
            allowed = option_known if key == "option" else known
            for name in template_fields(value, f"{where}.{key}"):
                if name not in allowed:
                    raise TaskSpecError(
                        f"{where}.{key}: {{{name}}} names no field of the task{close_name(name, allowed)}; "
                        f"fields: {', '.join(sorted(allowed))}"
                    )
            out[key] = value
        required = {"encoder": "text", "t5": "input", "decoder": "prompt"}
        if out.get(required[family]) is None:
            raise TaskSpecError(f"{where}: needs {required[family]!r}")
        if self.kind == "classify" and family != "encoder" and "label_words" not in out and self.labels:
            out["label_words"] = tuple(("" if family == "t5" else " ") + str(label) for label in self.labels)
        if self.kind == "choice" and family != "t5" and out.get("option") is None:
            raise TaskSpecError(f"{where}: needs 'option', the text of one option (e.g. ' {{option}}')")
        if self.kind == "choice" and family == "t5" and not (out.get("option") or out.get("label_words")):
            out["option"] = "{option}"
        return out

    # ------------------------------------------------------------------ YAML

    @property
    def is_choice(self) -> bool:
        return self.kind == "choice"

    @property
    def higher_is_better(self) -> bool:
        """Direction of the headline metric (the first): early stopping keeps the best by it."""
        return METRIC_DIRECTIONS[self.metrics[0]]

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and dicts (YAML- and JSON-safe); `TaskSpec.from_dict` reads it back equal."""
        data = asdict(self)

        def plain(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        return {key: plain(value) for key, value in data.items() if value not in (None, (), {}, [])}

    @classmethod
    def from_dict(cls, data: Any, where: str = "task spec") -> TaskSpec:
        """A spec from a mapping (a YAML file's content); unknown keys are refused with a close name."""
        if not isinstance(data, dict):
            raise TaskSpecError(f"{where}: expected a mapping of task settings, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise TaskSpecError(f"{where}: unknown key {unknown[0]!r}{close_name(unknown[0], known)}")
        try:
            return cls(**data)
        except TypeError as err:
            raise TaskSpecError(f"{where}: {err}") from err
        except TaskSpecError as err:
            raise TaskSpecError(f"{where}: {err}") from err

    def with_source_relative_to(self, folder: Path) -> TaskSpec:
        """The spec with relative source paths made absolute from `folder` (the YAML file's own)."""
        source = {
            key: (
                str((folder / value).resolve())
                if key != "superglue" and value and not Path(value).is_absolute()
                else value
            )
            for key, value in self.source.items()
        }
        data = self.to_dict()
        data["source"] = source
        return TaskSpec.from_dict(data)
