"""An Example as the strings each backbone family consumes, from its task's templates (`capt.recipes.tasks`).

Everywhere the choice (or label-word) index equals the label id, so argmax over choices is the predicted label.
The built-in task files follow common BERT/RoBERTa SuperGLUE setups for encoder pairs, the original
text-to-text formats for T5, and lm-evaluation-harness (`lm_eval/tasks/super_glue/*/default.yaml`) for decoders.
"""

from __future__ import annotations

from ..tasks import render
from ..tasks.registry import get_task
from .superglue import Example


def is_choice_task(task: str) -> bool:
    """True for tasks scored as a choice among per-example options (COPA, ReCoRD) rather than fixed labels."""
    return get_task(task).is_choice


def _require(example: Example, choice: bool) -> None:
    if is_choice_task(example.task) != choice:
        use = "encoder_choices" if is_choice_task(example.task) else "encoder_text"
        raise ValueError(f"{example.task} needs {use}")


def encoder_text(example: Example) -> tuple[str, str | None]:
    """(text, text_pair) for a sentence-pair classifier (BERT/RoBERTa style); not for choice tasks."""
    _require(example, choice=False)
    return render.encoder_pairs(get_task(example.task), example)[0]


def encoder_choices(example: Example) -> list[tuple[str, str]]:
    """One (text, text_pair) per choice of a choice task: COPA's two alternatives or ReCoRD's candidates."""
    _require(example, choice=True)
    return render.encoder_pairs(get_task(example.task), example)


def t5_input(example: Example) -> str:
    """T5 text-to-text input, e.g. "rte hypothesis: ... premise: ..."."""
    return render.t5_source(get_task(example.task), example)


def t5_label_words(task: str) -> list[str]:
    """T5 target words in label-id order (ReCoRD has none: its targets are the example's entities)."""
    words = get_task(task).templates["t5"].get("label_words")
    if not words:
        raise ValueError(f"{task} targets are the example's options, not fixed label words")
    return list(words)


def lm_prompt(example: Example) -> str:
    """Decoder-only prompt; each of `lm_choices` is scored as its continuation by log-likelihood."""
    return render.lm_source(get_task(example.task), example)


def lm_choices(example: Example) -> list[str]:
    """Continuations to score after `lm_prompt`, indexed by label id."""
    return render.lm_continuations(get_task(example.task), example)
