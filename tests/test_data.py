"""SuperGLUE loaders and the paper's split, on the real shared files (and on broken copies in tmp_path)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from capt.recipes.data import DataFormatError, DataNotFoundError, load_split, paper_splits, resolve_data_dir

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
FEWGLUE = DATA.parent / "fewglue"


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    """Official-format ReCoRD files: the FewGLUE subsets (the full ReCoRD is not in the shared folder)."""
    root = tmp_path_factory.mktemp("record")
    (root / "ReCoRD").mkdir()
    (root / "ReCoRD" / "train.jsonl").symlink_to(FEWGLUE / "ReCoRD" / "train.jsonl")
    (root / "ReCoRD" / "val.jsonl").symlink_to(FEWGLUE / "ReCoRD" / "dev32.jsonl")
    return root


@pytest.mark.parametrize(
    "task,split,count",
    [
        ("cb", "train", 250),
        ("cb", "val", 56),
        ("copa", "train", 400),
        ("copa", "val", 100),
        ("rte", "train", 2490),
        ("rte", "val", 277),
        ("wic", "train", 5428),
        ("wic", "val", 638),
        ("wsc", "train", 554),
        ("wsc", "val", 104),
        ("boolq", "val", 3270),
        ("multirc", "train", 27243),
        ("multirc", "val", 4848),
    ],
)
def test_official_counts_and_unique_ids(task, split, count):
    examples = load_split(task, split, DATA)
    assert len(examples) == count
    assert len({ex.idx for ex in examples}) == count
    assert all(ex.task == task for ex in examples)


@pytest.mark.parametrize(
    "task,split,balance",
    [
        ("rte", "val", {0: 146, 1: 131}),
        ("rte", "train", {0: 1249, 1: 1241}),
        ("cb", "train", {0: 115, 1: 119, 2: 16}),
        ("cb", "val", {0: 23, 1: 28, 2: 5}),
        ("copa", "val", {0: 55, 1: 45}),
        ("wic", "val", {0: 319, 1: 319}),
        ("wsc", "val", {1: 38, 0: 66}),
        ("boolq", "val", {1: 2033, 0: 1237}),
        ("multirc", "val", {1: 2075, 0: 2773}),
    ],
)
def test_labels_are_mapped_to_ids(task, split, balance):
    assert Counter(ex.label for ex in load_split(task, split, DATA)) == balance


def test_fields_of_real_examples():
    rte = load_split("rte", "val", DATA)[0]
    assert rte.fields["premise"].startswith("Dana Reeve") and rte.label == 1  # "not_entailment"
    wsc = load_split("wsc", "train", DATA)[0]
    assert [wsc.fields[k] for k in ("span1_text", "span2_text", "span2_index")] == ["Mark", "He", 13]
    wic = load_split("wic", "val", DATA)[0]
    assert wic.fields["sentence1"][wic.fields["start1"] : wic.fields["end1"]] == "class"


def test_multirc_is_flattened_per_answer_with_question_groups():
    val = load_split("multirc", "val", DATA)
    assert len({ex.group for ex in val}) == 953 and len({ex.doc for ex in val}) == 83
    first = [ex for ex in val if ex.group == val[0].group]
    assert [ex.fields["answer"] for ex in first] == [
        "No",
        "Yes",
        "Less the mass, less the force applied",
        "It depends on the shape of the baseball",
    ]
    assert [ex.label for ex in first] == [0, 1, 1, 0]
    assert len({ex.group for ex in load_split("multirc", "train", DATA)}) == 5131


def test_record_candidates_and_gold(record_dir):
    train = load_split("record", "train", record_dir)
    assert len(train) == 32
    ex = train[0]
    assert ex.answers == ("Olimpija Ljubljana",) and ex.candidates[ex.label] == "Olimpija Ljubljana"
    assert list(ex.candidates) == sorted(set(ex.candidates)) and "Chelsea" in ex.candidates
    assert all(ex.candidates[ex.label] in ex.answers for ex in train)


@pytest.mark.parametrize("task,count", [("rte", 3000), ("cb", 250), ("boolq", 3245), ("multirc", 9693)])
def test_test_split_has_no_labels(task, count):
    examples = load_split(task, "test", DATA)
    assert len(examples) == count and all(ex.label is None for ex in examples)


def _write(root: Path, task_folder: str, split: str, lines: list[str]) -> Path:
    path = root / task_folder / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD_RTE = json.dumps({"premise": "p", "hypothesis": "h", "label": "entailment", "idx": 0})


@pytest.mark.parametrize(
    "bad_line,line_no,words",
    [
        ('{"premise": "p", "hypothesis": ', 3, ["malformed JSON"]),
        ('{"premise": "p", "label": "entailment", "idx": 1}', 3, ["'hypothesis'"]),
        ('{"premise": "p", "hypothesis": "h", "label": "maybe", "idx": 1}', 3, ["'maybe'", "not_entailment"]),
        ('{"premise": "p", "hypothesis": "h", "label": true, "idx": 1}', 3, ["True"]),
        ('{"premise": "p", "hypothesis": 7, "label": "entailment", "idx": 1}', 3, ["'hypothesis'", "int"]),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, bad_line, line_no, words):
    path = _write(tmp_path, "RTE", "train", [GOOD_RTE, "", bad_line])  # the blank line is skipped but counted
    with pytest.raises(DataFormatError) as err:
        load_split("rte", "train", tmp_path)
    assert f"{path}:{line_no}:" in str(err.value)
    assert all(word in str(err.value) for word in words)


def test_nested_multirc_error_names_line_and_field(tmp_path):
    answer = {"text": "yes", "idx": 0}  # no label in a train file
    question = {"question": "q", "idx": 0, "answers": [answer]}
    record = {"idx": 0, "passage": {"text": "t", "questions": [question]}}
    path = _write(tmp_path, "MultiRC", "train", [json.dumps(record)])
    with pytest.raises(DataFormatError, match="'label'") as err:
        load_split("multirc", "train", tmp_path)
    assert f"{path}:1" in str(err.value)
    assert load_split("multirc", "test", _write(tmp_path, "MultiRC", "test", [json.dumps(record)]).parents[1])


def test_copa_label_must_be_an_int_not_a_bool(tmp_path):
    good = {"premise": "p.", "choice1": "a", "choice2": "b", "question": "cause", "idx": 0, "label": 1}
    bad = {**good, "idx": 1, "label": True}
    path = _write(tmp_path, "COPA", "train", [json.dumps(good), json.dumps(bad)])
    with pytest.raises(DataFormatError, match="unknown copa label True") as err:
        load_split("copa", "train", tmp_path)
    assert f"{path}:2:" in str(err.value)


def test_empty_split_and_duplicate_ids_raise(tmp_path):
    path = _write(tmp_path, "RTE", "val", ["", "  "])
    with pytest.raises(DataFormatError, match="no examples") as err:
        load_split("rte", "val", tmp_path)
    assert str(path) in str(err.value)
    _write(tmp_path, "RTE", "train", [GOOD_RTE, GOOD_RTE])
    with pytest.raises(DataFormatError, match="duplicate idx"):
        load_split("rte", "train", tmp_path)


def test_missing_local_file_names_the_path_without_hub_fallback():
    with pytest.raises(DataNotFoundError) as err:
        load_split("boolq", "train", DATA)
    assert isinstance(err.value, FileNotFoundError)
    assert str(DATA / "BoolQ" / "train.jsonl") in str(err.value)
    assert "aps/super_glue" not in str(err.value)


def test_bad_task_or_split():
    with pytest.raises(ValueError, match="unknown task"):
        load_split("mnli", "train", DATA)
    with pytest.raises(ValueError, match="unknown split"):
        load_split("rte", "dev", DATA)


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPT_DATA_DIR", str(DATA))
    assert resolve_data_dir() == DATA
    assert resolve_data_dir(tmp_path) == tmp_path
    assert len(load_split("cb", "val")) == 56  # read through the environment variable
    monkeypatch.delenv("CAPT_DATA_DIR")
    assert resolve_data_dir() is None


def test_offline_without_data_dir_gives_one_error_naming_both_ways(monkeypatch, tmp_path):
    # In a child process, so the offline switches are read when `datasets` is first imported.
    monkeypatch.delenv("CAPT_DATA_DIR", raising=False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache, so nothing can be found offline
    code = (
        "from capt.recipes.data import load_split, DataNotFoundError\n"
        "try:\n    load_split('rte', 'val')\nexcept DataNotFoundError as e:\n    print('ERR', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("ERR"), result.stderr
    for words in ("--data-dir", "CAPT_DATA_DIR", "<Task>/<split>.jsonl", "aps/super_glue", "online"):
        assert words in result.stdout


def _hub_rows(task: str, path: Path) -> list[dict]:
    """The official lines in aps/super_glue's flat schema (ClassLabel ids), as the Hub serves them."""
    rows = []
    for record in map(json.loads, path.read_text().splitlines()):
        if task == "rte":
            rows.append({**record, "label": ["entailment", "not_entailment"].index(record["label"])})
        elif task == "wsc":
            rows.append(
                {"text": record["text"], **record["target"], "idx": record["idx"], "label": int(record["label"])}
            )
        elif task == "multirc":
            passage = record["passage"]
            rows += [
                {
                    "paragraph": passage["text"],
                    "question": q["question"],
                    "answer": a["text"],
                    "idx": {"paragraph": record["idx"], "question": q["idx"], "answer": a["idx"]},
                    "label": a["label"],
                }
                for q in passage["questions"]
                for a in q["answers"]
            ]
        else:
            text = record["passage"]["text"]
            entities = sorted({text[e["start"] : e["end"] + 1] for e in record["passage"]["entities"]})
            rows += [
                {
                    "passage": text,
                    "query": qa["query"],
                    "entities": entities,
                    "answers": sorted({a["text"] for a in qa["answers"]}),
                    "idx": {"passage": record["idx"], "query": qa["idx"]},
                }
                for qa in record["qas"]
            ]
    return rows


