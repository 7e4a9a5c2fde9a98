"""Smoke test of `capt bench`: a tiny grid end to end, and the structure of what it writes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import bert_config
from transformers import BertForSequenceClassification

from capt.recipes.backbones import Backbone, RandomSize
from capt.recipes.bench import main
from capt.recipes.bench.methods import parse_methods
from capt.recipes.bench.run import Options, _fitting_lengths

TINY = ["--width", "64", "--layers", "1", "--vocab", "128", "--batch-size", "2", "--repeats", "1"]
CELL_KEYS = {"tokens", "wall_s", "cpu_s", "median_s", "ratio", "peak_bytes", "memory_ratio"}


def test_bench_writes_json_markdown_and_png(tmp_path):
    threads = torch.get_num_threads()
    argv = [*TINY, "--backbones", "llama,t5", "--lengths", "8", "--methods", "capt-add,prompt-tuning-20"]
    argv += ["--gen-lengths", "8", "--gen-new-tokens", "2", "--out", str(tmp_path), "--name", "smoke"]
    assert main(argv) == 0
    assert torch.get_num_threads() == threads  # main() restores what it changed

    data = json.loads((tmp_path / "smoke.json").read_text())
    assert data["meta"]["command"].startswith("capt bench ")
    assert {"torch", "transformers", "peft", "capt"} <= set(data["meta"]["environment"]["versions"])
    assert data["config"]["methods"] == ["floor", "capt-add", "prompt-tuning-20"]
    for backbone in ("llama", "t5"):
        methods = data["backbones"][backbone]["methods"]
        assert list(methods) == ["floor", "capt-add", "prompt-tuning-20"]
        for method in methods.values():
            cell = method["train"]["8"]
            assert set(cell) == CELL_KEYS and cell["tokens"] == 8 and cell["peak_bytes"] > 0
        assert methods["floor"]["train"]["8"]["ratio"] == 1.0
        assert methods["floor"]["trainable"] == 0 and methods["capt-add"]["trainable"] == 64  # 1 layer x d=64

    generate = data["backbones"]["llama"]["generate"]["lengths"]["8"]
    assert set(generate) == {"floor", "capt-add"}  # prompt-tuning-100 was not selected
    # With a KV cache the first layer sees the prompt once and then one position per further new token.
    assert generate["floor"]["layer0_positions"] == 8 + 1
    assert generate["capt-add"]["layer0_positions"] == 8 + 1 + 1  # plus the capsule slot
    assert "generate" not in data["backbones"]["t5"]

    targets = {check["target"] for check in data["targets"]}
    assert targets == {
        "train <= 1.05x floor",
        "faster than prompt-style peers",
        "memory <= prompt-style peers",
        "generate <= 1.03x base",
    }
    markdown = (tmp_path / "smoke.md").read_text()
    assert "## Targets" in markdown and "## llama" in markdown and "## t5" in markdown
    assert "![cost vs. length](smoke.png)" in markdown
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_absolute_positions_cap_the_length_for_every_method():
    bert = Backbone(BertForSequenceClassification(bert_config()), None, "encoder", "bert", "tiny BERT")
    options = Options(
        backbones=["bert"],
        lengths=[16, 60],
        methods=parse_methods("capt-add,prompt-tuning-20"),
        batch_size=1,
        repeats=1,
        warmup=0,
        random_size=RandomSize(),
        gen_lengths=[],
        gen_new_tokens=1,
        gen_batch_size=1,
        seed=0,
        clock="cpu",
    )
    notes = []
    # 64 positions, 20 of them for the longest prompt: 60 user tokens run as 44.
    assert _fitting_lengths(bert, options, notes) == [(16, 16), (60, 44)]
    assert len(notes) == 1 and "N=44" in notes[0]


@pytest.mark.parametrize("argv", [["--methods", "nope"], ["--backbones", "gpt5"], ["--lengths", "0"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        main(argv)
