"""Proof of no change: every built-in task, in every backbone family, reads exactly as it did before the task layer.

The golden values come from the code of commit 76f8d4c (tests/fixtures/make_template_golden.py says how they were
made): every example's prompts, label words and pairs (hashed, the first kept verbatim), and the token ids of the
first 40 examples of each split through each family's format, decoders with the recorded `prompt_bos: always`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from capt.recipes.backbones import model_source
from capt.recipes.formats import encode_prompt, make_format

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
# The generator's own helpers, so the test renders exactly what it rendered (through today's API).
_spec = importlib.util.spec_from_file_location("golden", Path(__file__).parent / "fixtures" / "make_template_golden.py")
golden_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden_script)
FORMATS, IDS_PER_SPLIT, digest, splits, texts = (
    golden_script.FORMATS,
    golden_script.IDS_PER_SPLIT,
    golden_script.digest,
    golden_script.splits,
    golden_script.texts,
)
GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "template_golden.json").read_text())


@pytest.fixture(scope="module")
def tokenizers():
    return {name: AutoTokenizer.from_pretrained(model_source(name)) for _, name, _ in FORMATS}


@pytest.mark.parametrize("task", sorted(GOLDEN))
def test_prompts_label_words_and_token_ids_are_unchanged(task, tokenizers):
    for split, examples in splits(task, DATA).items():
        golden = GOLDEN[task][split]
        assert len(examples) == golden["count"]
        all_texts = [texts(task, ex) for ex in examples]
        assert json.loads(json.dumps(all_texts[0])) == golden["first_texts"]
        assert digest(all_texts) == golden["texts_sha256"]
        for family, name, max_length in FORMATS:
            if family == "encoder-decoder" and task == "copa":
                continue  # raised before: see test_t5_copa_scores_its_label_words
            tokenizer = tokenizers[name]
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            fmt = make_format(family, task, tokenizer, max_length, prompt_bos="always")
            rows = [[dict(row) for row in fmt.encode(ex)["rows"]] for ex in examples[:IDS_PER_SPLIT]]
            assert digest(rows) == golden["ids"][name], (task, split, name)


def test_the_new_default_adds_a_bos_only_where_the_tokenizer_does(tokenizers):
    smollm2 = tokenizers["smollm2"]
    ex = splits("cb", DATA)["val"][0]
    legacy = make_format("decoder", "cb", smollm2, 256, prompt_bos="always").encode(ex)["rows"][0]["input_ids"]
    new = make_format("decoder", "cb", smollm2, 256).encode(ex)["rows"][0]["input_ids"]
    assert legacy[0] == smollm2.bos_token_id and legacy[1:] == new  # SmolLM2's tokenizer never adds <|im_start|>
    assert encode_prompt(smollm2, "Hello") == smollm2("Hello")["input_ids"]


def test_t5_copa_scores_its_label_words(tokenizers):
    """Before the task layer T5 had no targets for COPA (it raised); now it scores T5's words choice1 / choice2."""
    ex = splits("copa", DATA)["val"][0]
    features = make_format("encoder-decoder", "copa", tokenizers["tiny-t5"], 256).encode(ex)
    assert features["option_texts"] == ["choice1", "choice2"]
