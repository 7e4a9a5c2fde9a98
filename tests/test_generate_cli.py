"""`generate` tasks through the CLI alone: a `messages` jsonl and a prompt/completion jsonl, built from SuperGLUE rows
as a user's files, trained, evaluated, used by `predict` and served, on tiny-llama (its tokenizer carries a small chat
template); early stopping follows the metric the task names; encoders are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from capt.recipes.chat import ChatFormat, request_prompt_ids
from capt.recipes.cli import main

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
QUICK = ["--model", "tiny-llama", "--batch-size", "8", "--max-length", "96", "--lr", "0.05"]


pytestmark = pytest.mark.usefixtures("private_home")  # each test its own feature cache (conftest)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rte_as_chat(split: str, start: int, count: int, shape: str = "messages") -> list[dict]:
    """RTE rows as a user's chat data: the question from the user, "yes" or "no" from the assistant."""
    rows = []
    for row in _jsonl(DATA / "RTE" / f"{split}.jsonl")[start : start + count]:
        question = f"{row['premise'][:120]} Does it follow that {row['hypothesis'][:60]}?"
        answer = "yes" if row["label"] == "entailment" else "no"
        if shape == "messages":
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
        else:
            rows.append({"prompt": question, "completion": answer})
    return rows


def _train(tmp_path: Path, shape: str, *extra: str) -> Path:
    train = _write(tmp_path / "train.jsonl", rte_as_chat("train", 0, 24, shape))
    test = _write(tmp_path / "test.jsonl", rte_as_chat("val", 0, 6, shape))
    out = tmp_path / "run"
    argv = ["train", "--train-file", str(train), "--test-file", str(test), "--task-name", "talk"]
    assert main([*argv, "--output-dir", str(out), "--epochs", "1", *QUICK, *extra]) == 0
    return out


