"""The SuperGLUE pipeline: every method learns, each family trains end to end, early stopping, the CLI."""

import json
import random
from pathlib import Path

import pytest
import torch

from capt.recipes.backbones import load_backbone
from capt.recipes.cli import main
from capt.recipes.data import paper_splits
from capt.recipes.formats import head_outputs, make_format, target_logprobs
from capt.recipes.methods import METHODS, apply_method
from capt.recipes.reporting import comparison_table
from capt.recipes.run import DEFAULT_LR
from capt.recipes.train import length_grouped_batches

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
QUICK = ["--limit-train", "16", "--limit-eval", "12", "--batch-size", "8", "--data-dir", str(DATA)]


pytestmark = pytest.mark.usefixtures("private_home")  # each test its own feature cache (conftest)


def _fixed_batch(model_name, task="rte", count=8):
    backbone = load_backbone(model_name, num_labels=head_outputs(task))
    fmt = make_format(backbone.family, task, backbone.tokenizer, 128)
    examples = paper_splits(task, DATA)["train"][:count]
    return backbone, fmt, fmt.collate([fmt.encode(ex) for ex in examples])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_lowers_the_loss_on_a_fixed_batch(method):
    backbone, fmt, batch = _fixed_batch("minilm" if method == "head" else "tiny-llama")
    model = apply_method(backbone, method)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3 * DEFAULT_LR[method])
    losses = []
    for _ in range(6):
        loss = fmt.loss(model, batch)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0]


def test_head_only_needs_a_classifier():
    with pytest.raises(ValueError, match="classification head"):
        apply_method(load_backbone("tiny-llama"), "head")


def test_copa_is_multiple_choice_on_an_encoder():
    backbone, fmt, batch = _fixed_batch("minilm", task="copa", count=4)
    assert batch["options"] == [2, 2, 2, 2]
    model = apply_method(backbone, "capt")
    with torch.no_grad():
        assert len(fmt.predict(model, batch)) == 4
    assert fmt.loss(model, batch).requires_grad


def test_option_scores_are_summed_target_log_probabilities():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]]))
    labels = torch.tensor([[-100, 1, 2]])
    # Shifted (causal): position 0 predicts token 1 (p=0.25), position 1 predicts token 2 (p=0.1).
    assert torch.allclose(target_logprobs(logits, labels, shifted=True), torch.log(torch.tensor([0.25 * 0.1])))
    assert torch.allclose(target_logprobs(logits, labels, shifted=False), torch.log(torch.tensor([0.8 * 0.6])))


def test_length_grouped_batches_cover_every_example_once():
    lengths = [random.Random(0).randint(5, 100) for _ in range(203)]
    batches = length_grouped_batches(lengths, 16, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(203))
    assert max(len(b) for b in batches) == 16