@pytest.mark.parametrize("task", ["rte", "wsc", "multirc", "record"])
def test_hub_rows_give_the_same_examples_as_local_files(monkeypatch, record_dir, task):
    datasets = pytest.importorskip("datasets")
    root = record_dir if task == "record" else DATA
    folder = {"rte": "RTE", "wsc": "WSC", "multirc": "MultiRC", "record": "ReCoRD"}[task]
    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return _hub_rows(task, root / folder / "val.jsonl")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.delenv("CAPT_DATA_DIR", raising=False)
    assert load_split(task, "val") == load_split(task, "val", root)
    assert calls == [("aps/super_glue", "wsc.fixed" if task == "wsc" else task, "validation")]


@pytest.mark.parametrize("task", ["rte", "cb", "wic"])
def test_paper_split_sizes_stratification_and_disjointness(task):
    train = load_split(task, "train", DATA)
    parts = paper_splits(task, DATA, seed=0)
    assert len(parts["validation"]) == round(0.1 * len(train))
    assert len(parts["train"]) + len(parts["validation"]) == len(train)
    train_ids, val_ids = {ex.idx for ex in parts["train"]}, {ex.idx for ex in parts["validation"]}
    assert not train_ids & val_ids and train_ids | val_ids == {ex.idx for ex in train}
    assert parts["test"] == load_split(task, "val", DATA)
    total, in_val = Counter(ex.label for ex in train), Counter(ex.label for ex in parts["validation"])
    for label, n in total.items():
        assert abs(in_val[label] - 0.1 * n) <= 1 and 1 <= in_val[label] < n


