"""SuperGLUE metrics in plain Python (the `evaluate` super_glue script does not load with datasets >= 4).

All scores are fractions in [0, 1]. Predictions outside the label range (e.g. an unparseable T5 output mapped
to -1) simply count as wrong, as in T5's postprocessing.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from statistics import fmean

from .tasks.registry import get_task


def _check_lengths(preds: Sequence[object], labels: Sequence[object]) -> None:
    if len(preds) != len(labels):
        raise ValueError(f"{len(preds)} predictions for {len(labels)} labels")
    if not labels:
        raise ValueError("no predictions to score")


def _f1(tp: int, fp: int, fn: int) -> float:
    # 2TP / (2TP + FP + FN); with no true positive it is 0, which is also sklearn's default zero_division.
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def _class_f1(preds: Sequence[int], labels: Sequence[int], cls: int) -> float:
    tp = sum(p == cls and y == cls for p, y in zip(preds, labels, strict=True))
    fp = sum(p == cls and y != cls for p, y in zip(preds, labels, strict=True))
    fn = sum(p != cls and y == cls for p, y in zip(preds, labels, strict=True))
    return _f1(tp, fp, fn)


def accuracy(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of predictions equal to the label."""
    _check_lengths(preds, labels)
    return sum(p == y for p, y in zip(preds, labels, strict=True)) / len(labels)


def macro_f1(preds: Sequence[int], labels: Sequence[int], num_classes: int) -> float:
    """Per-class F1 averaged over all classes 0..num_classes-1 (T5's mean_multiclass_f1).

    As sklearn's f1_score(labels=range(num_classes), average="macro") with its default zero_division: a class
    without true positives, including one that is neither predicted nor present, has F1 0 and still counts in
    the mean. (evaluate's super_glue "cb" instead averages only over the classes that occur.)
    """
    _check_lengths(preds, labels)
    if any(not 0 <= y < num_classes for y in labels):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    return fmean(_class_f1(preds, labels, cls) for cls in range(num_classes))


def binary_f1(preds: Sequence[int], labels: Sequence[int]) -> float:
    """F1 of the positive class 1 (0 when there is no true positive)."""
    _check_lengths(preds, labels)
    return _class_f1(preds, labels, 1)


def multirc_scores(preds: Sequence[int], labels: Sequence[int], groups: Sequence[str]) -> dict[str, float]:
    """{"f1a": binary F1 over all answer options, "em": fraction of questions with every option right}."""
    _check_lengths(preds, labels)
    if len(groups) != len(labels):
        raise ValueError(f"{len(groups)} groups for {len(labels)} labels")
    all_right: dict[str, bool] = {}
    for p, y, g in zip(preds, labels, groups, strict=True):
        all_right[g] = all_right.get(g, True) and p == y
    return {"f1a": binary_f1(preds, labels), "em": sum(all_right.values()) / len(all_right)}


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def _normalize(text: str) -> str:
    """SQuAD answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _token_f1(pred: str, gold: str) -> float:
    pred_tokens, gold_tokens = _normalize(pred).split(), _normalize(gold).split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def record_scores(pred_texts: Sequence[str], gold_answer_lists: Sequence[Sequence[str]]) -> dict[str, float]:
    """ReCoRD {"f1": token F1, "em": exact match}, each the max over an example's gold answers, averaged."""
    _check_lengths(pred_texts, gold_answer_lists)
    if any(not golds for golds in gold_answer_lists):
        raise ValueError("every example needs at least one gold answer")
    pairs = list(zip(pred_texts, gold_answer_lists, strict=True))
    return {
        "f1": fmean(max(_token_f1(p, g) for g in golds) for p, golds in pairs),
        "em": fmean(max(float(_normalize(p) == _normalize(g)) for g in golds) for p, golds in pairs),
    }


