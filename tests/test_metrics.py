"""SuperGLUE metrics on hand-made cases (values worked out by hand in the comments)."""

from __future__ import annotations

import pytest

from capt.recipes.metrics import (
    accuracy,
    binary_f1,
    macro_f1,
    multirc_scores,
    record_scores,
    superglue_average,
    task_metrics,
)


def test_accuracy():
    assert accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    assert accuracy([-1, 2], [0, 2]) == 0.5  # an unparseable prediction (-1) is simply wrong
    with pytest.raises(ValueError):
        accuracy([1, 0], [1])
    with pytest.raises(ValueError):
        accuracy([], [])


def test_macro_f1():
    # class 0: tp1 fp1 fn0 -> 2/3; class 1: tp2 fp0 fn1 -> 4/5; class 2: tp1 -> 1
    assert macro_f1([0, 0, 1, 1, 2], [0, 1, 1, 1, 2], 3) == pytest.approx((2 / 3 + 4 / 5 + 1) / 3)


def test_macro_f1_counts_a_missing_class_as_zero():
    # class 2 is neither predicted nor present: F1 0 (sklearn's zero_division=0), still in the mean of 3
    assert macro_f1([0, 1, 0], [0, 1, 1], 3) == pytest.approx((2 / 3 + 2 / 3 + 0) / 3)
    # a class that is present but never predicted is 0 as well
    assert macro_f1([0, 0], [0, 1], 2) == pytest.approx((2 / 3 + 0) / 2)
    with pytest.raises(ValueError):
        macro_f1([0], [3], 3)


def test_binary_f1():
    assert binary_f1([1, 1, 0, 0], [1, 0, 1, 0]) == 0.5  # tp1 fp1 fn1
    assert binary_f1([1, 1, 1], [1, 1, 0]) == pytest.approx(0.8)  # tp2 fp1 fn0
    assert binary_f1([0, 0], [0, 0]) == 0.0  # no positive anywhere


def test_multirc_scores_group_by_question():
    preds = [1, 1, 0, 1, 0]
    labels = [1, 1, 0, 0, 0]
    groups = ["q1", "q2", "q1", "q2", "q3"]  # answers of one question need not be adjacent
    scores = multirc_scores(preds, labels, groups)
    assert scores["em"] == pytest.approx(2 / 3)  # q1 and q3 fully right, q2 has one wrong answer
    assert scores["f1a"] == pytest.approx(0.8)  # tp2 fp1 fn0 over all answers
    with pytest.raises(ValueError):
        multirc_scores(preds, labels, groups[:-1])


def test_record_normalisation_and_max_over_answers():
    exact = record_scores(["The Eiffel  Tower!"], [["eiffel tower"]])
    assert exact == {"f1": 1.0, "em": 1.0}  # case, article, punctuation and spaces are normalised
    partial = record_scores(["Paris France"], [["London", "Paris"]])
    assert partial["em"] == 0.0 and partial["f1"] == pytest.approx(2 / 3)  # p 1/2, r 1 against "Paris"
    mean = record_scores(["a dog", "cat"], [["dog"], ["mouse", "the cat"]])
    assert mean == {"f1": 1.0, "em": 1.0}
    assert record_scores(["x", "y"], [["x"], ["z"]]) == {"f1": 0.5, "em": 0.5}
    with pytest.raises(ValueError):
        record_scores(["x"], [[]])


def test_task_metrics():
    rte = task_metrics("rte", [0, 1, 1, 0], [0, 1, 0, 0])
    assert rte == {"accuracy": 0.75, "score": 0.75}
    cb = task_metrics("cb", [0, 1, 0], [0, 1, 1])
    assert cb["accuracy"] == pytest.approx(2 / 3) and cb["f1"] == pytest.approx(4 / 9)
    assert cb["score"] == pytest.approx((2 / 3 + 4 / 9) / 2)
    multirc = task_metrics("multirc", [1, 1, 0, 1, 0], [1, 1, 0, 0, 0], ["q1", "q2", "q1", "q2", "q3"])
    assert multirc["score"] == pytest.approx((0.8 + 2 / 3) / 2) and multirc["accuracy"] == 0.8
    record = task_metrics("record", ["Paris France"], [["Paris"]])
    assert record == pytest.approx({"f1": 2 / 3, "em": 0.0, "score": 1 / 3})
    with pytest.raises(ValueError, match="group"):
        task_metrics("multirc", [1], [1])
    with pytest.raises(ValueError, match="unknown task"):
        task_metrics("mnli", [1], [1])


def test_superglue_average():
    assert superglue_average({"rte": 0.8, "cb": 0.9, "copa": 0.7}) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        superglue_average({})
    with pytest.raises(ValueError, match="percentages"):
        superglue_average({"rte": 80.0})
