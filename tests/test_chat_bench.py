"""`capt bench chat`: the CaPT training step on chat data against the frozen model's forward and backward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capt.recipes.backbones import load_backbone
from capt.recipes.bench import main as bench
from capt.recipes.bench.chat_step import chat_rows, floor_loss
from capt.recipes.chat import ChatFormat
from capt.recipes.data import load_split

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"


def test_bench_chat_runs_on_a_tiny_model_and_writes_its_ratios(tmp_path, capsys):
    out = tmp_path / "chat.json"
    argv = ["chat", "--model", "tiny-llama", "--batch-size", "2", "--batches", "2", "--repeats", "3", "--warmup", "1"]
    assert bench([*argv, "--max-length", "96", "--data-dir", str(DATA), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["times"]) == {"capt", "floor", "floor-full-logits"}
    assert all(len(seconds["cpu"]) == 3 for seconds in result["times"].values())
    summary = result["summary"]
    assert summary["ratio_to_floor"] > 0 and summary["meets_target"] == (summary["ratio_to_floor"] <= 1.05)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert result["command"].startswith("capt bench chat --model tiny-llama")


def test_the_floor_loss_is_the_models_own_loss_at_the_answer():
    backbone = load_backbone("tiny-llama")
    fmt = ChatFormat("rte-chat", backbone.tokenizer, 96)
    rows = chat_rows(str(DATA), 3)
    originals = load_split("rte", "val", DATA)[:3]
    assert [r.fields["completion"] for r in rows] == [("True", "False")[o.label] for o in originals]
    assert rows[0].fields["prompt"].startswith(originals[0].fields["premise"])
    inputs = fmt.collate([fmt.encode(r) for r in rows])["train_inputs"]
    kept = floor_loss(backbone.model, inputs, full_logits=False)
    full = floor_loss(backbone.model, inputs, full_logits=True)
    assert kept.item() == pytest.approx(full.item(), abs=1e-5)
