"""`python -m capt.recipes.bench.lengths`: untruncated example lengths, checked against the tokenizer itself."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from capt.recipes.backbones import model_source
from capt.recipes.bench.lengths import main, summarise, task_lengths
from capt.recipes.data import paper_splits
from capt.recipes.data.templates import lm_choices, lm_prompt
from capt.recipes.formats import make_format

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"


def test_lengths_are_prompt_plus_longest_option_and_the_limit_truncates_exactly_those():
    lengths = task_lengths("tiny-llama", "cb", DATA, first=12)
    tokenizer = AutoTokenizer.from_pretrained(model_source("tiny-llama"))
    examples = paper_splits("cb", DATA)["train"][:12]
    expected = [
        len(tokenizer((tokenizer.bos_token or "") + lm_prompt(ex), add_special_tokens=False)["input_ids"])
        + max(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in lm_choices(ex))
        for ex in examples
    ]
    assert lengths == expected
    limit = sorted(lengths)[len(lengths) // 2]
    fmt = make_format("decoder", "cb", tokenizer, limit)
    for ex, n in zip(examples, lengths, strict=True):
        assert fmt.length(fmt.encode(ex)) == min(n, limit)  # longer examples are cut to the limit, others kept


def test_summary_shares_and_written_files(tmp_path):
    summary = summarise("cb", [5, 1, 9, 3], [4, 9])
    assert (summary["median"], summary["max"], summary["truncated"]) == (4, 9, {"4": 0.5, "9": 0.0})
    out = tmp_path / "lengths"
    args = ["--model", "tiny-llama", "--tasks", "copa", "--first", "6", "--limits", "8,64"]
    assert main([*args, "--data-dir", str(DATA), "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert rows[0]["task"] == "copa" and rows[0]["examples"] == 6
    assert "| copa | 6 |" in out.with_suffix(".md").read_text()