@pytest.mark.parametrize("model", ["tiny-t5", "tiny-llama"])
def test_train_then_eval_end_to_end(model, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", model, "--task", "cb", "--epochs", "2", "--output-dir", str(out), *QUICK]) == 0
    results = json.loads((out / "results.json").read_text())
    assert {"accuracy", "f1", "score"} <= set(results["test"])
    assert results["trainable_params"] == {"tiny-t5": 2 * 64, "tiny-llama": 2 * 64}[model]
    for name in ("metrics.jsonl", "metrics.csv", "learning_curves.png", "trainable.safetensors", "adapter"):
        assert (out / name).exists(), name
    assert (out / "learning_curves.png").stat().st_size > 1000
    assert "test accuracy" in capsys.readouterr().out
    # Where the run was made: float32 results agree across CPU kinds only to rounding, so the kind is on record.
    environment = results["runs"][0]["environment"]
    assert environment["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert environment["torch_threads"] == torch.get_num_threads()
    assert environment["versions"]["torch"] == torch.__version__

    assert main(["eval", "--adapter", str(out), "--data-dir", str(DATA)]) == 0
    evaluated = json.loads((out / "eval-cb-test.json").read_text())
    assert evaluated["score"] == pytest.approx(results["test"]["score"]["mean"])


def test_early_stopping_keeps_the_best_epoch(tmp_path):
    out = tmp_path / "run"
    # lr 0: the validation score never improves after epoch 1, so patience 1 stops at epoch 2.
    argv = ["train", "--model", "tiny-llama", "--task", "rte", "--epochs", "5", "--patience", "1", "--lr", "0"]
    assert main([*argv, "--output-dir", str(out), *QUICK]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert (run["epochs_run"], run["best_epoch"]) == (2, 1)
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in epochs if r["kind"] == "epoch"] == [1, 2]


def test_results_are_not_overwritten_without_the_flag(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-llama", "--task", "rte", "--epochs", "1", "--output-dir", str(out), *QUICK]
    assert main(argv) == 0
    assert main(argv) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0


def test_yaml_config_with_command_line_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny-llama\ntask: cb\nepochs: 1\nlr: 0.5\n")
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--task", "rte", "--output-dir", str(out), *QUICK]) == 0
    saved = json.loads((out / "run_config.json").read_text())
    assert (saved["model"], saved["task"], saved["lr"]) == ("tiny-llama", "rte", 0.5)
    config.write_text("modle: tiny-llama\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "x"), *QUICK]) == 1


def test_seeds_report_mean_and_std(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-llama", "--task", "rte", "--epochs", "1", "--seeds", "2", "--lr", "0.05"]
    assert main([*argv, "--output-dir", str(out), *QUICK]) == 0
    summary = json.loads((out / "results.json").read_text())
    assert summary["seeds"] == [0, 1] and (out / "seed-1" / "results.json").exists()
    scores = [r["test"]["score"] for r in summary["runs"]]
    assert summary["score"]["mean"] == pytest.approx(sum(scores) / 2)


def test_compare_writes_one_table(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--tasks", "cb,rte", "--methods", "capt,lora", "--model", "tiny-llama", "--epochs", "1"]
    assert main([*argv, "--output-dir", str(out), *QUICK]) == 0
    table = (out / "comparison.md").read_text()
    assert table.splitlines()[0] == "| method | cb | rte | average | trainable params (%) | wall time |"
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == ["| capt", "| lora"]
    assert len(json.loads((out / "comparison.json").read_text())) == 4


def test_comparison_table_from_hand_made_results():
    def result(task, method, mean, std):
        return {
            "task": task,
            "method": method,
            "variant": "add",
            "score": {"mean": mean, "std": std},
            "trainable_params": 1536,
            "trainable_percent": 0.0068,
            "wall_time_s": 60.0,
        }

    table = comparison_table(
        [result("cb", "capt", 0.8, 0.01), result("rte", "capt", 0.6, 0.02), result("cb", "lora", 0.9, 0.0)]
    )
    lines = table.splitlines()
    assert lines[2] == "| capt | 80.0 ± 1.0 | 60.0 ± 2.0 | 70.0 | 1,536 (0.0068%) | 2.0 min |"
    assert lines[3] == "| lora | 90.0 ± 0.0 | n/a | n/a | 1,536 (0.0068%) | 1.0 min |"


def test_unknown_task_or_method_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--task", "squad", "--output-dir", str(tmp_path / "a")]) == 1
    assert "unknown task 'squad'" in capsys.readouterr().err
    assert main(["train", "--method", "magic", "--output-dir", str(tmp_path / "b")]) == 1
    assert "unknown method 'magic'" in capsys.readouterr().err


@pytest.mark.parametrize("config", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")))
def test_shipped_configs_are_valid_run_configs(config):
    from capt.recipes.cli import _parser, run_config

    args = _parser().parse_args(["train", "--config", str(config)])
    assert run_config(args).model


def test_t5_generation_mode_predicts_by_exact_match(tmp_path):
    backbone, fmt, batch = _fixed_batch("tiny-t5", count=4)
    model = apply_method(backbone, "full")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for _ in range(80):  # overfit four examples until their label words are what greedy decoding writes
        loss = fmt.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    generating = make_format(backbone.family, "rte", backbone.tokenizer, 128, t5_generate=True)
    model.eval()
    with torch.no_grad():
        assert generating.predict(model, batch) == batch["labels"].tolist() == fmt.predict(model, batch)
        untrained = apply_method(load_backbone("tiny-t5"), "capt")
        assert -1 in generating.predict(untrained, batch)  # random text matches no label word
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-t5", "--task", "rte", "--epochs", "1", "--t5-generate", "--output-dir", str(out)]
    assert main([*argv, *QUICK]) == 0
    assert "accuracy" in json.loads((out / "results.json").read_text())["test"]
