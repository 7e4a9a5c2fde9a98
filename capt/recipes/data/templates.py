"""An Example as the strings each backbone family consumes; tokenisation happens elsewhere.

Everywhere the choice (or label-word) index equals the label id, so argmax over choices is the predicted
label.
Encoder pairs follow common BERT/RoBERTa SuperGLUE setups, T5 strings the original text-to-text formats, and
decoder prompts lm-evaluation-harness (`lm_eval/tasks/super_glue/*/default.yaml`).
"""

from __future__ import annotations

import re

from .superglue import TASKS, Example

_CHOICE_TASKS = ("copa", "record")


def is_choice_task(task: str) -> bool:
    """True for tasks scored as a choice among per-example options (COPA, ReCoRD) rather than fixed labels."""
    return task in _CHOICE_TASKS


def _paragraph(text: str) -> str:
    # T5's glue() strips the HTML markup that MultiRC paragraphs carry in some releases.
    return re.sub(r"</?b>", "", text.replace("<br>", " "))


def _record_passage(text: str) -> str:
    # T5's record preprocessor joins the "@highlight" bullet lines into running text.
    text = re.sub(r"([.?!\"'])\n@highlight\n", r"\1 ", text)
    return re.sub(r"\n@highlight\n", ". ", text)


def _fill(query: str, entity: str) -> str:
    return query.replace("@placeholder", entity)


def _drop_final_punct(text: str) -> str:
    text = text.strip()
    return text[:-1] if text and text[-1] in ".!?" else text


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _strs(example: Example) -> dict[str, str]:
    return {key: str(value) for key, value in example.fields.items()}


def _require(example: Example, choice: bool) -> None:
    if is_choice_task(example.task) != choice:
        use = "encoder_choices" if is_choice_task(example.task) else "encoder_text"
        raise ValueError(f"{example.task} needs {use}")


def encoder_text(example: Example) -> tuple[str, str | None]:
    """(text, text_pair) for a sentence-pair classifier (BERT/RoBERTa style); not for COPA/ReCoRD."""
    _require(example, choice=False)
    f, task = _strs(example), example.task
    if task in ("cb", "rte"):
        return f["premise"], f["hypothesis"]
    if task == "boolq":
        return f["question"], f["passage"]
    if task == "wic":
        return f"{f['word']}: {f['sentence1']}", f["sentence2"]
    if task == "wsc":
        return f["text"], f"{f['span2_text']} refers to {f['span1_text']}"
    return _paragraph(f["paragraph"]), f"{f['question']} {f['answer']}"


def encoder_choices(example: Example) -> list[tuple[str, str]]:
    """One (text, text_pair) per choice of a choice task: COPA's two alternatives or ReCoRD's candidates."""
    _require(example, choice=True)
    f = _strs(example)
    if example.task == "copa":
        context = f"{_drop_final_punct(f['premise'])} {'because' if f['question'] == 'cause' else 'so'}"
        return [(context, _lower_first(f[key])) for key in ("choice1", "choice2")]
    passage = _record_passage(f["passage"])
    return [(passage, _fill(f["query"], entity)) for entity in example.candidates]


# Key order of T5's glue(): alphabetical, except MultiRC and WiC whose order glue_utils fixes. WSC is the
# binary "candidate span -> True/False" form with its text fields in the same alphabetical order.
_T5_KEYS = {
    "boolq": ("passage", "question"),
    "cb": ("hypothesis", "premise"),
    "copa": ("choice1", "choice2", "premise", "question"),
    "multirc": ("question", "answer", "paragraph"),
    "rte": ("hypothesis", "premise"),
    "wic": ("sentence1", "sentence2", "word"),
    "wsc": ("span1_text", "span2_text", "text"),
}


