"""`capt predict`: one backbone, a bank of task adapters, one input file mixing the tasks."""

import json
from pathlib import Path

import pytest
import torch

from capt.recipes.cli import main
from capt.recipes.data import TASKS, load_split
from capt.recipes.evaluate import encode_cached
from capt.recipes.run import load_run

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
QUICK = ["--limit-train", "16", "--limit-eval", "8", "--batch-size", "8", "--epochs", "1", "--data-dir", str(DATA)]


pytestmark = pytest.mark.usefixtures("private_home")  # each test its own feature cache (conftest)


@pytest.mark.parametrize("rte_method", ["capt", "capt-rms"])  # a bank may mix CaPT's two means
def test_mixed_task_file_gets_what_each_run_predicts_alone(rte_method, tmp_path):
    runs = {}
    for task, lr, method in (("cb", "0.5", "capt"), ("rte", "0.3", rte_method)):  # large rates: clearly different
        runs[task] = tmp_path / task
        argv = ["train", "--model", "tiny-llama", "--task", task, "--method", method, "--lr", lr]
        argv += ["--output-dir", str(runs[task])]
        assert main([*argv, *QUICK]) == 0

    lines, expected = [], []
    for task in ("cb", "rte"):
        examples = load_split(task, "val", DATA)[:3]
        config, model, fmt = load_run(runs[task])
        with torch.no_grad():
            predicted = fmt.predict(model, fmt.collate(encode_cached(fmt, examples, config)))
        expected += [(task, ex.idx, TASKS[task].labels[p]) for ex, p in zip(examples, predicted, strict=True)]
        raw = (DATA / TASKS[task].folder / "val.jsonl").read_text().splitlines()[:3]
        lines += [json.dumps({**json.loads(line), "task": task}) for line in raw]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([lines[0], lines[3], lines[1], lines[4], lines[2], lines[5]]) + "\n")

    out = tmp_path / "predictions.jsonl"
    assert (
        main(
            ["predict", "--adapters", f"cb={runs['cb']},rte={runs['rte']}", "--input", str(mixed), "--output", str(out)]
        )
        == 0
    )
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert sorted((r["task"], r["idx"], r["prediction"]) for r in got) == sorted(expected)


def test_a_line_for_an_unknown_task_names_file_and_line(tmp_path, capsys):
    run = tmp_path / "rte"
    assert main(["train", "--model", "tiny-llama", "--task", "rte", "--output-dir", str(run), *QUICK]) == 0
    bad = tmp_path / "in.jsonl"
    bad.write_text(json.dumps({"task": "cb", "premise": "a", "hypothesis": "b", "idx": 0}) + "\n")
    assert main(["predict", "--adapters", f"rte={run}", "--input", str(bad), "--output", str(tmp_path / "o")]) == 1
    assert f"{bad}:1" in capsys.readouterr().err