@pytest.mark.parametrize("shape", ["messages", "prompt"])
def test_a_chat_file_trains_evaluates_predicts_and_serves(shape, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from capt.recipes.run import load_run
    from capt.recipes.serve import Limits, build_engine, create_app

    out = _train(tmp_path, shape)
    printed = capsys.readouterr().out
    assert "talk / capt on tiny-llama" in printed and "(headline: loss)" in printed and " score " not in printed
    results = json.loads((out / "results.json").read_text())
    test = {name: value["mean"] for name, value in results["test"].items()}
    assert set(test) == {"loss", "perplexity", "exact_match", "token_f1", "score"}
    assert test["perplexity"] == pytest.approx(math.exp(test["loss"]))
    assert test["score"] == pytest.approx(math.exp(-test["loss"]))  # loss heads the default metrics: 1/perplexity
    assert results["runs"][0]["test_examples"] == 6

    # eval: the same numbers from the run folder
    assert main(["eval", "--adapter", str(out)]) == 0
    evaluated = json.loads((out / "eval-talk-test.json").read_text())
    assert {k: evaluated[k] for k in test} == pytest.approx(test, rel=1e-5)

    # predict: rows without their answer (or with it: then it is the answer asked for, as in training)
    config, model, fmt = load_run(out)
    assert isinstance(fmt, ChatFormat)
    asked = rte_as_chat("val", 6, 3, shape)
    asked[0] = {"prompt": asked[0]["prompt"]} if shape == "prompt" else {"messages": asked[0]["messages"][:1]}
    new = _write(tmp_path / "new.jsonl", asked)
    assert main(["predict", "--run", str(out), "--input", str(new), "--output", str(tmp_path / "p.jsonl")]) == 0
    predictions = _jsonl(tmp_path / "p.jsonl")
    assert [p["row"] for p in predictions] == ["1", "2", "3"] and {p["task"] for p in predictions} == {"talk"}
    stops = fmt.stop_ids(model)
    for row, prediction in zip(asked, predictions, strict=True):
        ids = request_prompt_ids(fmt.tokenizer, row, "row")
        if "completion" in row or len(row.get("messages", [])) == 2:  # the prompt training wrote for this row
            trained = fmt.encode(_example(row))
            assert ids == trained["input_ids"][: trained["instance_length"]]
        with torch.no_grad():
            greedy = model.generate(
                input_ids=torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=stops
            )
        written = greedy[0, len(ids) :].tolist()
        written = written[: next((i for i, t in enumerate(written) if t in stops), len(written))]
        assert prediction["prediction"] == fmt.tokenizer.decode(written, skip_special_tokens=True).strip()

    # serve: the run folder answers chat (and, for prompt rows, plain completions) as `predict` does
    engine = build_engine("tiny-llama", {"talk": out}, Limits())
    try:
        with TestClient(create_app(engine)) as client:
            for row, prediction in zip(asked, predictions, strict=True):
                if shape == "messages":
                    messages = row["messages"][:1]
                    body = {"model": "talk", "messages": messages, "temperature": 0, "max_tokens": 64}
                    answer = client.post("/v1/chat/completions", json=body)
                    assert answer.status_code == 200, answer.text
                    text = answer.json()["choices"][0]["message"]["content"]
                else:
                    body = {"model": "talk", "prompt": row["prompt"], "temperature": 0, "max_tokens": 64}
                    answer = client.post("/v1/completions", json=body)
                    assert answer.status_code == 200, answer.text
                    text = answer.json()["choices"][0]["text"]
                assert text.strip() == prediction["prediction"]
            refused = client.post("/v1/classify", json={"records": [{"task": "talk", **asked[1]}]})
            assert refused.status_code == 422
            assert "generate task 'talk'" in refused.json()["error"]["message"]
            assert "/v1/chat/completions" in refused.json()["error"]["message"]
    finally:
        engine.stop()


def _example(row: dict):
    from capt.recipes.data import Example

    return Example("talk", 0, row, None)


@pytest.mark.parametrize("headline", ["exact_match", "loss"])
def test_early_stopping_follows_the_metric_the_task_names(headline, tmp_path):
    """A task file names its headline metric: the validation score and the best epoch follow it (exact match of
    the untrained-looking tiny model stays 0, so patience 1 stops the run after epoch 2; the loss keeps moving)."""
    rows = rte_as_chat("train", 0, 30)
    for split, part in (("train", rows[:24]), ("validation", rows[24:])):
        _write(tmp_path / f"{split}.jsonl", part)
    metrics = [headline, *[m for m in ("exact_match", "token_f1", "loss", "perplexity") if m != headline]]
    task = {
        "name": "talk",
        "kind": "generate",
        "text_fields": ["messages"],
        "source": {"train": "train.jsonl", "validation": "validation.jsonl"},
        "metrics": metrics,
    }
    (tmp_path / "talk.yaml").write_text(yaml.safe_dump(task))
    out = tmp_path / "run"
    argv = ["train", "--task", str(tmp_path / "talk.yaml"), "--output-dir", str(out), "--epochs", "3"]
    assert main([*argv, "--patience", "1", *QUICK]) == 0
    epochs = [r for r in _jsonl(out / "metrics.jsonl") if r["kind"] == "epoch"]
    results = json.loads((out / "results.json").read_text())["runs"][0]
    if headline == "exact_match":
        assert [r["validation_score"] for r in epochs] == [r["validation_exact_match"] for r in epochs]
        assert all(r["validation_exact_match"] == 0 for r in epochs)
        assert (results["epochs_run"], results["best_epoch"]) == (2, 1)
    else:
        scores = [r["validation_score"] for r in epochs]
        assert scores == pytest.approx([math.exp(-r["validation_loss"]) for r in epochs])
        losses = [r["validation_loss"] for r in epochs]
        assert results["best_epoch"] == 1 + losses.index(min(losses))
    assert results["best_validation_score"] == max(r["validation_score"] for r in epochs)


def test_sweep_and_compare_run_a_generate_task_with_the_frozen_model_as_its_reference(tmp_path):
    """A chat task has no labels: its reference is the zero-shot row alone, the frozen backbone scored as the runs
    are (loss, perplexity, answers), where a majority-label row used to end the sweep with an error."""
    from capt.recipes.backbones import load_backbone

    rows = rte_as_chat("train", 0, 30)
    for split, part in (("train", rows[:20]), ("validation", rows[20:25]), ("test", rows[25:])):
        _write(tmp_path / f"{split}.jsonl", part)
    split_files = {"train": "train.jsonl", "validation": "validation.jsonl", "test": "test.jsonl"}
    task = {"name": "talk", "kind": "generate", "text_fields": ["messages"], "source": split_files}
    (tmp_path / "talk.yaml").write_text(yaml.safe_dump(task))
    common = ["--tasks", str(tmp_path / "talk.yaml"), "--methods", "capt", "--epochs", "1", *QUICK[:-2]]
    assert main(["sweep", *common, "--lr-grid", "capt=0.05", "--output-dir", str(tmp_path / "sweep")]) == 0
    [[zero_shot]] = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["references"]
    assert zero_shot["method"] == "zero-shot" and "majority" not in (tmp_path / "sweep" / "sweep.md").read_text()
    backbone = load_backbone("tiny-llama")
    fmt = ChatFormat("talk", backbone.tokenizer, 96, metric="loss")  # the task's first metric, its default
    frozen = fmt.evaluate(backbone.model, [fmt.encode(_example(row)) for row in rows[25:]], batch_size=8)
    assert zero_shot["test"] == pytest.approx(frozen)  # loss, perplexity, exact match, token F1, score
    assert main(["compare", *common, "--lr", "0.05", "--output-dir", str(tmp_path / "compare")]) == 0
    table = (tmp_path / "compare" / "comparison.md").read_text().splitlines()
    assert table[0].startswith("| method | talk |") and table[2].startswith("| capt |")


@pytest.mark.parametrize(
    ("flags", "backbone"),
    [(["--model", "minilm"], "an encoder model"), (["--model", "tiny-t5"], "an encoder-decoder model")],
)
def test_a_generate_task_on_an_encoder_is_refused_in_one_line(flags, backbone, tmp_path, capsys):
    train = _write(tmp_path / "chat.jsonl", rte_as_chat("train", 0, 20))
    out = tmp_path / "run"
    assert main(["train", "--train-file", str(train), "--output-dir", str(out), "--epochs", "1", *flags]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("capt train: error: --model: ")
    error = errors[0]
    assert "chat is a generate task, which needs a decoder-only LM" in error and backbone in error
    assert "--model smollm2" in error  # the fix
    assert not (out / "results.json").exists()


def test_a_generate_task_with_a_classifier_head_is_refused(tmp_path, capsys):
    train = _write(tmp_path / "chat.jsonl", rte_as_chat("train", 0, 20))
    argv = ["train", "--train-file", str(train), "--output-dir", str(tmp_path / "r"), "--decoder-head", "classifier"]
    assert main([*argv, "--model", "tiny-llama"]) == 1
    assert "a decoder with --decoder-head classifier" in capsys.readouterr().err


def test_a_generate_run_is_refused_where_labels_are_scored(tmp_path, capsys):
    out = _train(tmp_path, "messages")
    capsys.readouterr()
    asked = _write(tmp_path / "mixed.jsonl", [{"task": "talk", **rte_as_chat("val", 0, 1)[0]}])
    bank = ["predict", "--adapters", f"talk={out}", "--input", str(asked), "--output", str(tmp_path / "p.jsonl")]
    assert main(bank) == 1
    assert f"{out} is a generate run: a bank scores labels" in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()
    assert main(["eval", "--adapter", str(out), "--task", "cb"]) == 1
    assert "talk, a generate task" in capsys.readouterr().err