def test_paper_split_is_deterministic_per_seed():
    ids = {seed: [ex.idx for ex in paper_splits("rte", DATA, seed=seed)["validation"]] for seed in (0, 1)}
    assert ids[0] == [ex.idx for ex in paper_splits("rte", DATA, seed=0)["validation"]]
    assert ids[0] != ids[1]


def test_paper_split_keeps_a_tiny_class_on_both_sides(tmp_path):
    lines = [
        json.dumps({"premise": "p", "hypothesis": "h", "label": label, "idx": i})
        for i, label in enumerate(["entailment"] * 20 + ["neutral"] * 2 + ["contradiction"])
    ]
    _write(tmp_path, "CB", "train", lines)
    _write(tmp_path, "CB", "val", lines[:1])
    parts = paper_splits("cb", tmp_path)
    assert Counter(ex.label for ex in parts["validation"])[2] == 1
    assert Counter(ex.label for ex in parts["train"]) == {0: 18, 2: 1, 1: 1}  # the single one stays in train


def test_paper_split_never_splits_a_multirc_passage():
    parts = paper_splits("multirc", DATA, seed=3)
    train_docs, val_docs = {ex.doc for ex in parts["train"]}, {ex.doc for ex in parts["validation"]}
    assert not train_docs & val_docs and len(val_docs) == round(0.1 * 456)
    assert not {ex.group for ex in parts["train"]} & {ex.group for ex in parts["validation"]}
    assert len(parts["train"]) + len(parts["validation"]) == 27243
    assert [ex.idx for ex in paper_splits("multirc", DATA, seed=3)["validation"]] == [
        ex.idx for ex in parts["validation"]
    ]


def test_paper_split_rejects_bad_fraction():
    with pytest.raises(ValueError, match="val_fraction"):
        paper_splits("cb", DATA, val_fraction=1.0)


@pytest.mark.parametrize(
    ("task", "limit_train", "limit_eval"), [("multirc", 120, 300), ("multirc", 5, 5), ("cb", 20, 7)]
)
def test_limits_cut_whole_passages_and_exact_counts_elsewhere(task, limit_train, limit_eval):
    """--limit-train / --limit-eval on MultiRC keep whole passages (at least one), so no question loses answers;
    on a task without passages they keep exactly the first N."""
    from capt.recipes.evaluate import load_task
    from capt.recipes.settings import RunConfig

    full = paper_splits(task, DATA)
    _, cut, _ = load_task(RunConfig(task=task, data_dir=str(DATA), limit_train=limit_train, limit_eval=limit_eval))
    for split, limit in (("train", limit_train), ("validation", limit_eval), ("test", limit_eval)):
        kept, whole = cut[split], full[split]
        assert kept == whole[: len(kept)]  # a prefix, in file order
        if task == "cb":
            assert len(kept) == limit
            continue
        passages = {ex.doc for ex in kept}
        assert not passages & {ex.doc for ex in whole[len(kept) :]}  # every passage whole
        first_passage = sum(ex.doc == whole[0].doc for ex in whole)
        assert len(kept) <= limit or len(kept) == first_passage  # within the limit, or the one first passage
        next_passage = sum(ex.doc == whole[len(kept)].doc for ex in whole)
        assert len(kept) + next_passage > limit  # rounded down by less than a passage: the next one would not fit