def t5_input(example: Example) -> str:
    """T5 text-to-text input, e.g. "rte hypothesis: ... premise: ..."."""
    f = _strs(example)
    if example.task == "record":
        return (
            f"record query: {f['query']} entities: {', '.join(example.candidates)} "
            f"passage: {_record_passage(f['passage'])}"
        )
    if example.task == "multirc":
        f["paragraph"] = _paragraph(f["paragraph"])
    return " ".join([example.task] + [f"{key}: {f[key]}" for key in _T5_KEYS[example.task]])


def t5_label_words(task: str) -> list[str]:
    """T5 target words in label-id order (ReCoRD has none: its targets are the example's entities)."""
    if task == "record":
        raise ValueError("ReCoRD targets are the example's candidate entities, not fixed label words")
    return list(TASKS[task].labels)


def _detokenize(text: str) -> str:
    # lm_eval.utils.general_detokenize: WSC texts are whitespace-tokenised ("Bernard , who ...").
    for old, new in ((" n't", "n't"), (" )", ")"), ("( ", "("), ('" ', '"'), (' "', '"')):
        text = text.replace(old, new)
    return re.sub(r" (['.,])", r"\1", text)


def _wsc_passage(f: dict[str, str]) -> str:
    """The WSC text with the pronoun (span2, a whitespace-word index) marked as *pronoun*, as lm-eval does."""
    text, pronoun = f["text"], f["span2_text"]
    pre = " ".join(text.split()[: int(f["span2_index"])])
    start = len(pre) + 1 if pre else 0  # lm-eval assumes a separating space; at index 0 there is none
    marked = f"{pre} *{pronoun}*" if pre else f"*{pronoun}*"
    return _detokenize(marked + text[start + len(pronoun) :])


def lm_prompt(example: Example) -> str:
    """Decoder-only prompt; each of `lm_choices` is scored as its continuation by log-likelihood."""
    f, task = _strs(example), example.task
    if task == "boolq":
        return f"{f['passage']}\nQuestion: {f['question']}?\nAnswer:"
    if task == "cb":
        return f"{f['premise']}\nQuestion: {f['hypothesis']}. True, False, or Neither?\nAnswer:"
    if task == "rte":
        return f"{f['premise']}\nQuestion: {f['hypothesis']} True or False?\nAnswer:"
    if task == "copa":
        return f"{_drop_final_punct(f['premise'])} {'because' if f['question'] == 'cause' else 'therefore'}"
    if task == "wic":
        word = f["sentence1"][int(f["start1"]) : int(f["end1"])]
        return (
            f"Sentence 1: {f['sentence1']}\nSentence 2: {f['sentence2']}\nQuestion: Is the word '{word}' "
            "used in the same way in the two sentences above?\nAnswer:"
        )
    if task == "wsc":
        return (
            f"Passage: {_wsc_passage(f)}\nQuestion: In the passage above, does the pronoun "
            f'"*{f["span2_text"]}*" refer to "*{f["span1_text"]}*"?\nAnswer:'
        )
    if task == "multirc":
        # lm-eval puts the answer into each choice; here it is in the prompt so the choices are plain no/yes.
        return f"{_paragraph(f['paragraph'])}\nQuestion: {f['question']}\nAnswer: {f['answer']}\nIs the answer correct?"
    initial, *highlights = f["passage"].strip().split("\n@highlight\n")
    return initial + "\n\n" + "".join(f"  - {h}.\n" for h in highlights)


_LM_WORDS = {
    "boolq": (" no", " yes"),
    "cb": (" True", " False", " Neither"),
    "rte": (" True", " False"),
    "wic": (" no", " yes"),
    "wsc": (" no", " yes"),
    "multirc": (" no", " yes"),
}


def lm_choices(example: Example) -> list[str]:
    """Continuations to score after `lm_prompt`, indexed by label id."""
    f = _strs(example)
    if example.task == "copa":
        return [" " + _lower_first(f[key]) for key in ("choice1", "choice2")]
    if example.task == "record":
        return [f"  - {_fill(f['query'], entity)}" for entity in example.candidates]
    return list(_LM_WORDS[example.task])
