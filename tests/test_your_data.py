"""Your own data through the CLI: a CSV of sentence pairs and a choice task, trained, evaluated and predicted; task
files round-tripped; and every kind of bad input told in one line that names the file, line and field."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from capt.recipes.cli import main
from capt.recipes.data import DataFormatError
from capt.recipes.tasks import TaskSpec, TaskSpecError, get_task, read_task_file, task_splits, write_task_file

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
QUICK = ["--model", "tiny-llama", "--epochs", "1", "--batch-size", "8", "--max-length", "96"]


pytestmark = pytest.mark.usefixtures("private_home")  # each test its own feature cache (conftest)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rte_as_csv(path: Path, split: str, count: int, label: bool = True) -> Path:
    """RTE rows as a user's CSV: columns sentence1, sentence2, label with labels yes / no."""
    rows = _jsonl(DATA / "RTE" / f"{split}.jsonl")[:count]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sentence1", "sentence2", *(["label"] if label else [])])
        for row in rows:
            answer = ["yes" if row["label"] == "entailment" else "no"] if label else []
            writer.writerow([row["premise"], row["hypothesis"], *answer])
    return path


def copa_as_choice(path: Path, split: str, count: int) -> Path:
    """COPA rows as a user's choice jsonl: a context, a list of options and the answer's index."""
    with path.open("w", encoding="utf-8") as handle:
        for row in _jsonl(DATA / "COPA" / f"{split}.jsonl")[:count]:
            context = f"{row['premise']} What was the {row['question']}?"
            record = {"context": context, "options": [row["choice1"], row["choice2"]], "answer": row["label"]}
            handle.write(json.dumps(record) + "\n")
    return path


def test_csv_sentence_pairs_train_eval_predict(tmp_path, capsys):
    train, test = rte_as_csv(tmp_path / "train.csv", "train", 60), rte_as_csv(tmp_path / "test.csv", "val", 16)
    out = tmp_path / "run"
    flags = ["--train-file", str(train), "--test-file", str(test), "--text-fields", "sentence1,sentence2"]
    argv = ["train", *flags, "--label-field", "label", "--task-name", "pairs", "--output-dir", str(out), *QUICK]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "pairs / capt on tiny-llama" in printed and ": test accuracy" in printed
    results = json.loads((out / "results.json").read_text())
    run = results["runs"][0]
    assert run["test_examples"] == 16 and "scored_split" not in results
    assert run["train_examples"] == 54  # 60 rows less the 10% stratified validation carve (6)
    spec = read_task_file(out / "task.yaml")
    assert (spec.kind, spec.labels, spec.text_fields) == ("classify", ("no", "yes"), ("sentence1", "sentence2"))

    assert main(["eval", "--adapter", str(out)]) == 0
    evaluated = json.loads((out / "eval-pairs-test.json").read_text())
    assert evaluated["accuracy"] == pytest.approx(results["test"]["accuracy"]["mean"])

    new = rte_as_csv(tmp_path / "new.csv", "val", 5, label=False)
    assert main(["predict", "--run", str(out), "--input", str(new), "--output", str(tmp_path / "p.jsonl")]) == 0
    predictions = _jsonl(tmp_path / "p.jsonl")
    assert [p["row"] for p in predictions] == ["2", "3", "4", "5", "6"]  # the file's lines (1 is the header)
    assert {p["prediction"] for p in predictions} <= {"no", "yes"}


def test_without_a_test_file_the_run_reports_validation_scores_and_says_so(tmp_path, capsys):
    train = rte_as_csv(tmp_path / "pairs.csv", "train", 40)
    out = tmp_path / "run"
    argv = ["train", "--train-file", str(train), "--text-fields", "sentence1,sentence2", "--label-field", "label"]
    assert main([*argv, "--output-dir", str(out), *QUICK]) == 0
    assert "validation (no test file: these are validation scores)" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["scored_split"] == "validation" and results["runs"][0]["test_examples"] == 4
    assert results["task"] == "pairs"  # named after the file


