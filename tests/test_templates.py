"""Templates on a real example of every task, and choice index == label id everywhere."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from capt.recipes.data import (
    TASKS,
    Example,
    encoder_choices,
    encoder_text,
    is_choice_task,
    lm_choices,
    lm_prompt,
    load_split,
    t5_input,
    t5_label_words,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
RECORD_TRAIN = DATA.parent / "fewglue" / "ReCoRD" / "train.jsonl"
LABEL_TASKS = ["boolq", "cb", "multirc", "rte", "wic", "wsc"]


@pytest.fixture(scope="module")
def val(tmp_path_factory) -> dict[str, list[Example]]:
    """Official validation examples of every task; ReCoRD from its FewGLUE subset (official format)."""
    examples = {task: load_split(task, "val", DATA) for task in LABEL_TASKS + ["copa"]}
    root = tmp_path_factory.mktemp("record")
    (root / "ReCoRD").mkdir()
    (root / "ReCoRD" / "train.jsonl").symlink_to(RECORD_TRAIN)
    examples["record"] = load_split("record", "train", root)
    return examples


def test_choice_tasks():
    assert [task for task in TASKS if is_choice_task(task)] == ["copa", "record"]


def test_encoder_pairs(val):
    rte, boolq, wic, wsc, multirc = (val[t][0] for t in ("rte", "boolq", "wic", "wsc", "multirc"))
    assert encoder_text(rte) == (rte.fields["premise"], "Christopher Reeve had an accident.")
    assert encoder_text(boolq) == (boolq.fields["question"], boolq.fields["passage"])
    assert boolq.fields["question"] == "does ethanol take more energy make that produces"
    assert encoder_text(wic) == ("class: An emerging professional class.", wic.fields["sentence2"])
    assert encoder_text(wsc) == (wsc.fields["text"], "him refers to anyone")
    assert encoder_text(multirc)[1] == (
        "Would the mass of a baseball affect how much force you have to use to pick it up? No"
    )
    with pytest.raises(ValueError, match="encoder_choices"):
        encoder_text(val["copa"][0])
    with pytest.raises(ValueError, match="encoder_text"):
        encoder_choices(rte)


def test_encoder_choices(val):
    effect = val["copa"][0]  # "The man turned on the faucet." effect; label 1
    assert encoder_choices(effect) == [
        ("The man turned on the faucet so", "the toilet filled with water."),
        ("The man turned on the faucet so", "water flowed from the spout."),
    ]
    cause = next(ex for ex in val["copa"] if ex.fields["question"] == "cause")
    assert all(text.endswith(" because") for text, _ in encoder_choices(cause))
    record = val["record"][0]
    pairs = encoder_choices(record)
    assert len(pairs) == len(record.candidates)
    assert "Olimpija Ljubljana made it difficult" in pairs[record.label][1]
    assert all("@placeholder" not in q and "@highlight" not in p for p, q in pairs)


def test_t5_inputs(val):
    assert t5_input(val["rte"][0]) == (
        "rte hypothesis: Christopher Reeve had an accident. premise: Dana Reeve, the widow of the actor "
        "Christopher Reeve, has died of lung cancer at age 44, according to the Christopher Reeve "
        "Foundation."
    )
    assert t5_input(val["copa"][0]) == (
        "copa choice1: The toilet filled with water. choice2: Water flowed from the spout. "
        "premise: The man turned on the faucet. question: effect"
    )
    assert t5_input(val["wic"][0]).startswith("wic sentence1: An emerging professional class. sentence2: ")
    assert t5_input(val["wic"][0]).endswith(" word: class")
    assert t5_input(val["boolq"][0]).startswith("boolq passage: Ethanol fuel -- ")
    assert " question: does ethanol take" in t5_input(val["boolq"][0])
    assert t5_input(val["cb"][0]).startswith("cb hypothesis: Valence was helping premise: Valence the void")
    assert t5_input(val["multirc"][0]).startswith(
        "multirc question: Would the mass of a baseball affect how much force you have to use to pick it up? "
        "answer: No paragraph: What causes"
    )
    assert t5_input(val["wsc"][0]).startswith("wsc span1_text: anyone span2_text: him text: Bernard , who")
    record = t5_input(val["record"][0])
    assert record.startswith("record query: Speaking after the game") and "@highlight" not in record
    assert "the best thing was that @placeholder made it difficult. entities: " in record
    assert " entities: Blues, Branislav Ivanovic, " in record and " passage: By Hamish Mackay " in record
    assert "horror miss. Chelsea come from behind" in record  # a highlight joined as a sentence


def test_t5_strips_multirc_markup(val):
    ex = val["multirc"][0]
    marked = replace(ex, fields={**ex.fields, "paragraph": "<b>Sent 1: </b>One.<br><b>Sent 2: </b>Two."})
    assert t5_input(marked).endswith("paragraph: Sent 1: One. Sent 2: Two.")


@pytest.mark.parametrize(
    "task,words",
    [
        ("cb", ["entailment", "contradiction", "neutral"]),
        ("rte", ["entailment", "not_entailment"]),
        ("copa", ["choice1", "choice2"]),
        ("boolq", ["False", "True"]),
        ("multirc", ["False", "True"]),
    ],
)
def test_t5_label_words(task, words):
    assert t5_label_words(task) == words


def test_lm_prompts(val):
    rte = val["rte"][0]
    question = "\nQuestion: Christopher Reeve had an accident. True or False?\nAnswer:"
    assert lm_prompt(rte) == rte.fields["premise"] + question
    boolq = lm_prompt(val["boolq"][0])
    assert boolq.endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    cb = lm_prompt(val["cb"][0])
    assert cb.endswith("he was helping?\nQuestion: Valence was helping. True, False, or Neither?\nAnswer:")
    assert lm_prompt(val["copa"][0]) == "The man turned on the faucet therefore"
    assert "Question: Is the word 'class' used in the same way" in lm_prompt(val["wic"][0])
    wsc = lm_prompt(val["wsc"][0])
    assert wsc.startswith("Passage: Bernard, who had") and "take his claim away from *him*.\n" in wsc
    assert wsc.endswith('does the pronoun "*him*" refer to "*anyone*"?\nAnswer:')
    multirc = lm_prompt(val["multirc"][0])
    assert multirc.endswith("force you have to use to pick it up?\nAnswer: No\nIs the answer correct?")
    record = lm_prompt(val["record"][0])
    assert "horror miss\n\n  - Chelsea come from behind" in record and record.endswith("make it 3-1.\n")


def test_lm_wsc_marks_a_pronoun_at_index_zero(val):
    ex = val["wsc"][0]
    first = replace(ex, fields={**ex.fields, "text": "He left .", "span2_text": "He", "span2_index": 0})
    assert lm_prompt(first).startswith("Passage: *He* left.\n")


@pytest.mark.parametrize(
    "task,label,word",
    [
        ("rte", 0, " True"),
        ("rte", 1, " False"),
        ("cb", 2, " Neither"),
        ("boolq", 1, " yes"),
        ("wic", 0, " no"),
        ("wsc", 1, " yes"),
        ("multirc", 1, " yes"),
    ],
)
def test_lm_choice_index_is_label_id(val, task, label, word):
    assert lm_choices(val[task][0])[label] == word
    assert len(lm_choices(val[task][0])) == len(TASKS[task].labels)


def test_choice_tasks_put_the_gold_at_the_label_index(val):
    for ex in val["copa"]:
        gold = ex.fields[f"choice{ex.label + 1}"]
        assert lm_choices(ex)[ex.label] == " " + gold[0].lower() + gold[1:]
        assert encoder_choices(ex)[ex.label][1] == gold[0].lower() + gold[1:]
    for ex in val["record"]:
        gold = ex.candidates[ex.label]
        assert gold in ex.answers and len(lm_choices(ex)) == len(ex.candidates)
        assert lm_choices(ex)[ex.label] == "  - " + ex.fields["query"].replace("@placeholder", gold)
