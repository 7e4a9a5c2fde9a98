"""Which positions of an analysed sequence are slots, structural tokens or the example's own input.

*Structural* tokens are the ones the task format adds around the example's text: special tokens ([CLS], [SEP],
</s>, ...) and template words ("rte", "hypothesis", ":", "Question", "Answer"). They are found by encoding the
same example with every text field emptied (the *skeleton*) and aligning the skeleton's tokens with the real
ones, so the task files (`capt.recipes.tasks`) stay the only place that knows them. Words a field selects
from the template (COPA's "because"/"so") count as input.
"""

from __future__ import annotations

from dataclasses import replace
from difflib import SequenceMatcher

from transformers import PreTrainedTokenizerBase

from ...config import CaptConfig
from ..data import Example
from ..formats import CausalLMFormat, TaskFormat

SLOT, STRUCTURAL, INPUT = "slot", "structural", "input"


def slot_names(config: CaptConfig | None) -> list[str]:
    """Labels of the slot positions an adapter puts in front of the sequence (none without an adapter).

    Example:
        >>> slot_names(CaptConfig())
        ['[CAPSULE]']
        >>> slot_names(CaptConfig(num_slots=3, instance_aware=False))
        ['[P1]', '[P2]', '[P3]']
        >>> slot_names(CaptConfig(variant="prepend"))
        ['[CAPSULE]', '[MEAN]']
    """
    if config is None:
        return []
    if not config.instance_aware:
        return [f"[P{i + 1}]" for i in range(config.num_slots)]
    names = ["[CAPSULE]"] if config.num_slots == 1 else [f"[CAPSULE{i + 1}]" for i in range(config.num_slots)]
    return names + ["[MEAN]"] if config.variant == "prepend" else names


def skeleton(example: Example) -> Example:
    """The example with every text field emptied: what the format renders is then only its template.

    Example:
        >>> ex = Example("rte", 0, {"premise": "A cat sat.", "hypothesis": "A cat."}, 0)
        >>> skeleton(ex).fields
        {'premise': '', 'hypothesis': ''}
    """
    return replace(example, fields={k: "" if isinstance(v, str) else v for k, v in example.fields.items()})


def structural_positions(fmt: TaskFormat, example: Example, row: int) -> set[int]:
    """Positions in `fmt.encode(example)["rows"][row]["input_ids"]` that hold structural tokens.

    For a decoder-only format the answer continuation at the end of the row is input, not template.

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> from capt.recipes.formats import make_format
        >>> fmt = make_format("encoder", "rte", load_backbone("minilm").tokenizer, 64)
        >>> ex = Example("rte", 0, {"premise": "A cat sat.", "hypothesis": "A cat."}, 0)
        >>> sorted(structural_positions(fmt, ex, 0))  # [CLS] a cat sat . [SEP] a cat . [SEP]
        [0, 5, 9]
    """
    real = fmt.encode(example)["rows"][row]
    template = fmt.encode(skeleton(example))["rows"][row]["input_ids"]
    matcher = SequenceMatcher(None, template, real["input_ids"], autojunk=False)
    positions = {block.b + i for block in matcher.get_matching_blocks() for i in range(block.size)}
    positions |= special_positions(fmt.tokenizer, real["input_ids"])
    if isinstance(fmt, CausalLMFormat):
        positions -= {i for i, label in enumerate(real["labels"]) if label != -100}
    return positions


def special_positions(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> set[int]:
    """Positions of special tokens ([CLS], [SEP], <s>, </s>, padding; an unknown word is not one).

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> tokenizer = load_backbone("minilm").tokenizer
        >>> sorted(special_positions(tokenizer, tokenizer("a cat")["input_ids"]))
        [0, 3]
    """
    special = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}
    return {i for i, token in enumerate(ids) if token in special}


def roles(length: int, slots: int, structural: set[int]) -> list[str]:
    """The role of each position of a sequence of `length` tokens behind `slots` slot positions.

    Example:
        >>> roles(4, 1, {0, 2})
        ['slot', 'structural', 'input', 'structural', 'input']
    """
    return [SLOT] * slots + [STRUCTURAL if i in structural else INPUT for i in range(length)]