def test_choice_task_train_eval_predict(tmp_path, capsys):
    train, test = copa_as_choice(tmp_path / "train.jsonl", "train", 40), copa_as_choice(tmp_path / "t.jsonl", "val", 10)
    out = tmp_path / "run"
    flags = ["--train-file", str(train), "--test-file", str(test), "--text-fields", "context"]
    argv = ["train", *flags, "--choices-field", "options", "--label-field", "answer", "--task-name", "why"]
    assert main([*argv, "--output-dir", str(out), *QUICK]) == 0
    spec = read_task_file(out / "task.yaml")
    assert (spec.kind, spec.options_field) == ("choice", "options")
    assert main(["eval", "--adapter", str(out)]) == 0
    assert "why test: accuracy" in capsys.readouterr().out
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps({"context": "It rained. What was the effect?", "options": ["wet", "dry"]}) + "\n")
    assert main(["predict", "--run", str(out), "--input", str(new), "--output", str(tmp_path / "p.jsonl")]) == 0
    (prediction,) = _jsonl(tmp_path / "p.jsonl")
    assert prediction["prediction"] == ["wet", "dry"][prediction["index"]]


def test_task_file_round_trip_and_train_from_it(tmp_path):
    train = rte_as_csv(tmp_path / "train.csv", "train", 40)
    spec = TaskSpec(
        name="entails",
        kind="classify",
        source={"train": "train.csv"},
        text_fields=["sentence1", "sentence2"],
        label_field="label",
        labels=["no", "yes"],
        templates={
            "decoder": {"prompt": "{sentence1}\nDoes it follow that {sentence2}?", "label_words": [" no", " yes"]}
        },
        metrics=["accuracy", "matthews"],
    )
    write_task_file(spec, tmp_path / "entails.yaml")
    again = read_task_file(tmp_path / "entails.yaml")
    assert again.source == {"train": str(train)}  # relative to the file's folder
    assert again.templates == spec.templates and again.metrics == ("accuracy", "matthews")
    assert yaml.safe_load((tmp_path / "entails.yaml").read_text())["name"] == "entails"
    out = tmp_path / "run"
    assert main(["train", "--task", str(tmp_path / "entails.yaml"), "--output-dir", str(out), *QUICK]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["test"]) == {"accuracy", "matthews", "score"}