def matthews(preds: Sequence[int], labels: Sequence[int], num_classes: int) -> float:
    """Matthews correlation coefficient, multi-class (Gorodkin's R_K, as sklearn's matthews_corrcoef); 0 when a
    side is constant.

    Example:
        >>> matthews([0, 1, 1, 0], [0, 1, 0, 0], 2)
        0.5773502691896258
    """
    _check_lengths(preds, labels)
    n = len(labels)
    correct = sum(p == y for p, y in zip(preds, labels, strict=True))
    predicted = [sum(p == k for p in preds) for k in range(num_classes)]
    true = [sum(y == k for y in labels) for k in range(num_classes)]
    numerator = correct * n - sum(p * t for p, t in zip(predicted, true, strict=True))
    denominator = ((n * n - sum(p * p for p in predicted)) * (n * n - sum(t * t for t in true))) ** 0.5
    return numerator / denominator if denominator else 0.0


def task_metrics(task: str, preds: Sequence, labels: Sequence, groups: Sequence[str] | None = None) -> dict[str, float]:
    """The task's metrics (its spec's `metrics`, by name) plus "score", the first metric's value: the number that
    early stopping keeps the best of and that enters the SuperGLUE average.

    Label and choice tasks take int predictions and labels: `accuracy`, `macro_f1`, `matthews`, and SuperGLUE's
    `accuracy_macro_f1` (CB: "accuracy", "f1" and their mean) and `multirc` ("accuracy", "f1a", "em" and the mean of
    the last two; needs `groups`, the question id per answer). `record` takes predicted entity strings and, as
    `labels`, the lists of gold answers ("f1", "em" and their mean).
    """
    spec = get_task(task)
    scores: dict[str, float] = {}
    headline = None
    for name in spec.metrics:
        part = _metric(name, preds, labels, groups, len(spec.labels) or 2)
        headline = part.pop("score") if headline is None else headline
        part.pop("score", None)
        scores.update(part)
    return {**scores, "score": headline}


def _metric(name: str, preds: Sequence, labels: Sequence, groups: Sequence[str] | None, classes: int) -> dict:
    if name == "record":
        scores = record_scores(preds, labels)
        return {**scores, "score": (scores["f1"] + scores["em"]) / 2}
    if name == "accuracy":
        value = accuracy(preds, labels)
        return {"accuracy": value, "score": value}
    if name == "macro_f1":
        value = macro_f1(preds, labels, classes)
        return {"macro_f1": value, "score": value}
    if name == "matthews":
        value = matthews(preds, labels, classes)
        return {"matthews": value, "score": value}
    if name == "accuracy_macro_f1":
        scores = {"accuracy": accuracy(preds, labels), "f1": macro_f1(preds, labels, classes)}
        return {**scores, "score": (scores["accuracy"] + scores["f1"]) / 2}
    if name == "multirc":
        if groups is None:
            raise ValueError("MultiRC needs the question group of every answer for its exact match")
        scores = {"accuracy": accuracy(preds, labels), **multirc_scores(preds, labels, groups)}
        return {**scores, "score": (scores["f1a"] + scores["em"]) / 2}
    raise ValueError(f"metric {name!r} is not computed for label predictions (generate metrics score texts)")


def superglue_average(scores: dict[str, float]) -> float:
    """Mean of the per-task scores (each a fraction in [0, 1])."""
    if not scores:
        raise ValueError("no task scores to average")
    if any(not 0 <= s <= 1 for s in scores.values()):
        raise ValueError(f"scores must be fractions in [0, 1] (not percentages): {scores}")
    return fmean(scores.values())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the two texts are equal after SQuAD normalisation (lower case; punctuation and the articles a, an,
    the removed; runs of whitespace as one space), else 0.0.

    Example:
        >>> exact_match("The Eiffel Tower.", "eiffel  tower")
        1.0
    """
    return float(_normalize(prediction) == _normalize(reference))


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1: the harmonic mean of precision and recall of the normalised words (see `exact_match`),
    counted as a multiset; 0.0 when no word is shared (also when either text is empty after normalisation).

    Example:
        >>> round(token_f1("Paris, France", "Paris"), 3)
        0.667
    """
    return _token_f1(prediction, reference)
