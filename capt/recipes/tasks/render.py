"""An example as the strings each backbone family reads, from its task's templates (no per-task code here).

Everywhere the option (or label-word) index equals the label id, so argmax over options is the predicted label.
"""

from __future__ import annotations

from typing import Any

from .preprocess import OPTION_PREPROCESSORS, PREPROCESSORS
from .spec import OPTION, TaskSpec


def example_fields(spec: TaskSpec, example: Any) -> dict[str, str]:
    """The example's fields as text, plus those the task's preprocessor adds."""
    fields = {key: str(value) for key, value in example.fields.items()}
    if spec.preprocess:
        fields.update(PREPROCESSORS[spec.preprocess].function(fields, example))
    return fields


def options(spec: TaskSpec, example: Any) -> list[str]:
    """A choice example's options, in answer-index order."""
    if spec.options_field:
        return list(example.candidates)
    return [str(example.fields[name]) for name in spec.option_fields]


def _option_fields(spec: TaskSpec, fields: dict[str, str], option: str) -> dict[str, str]:
    out = {**fields, OPTION: option}
    if spec.option_preprocess:
        out.update(OPTION_PREPROCESSORS[spec.option_preprocess].function(fields, option))
    return out


def _fill(template: str, fields: dict[str, str]) -> str:
    return template.format_map(fields)


def encoder_pairs(spec: TaskSpec, example: Any) -> list[tuple[str, str | None]]:
    """(text, text_pair) for a classifier: one pair, or one per option of a choice task."""
    template, fields = spec.templates["encoder"], example_fields(spec, example)
    if not spec.is_choice:
        pair = template.get("pair")
        return [(_fill(template["text"], fields), None if pair is None else _fill(pair, fields))]
    text = _fill(template["text"], fields)
    return [(text, _fill(template["option"], _option_fields(spec, fields, o))) for o in options(spec, example)]


def t5_source(spec: TaskSpec, example: Any) -> str:
    """T5's text-to-text input."""
    return _fill(spec.templates["t5"]["input"], example_fields(spec, example))


def t5_targets(spec: TaskSpec, example: Any) -> list[str]:
    """T5's target per label id (its label words) or per option."""
    template = spec.templates["t5"]
    if template.get("label_words"):
        return list(template["label_words"])
    fields = example_fields(spec, example)
    return [_fill(template["option"], _option_fields(spec, fields, o)) for o in options(spec, example)]


def lm_source(spec: TaskSpec, example: Any) -> str:
    """A decoder's prompt; each of `lm_continuations` is scored as its continuation."""
    return _fill(spec.templates["decoder"]["prompt"], example_fields(spec, example))


def lm_continuations(spec: TaskSpec, example: Any) -> list[str]:
    """The continuations after `lm_source`, indexed by label id (or option)."""
    template = spec.templates["decoder"]
    if not spec.is_choice:
        return list(template["label_words"])
    fields = example_fields(spec, example)
    return [_fill(template["option"], _option_fields(spec, fields, o)) for o in options(spec, example)]