def test_builtin_tasks_listed(capsys):
    assert main(["tasks"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == ["boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc"]
    assert get_task("cb").metrics == ("accuracy_macro_f1",)


# ---------------------------------------------------------------------------------------------------- bad input


def _fails(argv: list[str], capsys, *parts: str) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" not in err, err
    for part in parts:
        assert part in err, err
    return err


def _train(tmp_path: Path, train: Path, *extra: str) -> list[str]:
    return ["train", "--train-file", str(train), *extra, "--output-dir", str(tmp_path / "run"), *QUICK]


PAIR = ["--text-fields", "sentence1,sentence2", "--label-field", "label"]


def test_misspelt_column_is_named_with_the_close_one(tmp_path, capsys):
    train = rte_as_csv(tmp_path / "train.csv", "train", 20)
    argv = _train(tmp_path, train, "--text-fields", "sentence1,sentense2", "--label-field", "label")
    _fails(argv, capsys, "train.csv:2", "'sentense2'", "did you mean 'sentence2'")
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_unknown_label_in_test_and_empty_split(tmp_path, capsys):
    train = rte_as_csv(tmp_path / "train.csv", "train", 20)
    test = tmp_path / "test.csv"
    test.write_text("sentence1,sentence2,label\na,b,yes\nc,d,maybe\n")
    _fails(_train(tmp_path, train, *PAIR, "--test-file", str(test)), capsys, "test.csv:3", "'label'", "'maybe'")
    test.write_text("sentence1,sentence2,label\n")
    _fails(_train(tmp_path, train, *PAIR, "--test-file", str(test)), capsys, "test.csv", "test split is empty")


def test_label_column_of_mixed_types(tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    rows = [{"text": f"t{i}", "label": i % 2} for i in range(6)] + [{"text": "x", "label": "1"}]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _fails(
        _train(tmp_path, train, "--text-fields", "text", "--label-field", "label"), capsys, "train.jsonl:7", "one type"
    )


def test_bom_is_stripped_and_bad_bytes_and_ragged_rows_are_named(tmp_path, capsys):
    train = rte_as_csv(tmp_path / "train.csv", "train", 20)
    train.write_bytes(b"\xef\xbb\xbf" + train.read_bytes())
    spec = TaskSpec("bom", "classify", {"train": str(train)}, ["sentence1", "sentence2"], "label")
    _, splits, scored = task_splits(spec)
    assert scored == "validation" and len(splits["train"]) + len(splits["validation"]) == 20
    broken = tmp_path / "bytes.csv"
    broken.write_bytes(b"sentence1,sentence2,label\na,b,yes\nc,\xff,no\n")
    _fails(_train(tmp_path, broken, *PAIR), capsys, "bytes.csv:3", "0xff", "UTF-8")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("sentence1,sentence2,label\na,b,yes\nc,d,e,no\n")
    _fails(_train(tmp_path, ragged, *PAIR), capsys, "ragged.csv:3", "4 fields")


def test_messages_without_assistant_turn_or_with_an_unknown_role(tmp_path):
    chat = tmp_path / "chat.jsonl"
    spec = TaskSpec("chat", "generate", {"train": str(chat)}, ["messages"])
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    chat.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataFormatError, match=r"chat.jsonl:2: field 'messages' has no assistant turn"):
        task_splits(spec)
    wrong = {"messages": [{"role": "asistant", "content": "x"}]}
    chat.write_text(json.dumps(good) + "\n" + json.dumps(wrong) + "\n")
    with pytest.raises(
        DataFormatError, match=r"chat.jsonl:2: field 'messages'\[0\]: unknown role 'asistant'.*'assistant'"
    ):
        task_splits(spec)
    chat.write_text(json.dumps(good) + "\n" * 2 + json.dumps(good) + "\n")
    _, splits, _ = task_splits(spec)
    assert splits["train"][0].fields == good


def test_template_naming_a_missing_field_and_kind_contradicting_fields(tmp_path, capsys):
    with pytest.raises(TaskSpecError, match=r"templates.decoder.prompt: \{sentense\} names no field.*'sentence'"):
        TaskSpec(
            "t", "classify", {}, ["sentence"], "label", ["a", "b"], templates={"decoder": {"prompt": "{sentense}"}}
        )
    with pytest.raises(TaskSpecError, match="kind generate contradicts its label"):
        TaskSpec("t", "generate", {}, ["prompt", "completion"], "label")
    with pytest.raises(TaskSpecError, match="kind classify contradicts its options"):
        TaskSpec("t", "classify", {}, ["q"], "label", options_field="options")
    train = rte_as_csv(tmp_path / "train.csv", "train", 20)
    _fails(_train(tmp_path, train, *PAIR, "--task-type", "generate"), capsys, "generate task reads text_fields")
    task_file = tmp_path / "t.yaml"
    task_file.write_text("name: t\nkind: classify\ntext_fields: [a]\nlabel_feild: y\n")
    _fails(
        ["train", "--task", str(task_file), "--output-dir", str(tmp_path / "r")], capsys, "label_feild", "label_field"
    )


def test_serve_classifies_records_in_the_tasks_own_fields(tmp_path):
    """/v1/classify answers a user task's rows as `capt predict --run` does, and a pre-0.3 run keeps its BOS."""
    from fastapi.testclient import TestClient

    from capt.recipes.run import read_run_config
    from capt.recipes.serve import Limits, build_engine, create_app

    train = rte_as_csv(tmp_path / "train.csv", "train", 40)
    out = tmp_path / "run"
    assert main(_train(tmp_path, train, *PAIR, "--task-name", "pairs")) == 0
    rows = [{"sentence1": "A cat sat.", "sentence2": "An animal sat."}, {"sentence1": "It rains.", "sentence2": "Dry."}]
    new = tmp_path / "new.jsonl"
    new.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["predict", "--run", str(out), "--input", str(new), "--output", str(tmp_path / "p.jsonl")]) == 0
    expected = [p["prediction"] for p in _jsonl(tmp_path / "p.jsonl")]
    engine = build_engine("tiny-llama", {"mine": out}, Limits())
    try:
        with TestClient(create_app(engine)) as client:
            answer = client.post("/v1/classify", json={"records": [{**r, "task": "mine"} for r in rows]})
            assert answer.status_code == 200, answer.text
            got = [result["predictions"][0]["label"] for result in answer.json()["results"]]
            assert got == expected
            bad = client.post("/v1/classify", json={"records": [{"sentence1": "x", "task": "mine"}]})
            assert bad.status_code == 422 and "missing field 'sentence2'" in bad.json()["error"]["message"]
    finally:
        engine.stop()
    settings = json.loads((out / "run_config.json").read_text())
    assert settings["prompt_bos"] == "tokenizer"  # the new default, recorded
    del settings["prompt_bos"]
    (out / "run_config.json").write_text(json.dumps(settings))
    assert read_run_config(out).prompt_bos == "always"  # a run written before the setting existed


def test_compare_runs_a_task_file(tmp_path):
    rte_as_csv(tmp_path / "train.csv", "train", 40)
    task = tmp_path / "entails.yaml"
    task.write_text("name: entails\nkind: classify\nsource: {train: train.csv}\ntext_fields: [sentence1, sentence2]\n"
                    "label_field: label\n")  # fmt: skip
    out = tmp_path / "study"
    assert main(["compare", "--tasks", str(task), "--methods", "capt,lora", "--output-dir", str(out), *QUICK]) == 0
    assert (out / "entails" / "lora" / "task.yaml").is_file()
    table = (out / "comparison.md").read_text()
    assert "entails" in table and "lora" in table


def test_parquet_json_and_saved_datasets_read_through_datasets(tmp_path):
    import datasets

    rows = [{"text": f"row {i}", "label": ["no", "yes"][i % 2]} for i in range(20)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "test.json").write_text(json.dumps(rows[:4]))
    spec = TaskSpec("p", "classify", {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.json")},
                    ["text"], "label")  # fmt: skip
    resolved, splits, scored = task_splits(spec)
    assert resolved.labels == ("no", "yes") and scored == "test"
    assert [ex.label for ex in splits["test"]] == [0, 1, 0, 1]
    assert len(splits["train"]) == 18 and len(splits["validation"]) == 2  # 10%, one of each label
    saved = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "val": datasets.Dataset.from_list(rows[:6])}
    )
    saved.save_to_disk(str(tmp_path / "saved"))
    _, splits, scored = task_splits(TaskSpec("s", "classify", {"dataset": str(tmp_path / "saved")}, ["text"], "label"))
    assert (len(splits["train"]), len(splits["validation"]), scored) == (20, 6, "validation")


@pytest.mark.parametrize("name", ["boolq", "cb", "copa", "multirc", "record", "rte", "wic", "wsc"])
def test_every_builtin_task_file_round_trips(name, tmp_path):
    spec = get_task(name)
    write_task_file(spec, tmp_path / "task.yaml")
    assert read_task_file(tmp_path / "task.yaml") == spec


@pytest.mark.parametrize(
    ("row", "fields"),
    [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, ("messages",)),
        ({"prompt": "2+2=", "completion": "4"}, ("prompt", "completion")),
    ],
)
def test_chat_and_completion_rows_make_a_generate_task(row, fields, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps(row) + "\n") * 20)
    main(["train", "--train-file", str(data), "--task-name", "talk", "--output-dir", str(tmp_path / "r"), *QUICK])
    spec = get_task("talk")  # registered from the flags, whatever the training then does
    assert (spec.kind, spec.text_fields, spec.metrics[0]) == ("generate", fields, "loss")
    _, splits, _ = task_splits(spec)
    assert splits["train"][0].fields == row and len(splits["validation"]) == 2
