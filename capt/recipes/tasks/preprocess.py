"""The named Python preprocessors: what a task's data cannot say in a format string.

Each adds fields a template may name (they never change the example itself). A task file names one in
`preprocess:` (per example) or `option_preprocess:` (per option, given `option`). All of them are the SuperGLUE
tasks' own conventions, kept byte-for-byte as T5 and lm-evaluation-harness write them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preprocessor:
    """A named function of (fields, example) -> new fields; `reads` the fields it needs, `adds` those it makes."""

    function: Callable[..., dict[str, str]]
    reads: tuple[str, ...]
    adds: tuple[str, ...]


def _drop_final_punct(text: str) -> str:
    text = text.strip()
    return text[:-1] if text and text[-1] in ".!?" else text


def lower_first(text: str) -> str:
    """The text with its first character in lower case ("The man" -> "the man")."""
    return text[:1].lower() + text[1:]


def multirc_plain_paragraph(fields: dict[str, str], example: Any) -> dict[str, str]:
    """MultiRC's paragraph without the HTML markup some releases carry (T5's glue() strips it)."""
    return {"plain_paragraph": re.sub(r"</?b>", "", fields["paragraph"].replace("<br>", " "))}


def record_passage(fields: dict[str, str], example: Any) -> dict[str, str]:
    """ReCoRD's passage with its "@highlight" bullet lines joined into running text (T5's record preprocessor),
    as lm-evaluation-harness's bullet list, and its candidate entities joined by commas."""
    text = re.sub(r"([.?!\"'])\n@highlight\n", r"\1 ", fields["passage"])
    initial, *highlights = fields["passage"].strip().split("\n@highlight\n")
    return {
        "joined_passage": re.sub(r"\n@highlight\n", ". ", text),
        "bulleted_passage": initial + "\n\n" + "".join(f"  - {h}.\n" for h in highlights),
        "entity_list": ", ".join(example.candidates),
    }


def record_fill_placeholder(fields: dict[str, str], option: str) -> dict[str, str]:
    """ReCoRD's query with the candidate entity in its @placeholder."""
    return {"filled_query": fields["query"].replace("@placeholder", option)}


def copa_connective(fields: dict[str, str], example: Any) -> dict[str, str]:
    """COPA's premise without its final stop, and the word that joins it to an option: "because" for a cause, else
    "so" (encoders) or "therefore" (lm-evaluation-harness's decoder prompt)."""
    cause = fields["question"] == "cause"
    return {
        "premise_clause": _drop_final_punct(fields["premise"]),
        "because_so": "because" if cause else "so",
        "because_therefore": "because" if cause else "therefore",
    }


def lowered_option(fields: dict[str, str], option: str) -> dict[str, str]:
    """The option with its first letter lowered, to continue a sentence."""
    return {"option_lowered": lower_first(option)}


def wic_target_word(fields: dict[str, str], example: Any) -> dict[str, str]:
    """WiC's word as it is written in sentence 1 (from the character offsets), as lm-evaluation-harness asks it."""
    return {"target_word": fields["sentence1"][int(fields["start1"]) : int(fields["end1"])]}


def _detokenize(text: str) -> str:
    # lm_eval.utils.general_detokenize: WSC texts are whitespace-tokenised ("Bernard , who ...").
    for old, new in ((" n't", "n't"), (" )", ")"), ("( ", "("), ('" ', '"'), (' "', '"')):
        text = text.replace(old, new)
    return re.sub(r" (['.,])", r"\1", text)


def wsc_mark_pronoun(fields: dict[str, str], example: Any) -> dict[str, str]:
    """The WSC text with the pronoun (span2, a whitespace-word index) marked as *pronoun*, as lm-eval does."""
    text, pronoun = fields["text"], fields["span2_text"]
    pre = " ".join(text.split()[: int(fields["span2_index"])])
    start = len(pre) + 1 if pre else 0  # lm-eval assumes a separating space; at index 0 there is none
    marked = f"{pre} *{pronoun}*" if pre else f"*{pronoun}*"
    return {"marked_text": _detokenize(marked + text[start + len(pronoun) :])}


PREPROCESSORS: dict[str, Preprocessor] = {
    "multirc_plain_paragraph": Preprocessor(multirc_plain_paragraph, ("paragraph",), ("plain_paragraph",)),
    "record_passage": Preprocessor(record_passage, ("passage",), ("joined_passage", "bulleted_passage", "entity_list")),
    "copa_connective": Preprocessor(
        copa_connective, ("premise", "question"), ("premise_clause", "because_so", "because_therefore")
    ),
    "wic_target_word": Preprocessor(wic_target_word, ("sentence1", "start1", "end1"), ("target_word",)),
    "wsc_mark_pronoun": Preprocessor(wsc_mark_pronoun, ("text", "span2_text", "span2_index"), ("marked_text",)),
}
OPTION_PREPROCESSORS: dict[str, Preprocessor] = {
    "record_fill_placeholder": Preprocessor(record_fill_placeholder, ("query",), ("filled_query",)),
    "lowered_option": Preprocessor(lowered_option, (), ("option_lowered",)),
}
