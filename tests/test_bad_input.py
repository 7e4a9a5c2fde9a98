"""Hostile input: every bad value is refused in one line naming the flag, YAML key or file; nothing is silent."""

import dataclasses
import json
import math
import socket
from pathlib import Path

import pytest
import torch

import capt
from capt.recipes.cli import main
from capt.recipes.run import RunConfig, read_run_config, run_lock
from tests.conftest import tiny_llama

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
TINY = ["--model", "tiny-llama", "--task", "cb", "--data-dir", str(DATA), "--limit-train", "16", "--limit-eval", "16"]


pytestmark = pytest.mark.usefixtures("private_home")  # each test its own feature cache (conftest)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "cb"
    cache = tmp_path_factory.mktemp("cache")
    assert main(["train", *TINY, "--epochs", "1", "--output-dir", str(out), "--cache-dir", str(cache)]) == 0
    return out


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["--seeds", "-2"], "--seeds must be >= 1, got -2"),
        (["--lr", "-1"], "--lr (YAML key lr): lr must be >= 0.0, got -1.0"),
        (["--lr", "nan"], "--lr (YAML key lr): got nan; expected a finite number"),
        (["--lr", "inf"], "--lr (YAML key lr): got inf; expected a finite number"),
        (["--head-lr", "0"], "head_lr must be > 0.0"),
        (["--limit-train", "0"], "limit_train must be >= 1, got 0"),
        (["--limit-train", "-5"], "limit_train must be >= 1, got -5"),
        (["--limit-eval", "0"], "limit_eval must be >= 1, got 0"),
        (["--max-length", "1"], "max_length must be >= 8, got 1"),
        (["--patience", "-1"], "patience must be >= 1, got -1"),
        (["--warmup-ratio", "5"], "warmup_ratio must be in [0.0, 1.0], got 5.0"),
        (["--weight-decay", "-0.1"], "weight_decay must be >= 0.0"),
        (["--seed", "-1"], "seed must be in [0, 4294967295], got -1"),
        (["--checkpoint-every", "-1"], "checkpoint_every must be >= 0"),
        (["--deep-prompt-slots", "0"], "deep_prompt_slots must be >= 1"),
        (["--lora-rank", "0"], "lora_rank must be >= 1"),
        (["--method", "lora", "--variant", "extract"], "'extract' applies to --method capt or capt-rms only"),
        (["--task", "squad"], "unknown task 'squad'"),
        (["--model", ""], "--model (YAML key model): must not be empty"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(flags, message, tmp_path, capsys):
    err = _error(capsys, ["train", *TINY, *flags, "--output-dir", str(tmp_path / "out")])
    assert message in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ("capt=-1", "has learning rate(s) [-1.0]; each must be a finite number >= 0"),
        ("capt=1e-2,nan", "has learning rate(s) [nan]"),
        ("capt=", "gives no learning rates"),
        ("capt=abc", "is not METHOD=LR,LR,..."),
    ],
)
def test_a_bad_lr_grid_is_refused_before_any_training(grid, message, tmp_path, capsys):
    argv = ["sweep", "--tasks", "cb", "--methods", "capt", "--lr-grid", grid, "--model", "tiny-llama"]
    err = _error(capsys, [*argv, "--data-dir", str(DATA), "--output-dir", str(tmp_path / "out")])
    assert "--lr-grid" in err and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ('epochs: "ten"\n', "--epochs (YAML key epochs): got 'ten'; expected an integer"),
        ("epochs: 1.5\n", "--epochs (YAML key epochs): got 1.5; expected an integer"),
        ('bf16: "no"\n', "--bf16 (YAML key bf16): got 'no'; expected true or false"),
        ("epochs: 2\nepochs: 3\n", "line 2: duplicate key 'epochs'"),
        ('x: !!python/object/apply:os.system ["echo pwned"]\n', "is not a valid settings file"),
        ("lr: [1e-3\n", "is not a valid settings file"),
        ("- 1\n- 2\n", "expected a mapping of settings, got list"),
        ("learning_rate: 0.1\n", "unknown settings ['learning_rate']"),
        ("per_task: [cb]\n", "per_task must map task names to settings, got list"),
        ("per_task:\n  cd: {epochs: 2}\n", "per_task names unknown tasks ['cd']; known: boolq, cb,"),
        ("per_task:\n  cb: 2\n", "per_task.cb must be a mapping of settings"),
        ("per_task:\n  cb: {method: lora}\n", "per_task.cb sets ['method']: a section holds its task's settings"),
        ("per_task:\n  rte: {max_lenght: 96}\n", "per_task.rte: unknown settings ['max_lenght']"),
        ("per_task:\n  rte: {epochs: ten}\n", "--epochs (YAML key epochs): got 'ten'; expected an integer"),
        ("per_method:\n  loar: {lr: 0.1}\n", "per_method names unknown methods ['loar']; known: capt, capt-rms"),
        ("per_method:\n  full: {task: cb}\n", "per_method.full sets ['task']: a section holds its method's settings"),
        (
            "per_method:\n  full: {decoder_head: classifier}\nper_task:\n  cb: {decoder_head: lm}\n",
            "['decoder_head'] set in both per_task and per_method; set each in one of them",
        ),
        ("plan: [cb]\n", "plan must map task names to lists of methods, got list"),
        ("plan:\n  cd: [capt]\n", "plan names unknown tasks ['cd']"),
        ("plan:\n  cb: capt\n", "plan.cb must be a list of methods, e.g. [capt, lora]"),
        ("plan:\n  cb: [capt, loar]\n", "plan.cb names unknown methods ['loar']"),
        ("plan:\n  cb: [capt, capt]\n", "plan.cb names capt more than once"),
    ],
)
def test_a_bad_yaml_file_is_refused_naming_file_and_key(yaml_text, message, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    err = _error(capsys, ["train", "--config", str(config), "--output-dir", str(tmp_path / "out")])
    assert str(config) in err and message in err


def test_per_task_and_per_method_sections_set_their_own_cells_and_flags_still_win(tmp_path):
    from capt.recipes.cli import _parser, run_config

    config = tmp_path / "study.yaml"
    config.write_text(
        "max_length: 160\nepochs: 10\nper_task:\n  rte: {max_length: 96, limit_train: 500}\n"
        "per_method:\n  full: {decoder_head: classifier, lr: 3.0e-5}\n"
    )

    def settings(*flags: str, **fixed: str) -> tuple:
        run = run_config(_parser().parse_args(["train", "--config", str(config), *flags]), **fixed)
        return run.task, run.max_length, run.limit_train, run.epochs, run.method, run.decoder_head, run.lr

    capt_lr = run_config(_parser().parse_args(["train", "--method", "capt"])).lr
    assert settings("--task", "cb") == ("cb", 160, None, 10, "capt", "lm", capt_lr)
    assert settings("--task", "rte") == ("rte", 96, 500, 10, "capt", "lm", capt_lr)
    assert settings() == ("rte", 96, 500, 10, "capt", "lm", capt_lr)  # the default task and method
    assert settings("--task", "rte", "--max-length", "128")[:3] == ("rte", 128, 500)  # a flag over the section
    assert settings("--task", "cb", task="rte")[:3] == ("rte", 96, 500)  # a command's own task (compare, sweep)
    assert settings("--method", "full", "--task", "rte") == ("rte", 96, 500, 10, "full", "classifier", 3e-5)
    assert settings("--method", "full", "--decoder-head", "lm")[4:] == ("full", "lm", 3e-5)
    assert settings(method="full")[4:] == ("full", "classifier", 3e-5)  # a command's own method


STUDY_PLAN = "plan:\n  cb: [capt, lora, full]\n  rte: [capt]\nper_method:\n  full: {decoder_head: classifier}\n"


@pytest.mark.parametrize(
    ("flags", "cells"),
    [
        ([], [("cb", "capt"), ("cb", "lora"), ("cb", "full"), ("rte", "capt")]),
        (["--tasks", "rte"], [("rte", "capt")]),
        (["--methods", "capt"], [("cb", "capt"), ("rte", "capt")]),
        (["--tasks", "cb", "--methods", "full,capt"], [("cb", "capt"), ("cb", "full")]),  # in the plan's order
    ],
)
def test_a_plan_gives_the_cells_of_compare_and_sweep_narrowed_by_the_flags(flags, cells, tmp_path):
    from capt.recipes.cli import _parser, study_cells

    config = tmp_path / "study.yaml"
    config.write_text(STUDY_PLAN)
    for command in ("compare", "sweep"):
        assert study_cells(_parser().parse_args([command, "--config", str(config), *flags])) == cells


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tasks", "rte", "--methods", "capt,lora"], "its plan does not run rte/lora; add them to its plan"),
        (["--tasks", "copa"], "its plan does not run copa;"),
        (["--methods", "lora,prompt"], "its plan does not run prompt;"),
    ],
)
def test_a_cell_outside_the_plan_is_refused_before_any_training(flags, message, tmp_path, capsys):
    config = tmp_path / "study.yaml"
    config.write_text(STUDY_PLAN)
    argv = ["sweep", "--config", str(config), *flags, "--data-dir", str(DATA), "--output-dir", str(tmp_path / "out")]
    err = _error(capsys, argv)
    assert str(config) in err and message in err
    assert not (tmp_path / "out").exists()


def test_compare_and_sweep_without_a_plan_need_tasks_and_methods(tmp_path, capsys):
    for command in ("compare", "sweep"):
        err = _error(capsys, [command, "--methods", "capt", "--output-dir", str(tmp_path / "out")])
        assert "give --tasks and --methods, or a --config file with a plan (task -> methods)" in err


def test_yaml_exponent_numbers_are_floats(tmp_path):
    from capt.recipes.cli import _parser, run_config

    config = tmp_path / "lr.yaml"
    config.write_text("lr: 1e-3\nhead_lr: 5E-4\nwarmup_ratio: 0\n")  # PyYAML reads 1e-3 as the string '1e-3'
    settings = run_config(_parser().parse_args(["train", "--config", str(config)]))
    assert (settings.lr, settings.head_lr, settings.warmup_ratio) == (1e-3, 5e-4, 0.0)
    assert isinstance(settings.warmup_ratio, float)


def test_debug_shows_the_traceback(monkeypatch):
    with pytest.raises(ValueError, match="expected a finite number"):
        main(["train", "--lr", "nan", "--debug"])
    monkeypatch.setenv("CAPT_DEBUG", "1")
    with pytest.raises(ValueError, match="expected a finite number"):
        main(["train", "--lr", "nan"])


def test_every_flag_has_the_type_of_its_field():
    from capt.recipes.cli import _parser

    args = _parser().parse_args(["train", "--limit-train", "3", "--lr", "0.5", "--bf16", "--data-dir", "d"])
    assert (args.limit_train, args.lr, args.bf16, args.data_dir) == (3, 0.5, True, "d")


def test_a_run_config_from_a_newer_version_is_read_with_a_warning(tmp_path):
    settings = {**dataclasses.asdict(RunConfig()), "new_feature": 3}
    (tmp_path / "run_config.json").write_text(json.dumps(settings))
    with pytest.warns(UserWarning, match=r"ignoring settings this version does not know: \['new_feature'\]"):
        assert read_run_config(tmp_path) == RunConfig()


def test_a_damaged_run_config_names_the_file(tmp_path):
    (tmp_path / "run_config.json").write_text('{"epochs": 0}')
    with pytest.raises(ValueError, match="run_config.json: --epochs"):
        read_run_config(tmp_path)
    (tmp_path / "run_config.json").write_text('{"epochs": ')
    with pytest.raises(ValueError, match="is not valid JSON"):
        read_run_config(tmp_path)


def test_a_truncated_weights_file_is_a_clear_error_for_eval_and_analyze(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "torn"
    shutil.copytree(finished_run, run)
    weights = run / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    assert "trainable.safetensors is truncated or corrupt" in _error(capsys, ["eval", "--adapter", str(run)])
    argv = ["analyze", "attention", "--run", str(run), "--examples", "2", "--output-dir", str(tmp_path / "r")]
    assert "trainable.safetensors is truncated or corrupt" in _error(capsys, argv)


def test_nan_weights_in_a_run_folder_are_refused(finished_run, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    run = tmp_path / "nan"
    shutil.copytree(finished_run, run)
    state = {k: torch.full_like(v, math.nan) for k, v in load_file(run / "trainable.safetensors").items()}
    save_file(state, run / "trainable.safetensors")
    assert "holds NaN or inf weights" in _error(capsys, ["eval", "--adapter", str(run)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["attention", "--examples", "0"], "--examples must be >= 1, got 0"),
        (["attention", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["attention", "--max-length", "2"], "--max-length must be >= 8, got 2"),
        (["instance-token", "--ks", "-1"], "from 0 to 64, got [-1]"),
        (["instance-token", "--ks", "100000"], "from 0 to 64, got [100000]"),
        (["instance-token", "--ks", "1,x"], "--ks takes comma-separated integers"),
    ],
)
def test_bad_analysis_options_are_refused(argv, message, finished_run, tmp_path, capsys):
    err = _error(capsys, ["analyze", *argv, "--run", str(finished_run), "--output-dir", str(tmp_path / "r")])
    assert message in err


def test_a_second_writer_is_refused_naming_the_holder(tmp_path, capsys):
    import os

    out = tmp_path / "busy"
    with run_lock(out):
        err = _error(capsys, ["train", *TINY, "--output-dir", str(out)])
    assert f"{out} is in use by pid {os.getpid()} on" in err
    with run_lock(out):  # released: the next writer gets it
        pass


def test_resume_with_other_settings_is_refused_naming_them(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "resumed"
    shutil.copytree(finished_run, run)
    torch.save({}, run / "checkpoint.pt")  # interrupted, by a version whose checkpoints held no settings
    argv = ["train", *TINY, "--epochs", "1", "--output-dir", str(run), "--resume"]
    err = _error(capsys, [*argv, "--lr", "0.5", "--batch-size", "4"])
    assert "cannot resume" in err and "lr 0.01 -> 0.5" in err and "batch_size 16 -> 4" in err
    assert "model 'tiny-llama' -> 'tiny-gpt2'" in _error(capsys, [*argv, "--model", "tiny-gpt2"])
    settings = {**json.loads((run / "run_config.json").read_text()), "lr": 0.5}
    torch.save({"config": settings}, run / "checkpoint.pt")  # an overwrite's checkpoint: its settings are checked
    assert "lr 0.5 -> 0.01" in _error(capsys, argv)


def test_overwrite_with_bad_data_leaves_the_finished_run_intact(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "kept"
    shutil.copytree(finished_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    (tmp_path / "data" / "CB").mkdir(parents=True)
    argv = ["train", *TINY, "--epochs", "1", "--output-dir", str(run), "--overwrite"]
    _error(capsys, [*argv, "--data-dir", str(tmp_path / "data")])
    _error(capsys, [*argv, "--model", "no/such-model-here"])
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".capt.lock"} == {
        k: v for k, v in before.items() if k != ".capt.lock"
    }
    assert main(["eval", "--adapter", str(run)]) == 0


def _cb_examples():
    from capt.recipes.data import paper_splits

    return paper_splits("cb", str(DATA))["test"][:4]


def _llama_format(max_length: int = 64):
    from capt.recipes.backbones import load_backbone
    from capt.recipes.formats import make_format

    backbone = load_backbone("tiny-llama", num_labels=3)
    return make_format(backbone.family, "cb", backbone.tokenizer, max_length)


def test_the_feature_cache_follows_the_text_not_only_the_ids(tmp_path):
    from capt.recipes.evaluate import encode_cached

    config, fmt, examples = RunConfig(cache_dir=str(tmp_path)), _llama_format(), _cb_examples()
    first = encode_cached(fmt, examples, config)
    rewritten = [dataclasses.replace(ex, fields={**ex.fields, "premise": "A new premise."}) for ex in examples]
    again = encode_cached(fmt, rewritten, config)
    assert again == [fmt.encode(ex) for ex in rewritten] != first
    relabelled = [dataclasses.replace(ex, label=(ex.label + 1) % 3) for ex in examples]
    assert [f["label"] for f in encode_cached(fmt, relabelled, config)] == [ex.label for ex in relabelled]


def test_a_torn_feature_cache_file_is_rebuilt(tmp_path):
    from capt.recipes.evaluate import encode_cached

    config, fmt, examples = RunConfig(cache_dir=str(tmp_path)), _llama_format(), _cb_examples()
    expected = encode_cached(fmt, examples, config)
    (cached,) = tmp_path.glob("*.pt")
    cached.write_bytes(cached.read_bytes()[:100])
    with pytest.warns(UserWarning, match="rebuilding the unreadable feature cache"):
        assert encode_cached(fmt, examples, config) == expected
    assert torch.load(cached, weights_only=True) == expected


def test_a_tiny_max_length_truncates_or_says_there_is_no_room():
    example = _cb_examples()[0]
    features = _llama_format(max_length=8).encode(example)
    assert max(len(row["input_ids"]) for row in features["rows"]) <= 8
    with pytest.raises(ValueError, match="max_length 1 leaves no room for the prompt"):
        _llama_format(max_length=1).encode(example)


def test_max_length_reserves_the_slots_of_an_absolute_position_table():
    from capt.recipes.run import build_model

    _, fmt = build_model(RunConfig(model="minilm", task="cb", max_length=512))
    assert fmt.max_length == 511  # 512 positions, one for the capsule slot
    _, fmt = build_model(RunConfig(model="minilm", task="cb", method="prompt", max_length=512, virtual_tokens=20))
    assert fmt.max_length == 492
    with pytest.raises(ValueError, match="--max-length 100000 is beyond the 512 positions of minilm"):
        build_model(RunConfig(model="minilm", task="cb", max_length=100000))


def test_an_input_as_long_as_the_position_table_is_a_clear_error_under_capt():
    from tests.conftest import tiny_bert_classifier

    model = capt.get_capt_model(tiny_bert_classifier(), capt.CaptConfig())  # 64 positions
    model(input_ids=torch.ones(1, 63, dtype=torch.long))  # 63 tokens + the slot fit
    with pytest.raises(ValueError, match="truncate inputs to 63 tokens"):
        model(input_ids=torch.ones(1, 64, dtype=torch.long))


def test_an_all_nan_adapter_is_refused():
    from tests.conftest import tiny_bert_model

    model = capt.get_capt_model(tiny_bert_model(), capt.CaptConfig())
    state = {k: torch.full_like(v, math.nan) for k, v in model.adapter_state_dict().items()}
    with pytest.raises(ValueError, match="holds NaN or inf values"):
        model.load_adapter_state_dict(state)


def test_the_metrics_log_stays_valid_json_with_nan(tmp_path):
    from capt.recipes.reporting import MetricsLog, read_log

    log = MetricsLog(tmp_path)
    log.write({"kind": "step", "epoch": 1, "step": 1, "loss": math.nan, "lr": math.inf})
    log.close()
    assert read_log(tmp_path) == [{"kind": "step", "epoch": 1, "step": 1, "loss": None, "lr": None}]


def test_weights_that_became_nan_are_never_saved_as_best(tmp_path, monkeypatch):
    from capt.recipes import train as recipe

    real_validate = recipe.TrainingRecipe._validate

    def poisoned(self, epoch):  # the last update of the epoch blew the weights up
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad:
                    p.fill_(math.nan)
        real_validate(self, epoch)

    monkeypatch.setattr(recipe.TrainingRecipe, "_validate", poisoned)
    config = RunConfig(
        model="tiny-llama",
        task="cb",
        limit_train=8,
        limit_eval=8,
        epochs=1,
        data_dir=str(DATA),
        output_dir=str(tmp_path),
    )
    with pytest.raises(FloatingPointError, match="became NaN or inf by epoch 1"):
        recipe.train(config)
    assert not (tmp_path / "trainable.safetensors").exists()


def test_eval_on_a_task_the_head_was_not_trained_for_is_refused(tmp_path, capsys):
    """An encoder's 3-way CB head must not silently score RTE's 2 labels (it did: 62.50 accuracy, written)."""
    out = tmp_path / "cb-encoder"
    encoder = ["--model", "minilm", *TINY[2:]]
    assert main(["train", *encoder, "--epochs", "1", "--output-dir", str(out)]) == 0
    err = _error(capsys, ["eval", "--adapter", str(out), "--task", "rte", "--data-dir", str(DATA)])
    assert "--task rte" in err and "trained on cb with a 3-output head; rte needs 2 outputs" in err
    assert not (out / "eval-rte-test.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--tasks", "cb,cb", "--methods", "capt"], "--tasks names cb more than once"),
        (["sweep", "--tasks", "cb", "--methods", "capt,lora,capt"], "--methods names capt more than once"),
        (["predict", "--adapters", "cb=a,cb=b", "--input", "x", "--output", "y"], "--adapters names cb more than once"),
    ],
)
def test_a_name_given_twice_is_refused(argv, message, tmp_path, capsys):
    err = _error(capsys, [*argv, "--output-dir", str(tmp_path / "out")] if argv[0] != "predict" else argv)
    assert message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--queue-size", "-1"], "--queue-size must be >= 1, got -1"),
        (["--timeout", "0"], "--timeout must be > 0, got 0.0"),
        (["--batch-window-ms", "nan"], "--batch-window-ms must be >= 0, got nan"),
        (["--batch-window-ms", "-5"], "--batch-window-ms must be >= 0, got -5.0"),
    ],
)
def test_bad_serve_limits_are_refused_before_the_model_loads(flags, message, capsys):
    err = _error(capsys, ["serve", "--model", "tiny-llama", "--adapters", "a=nowhere", *flags])
    assert message in err


def test_bad_serve_arguments_are_refused_before_anything_loads(tmp_path, capsys):
    """A port out of range or in use, a host that does not resolve, a missing adapter folder: one line naming the
    argument, before the model loads (the model named here does not exist, so loading it would fail otherwise)."""
    run = ["serve", "--model", str(tmp_path / "no-model"), "--adapters", f"a={tmp_path}"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--port", "70000"], "--port must be 1 to 65535, got 70000"),
            (["--port", "-1"], "--port must be 1 to 65535, got -1"),
            (["--port", str(port)], f"--host 127.0.0.1 --port {port}: cannot listen there"),
            (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid': cannot be resolved"),
        ]
        for flags, message in cases:
            err = _error(capsys, [*run, *flags])
            assert message in err and "internal error" not in err and "no-model" not in err, err
    missing = _error(capsys, [*run[:4], f"a={tmp_path},b={tmp_path / 'gone'}", "--port", str(port)])
    assert f"{tmp_path / 'gone'}: no such adapter folder" in missing and "no-model" not in missing


def test_a_finished_run_is_read_back_only_under_its_own_settings(finished_run, tmp_path, capsys):
    """compare and train --resume over a finished folder: read back when the settings match (output_dir and
    cache_dir cannot change a result), refused naming the settings when they differ (it was read back silently)."""
    import shutil

    run = tmp_path / "root" / "cb" / "capt"
    shutil.copytree(finished_run, run)
    weights = (run / "trainable.safetensors").stat().st_mtime_ns
    compare = ["compare", "--tasks", "cb", "--methods", "capt", *TINY[4:], "--model", "tiny-llama"]
    compare += ["--epochs", "1", "--output-dir", str(tmp_path / "root")]
    assert main(compare) == 0  # another output_dir and cache_dir: read back
    assert (run / "trainable.safetensors").stat().st_mtime_ns == weights
    err = _error(capsys, [*compare, "--lr", "0.5", "--batch-size", "4"])
    assert f"{run} holds a finished run with other settings: lr 0.01 -> 0.5; batch_size 16 -> 4" in err
    assert "pass --overwrite to replace it or choose another --output-dir" in err
    assert "seeds 1 -> 2" in _error(capsys, [*compare, "--seeds", "2"])
    resume = ["train", *TINY, "--epochs", "2", "--output-dir", str(run), "--resume"]
    assert "epochs 1 -> 2" in _error(capsys, resume)
    assert (run / "trainable.safetensors").stat().st_mtime_ns == weights


def test_a_setting_added_after_a_run_was_written_matches_its_default(finished_run, tmp_path):
    import shutil

    from capt.recipes.experiments import finished_run as read_back

    run = tmp_path / "old"
    shutil.copytree(finished_run, run)
    stored = json.loads((run / "run_config.json").read_text())
    del stored["decoder_head"]  # as if written before the field existed
    (run / "run_config.json").write_text(json.dumps(stored))
    config = read_run_config(run)
    assert read_back(config, 1) is not None
    with pytest.raises(ValueError, match="decoder_head 'lm' -> 'classifier'"):
        read_back(dataclasses.replace(config, decoder_head="classifier"), 1)


# ---------------------------------------------------------------------- the library API


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"init_std": math.nan}, "init_std must be a finite number > 0, got nan"),
        ({"init_std": math.inf}, "init_std must be a finite number > 0, got inf"),
        ({"init_std": "0.02"}, "init_std must be a finite number > 0, got '0.02'"),
        ({"instance_aware": "no"}, "instance_aware must be True or False, got 'no'"),
        ({"share_instance_module": "no"}, "share_instance_module must be True or False, got 'no'"),
        ({"modules_to_save": "classifier"}, "modules_to_save must be a list of module names"),
        ({"modules_to_save": ["classifier", 3]}, "modules_to_save must be a list of module names"),
        ({"layers_path": ""}, "layers_path must be a dotted path such as 'model.layers' or None, got ''"),
    ],
)
def test_a_bad_capt_config_field_is_refused_naming_it(settings, message):

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        capt.CaptConfig(**settings)


def test_a_projection_rank_beyond_the_hidden_size_is_refused_before_allocating():

    with pytest.raises(ValueError, match="CaptConfig.rank 1000000000 is beyond this model's hidden size 32"):
        capt.get_capt_model(tiny_llama(), capt.CaptConfig(variant="project", rank=10**9))


def test_get_capt_model_checks_its_arguments():
    from peft import LoraConfig, get_peft_model

    with pytest.raises(TypeError, match="base_model must be a transformers PreTrainedModel, got Linear"):
        capt.get_capt_model(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"config must be a CaptConfig, got dict; for a dict use CaptConfig.from_dict"):
        capt.get_capt_model(tiny_llama(), {"num_slots": 2})
    lora = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="base_model is a peft.PeftModel: CaPT would freeze its adapter's weights"):
        capt.get_capt_model(lora)
    assert any(p.requires_grad for p in lora.parameters())  # the LoRA weights are left trainable


def test_a_model_without_a_token_input_is_refused_at_attach_time():
    from transformers import ViTConfig, ViTModel

    vit = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="ViTModel takes neither input_ids nor inputs_embeds: CaPT needs a text"):
        capt.get_capt_model(vit)


def test_a_stored_adapter_config_that_is_not_an_object_or_has_a_bad_field_names_the_file(tmp_path):

    config_file = tmp_path / "adapter_config.json"
    config_file.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{config_file}: expected a JSON object of CaptConfig fields, got list"):
        capt.CaptConfig.from_pretrained(tmp_path)
    config_file.write_text(json.dumps({"peft_type": "CAPT", "num_slots": 0}))
    with pytest.raises(ValueError, match=f"{config_file}: CaptConfig.num_slots must be a positive integer"):
        capt.CaptConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"input_ids": torch.ones(1, 0, dtype=torch.long)}, r"input_ids has shape \(1, 0\): give at least one"),
        ({"input_ids": torch.ones(0, 4, dtype=torch.long)}, r"input_ids has shape \(0, 4\): give at least one"),
        ({"input_ids": [[5, 6, 7]]}, "input_ids must be a torch tensor of token ids, got list"),
        (
            {"input_ids": torch.tensor([5, 6, 7])},
            r"must be integer token ids of shape \(batch, length\), got torch.int64",
        ),
        ({"input_ids": torch.ones(1, 3)}, "must be integer token ids of shape .*, got torch.float32"),
    ],
)
def test_empty_or_malformed_inputs_are_refused_up_front(inputs, message):

    model = capt.get_capt_model(tiny_llama())
    with pytest.raises(ValueError, match=message):
        model(**inputs)
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, max_new_tokens=2)


@pytest.mark.parametrize("name", ["", "a.b", 3])
def test_an_adapter_name_that_cannot_key_modules_is_refused(name):

    message = f"adapter name must be a non-empty string without '.', got {name!r}"
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        capt.CaptModel(tiny_llama(), capt.CaptConfig(), adapter_name=name)
    model = capt.get_capt_model(tiny_llama())
    with pytest.raises(ValueError, match="adapter name must be a non-empty string"):
        model.add_adapter(name, capt.CaptConfig())


def test_add_adapter_and_save_pretrained_check_their_arguments(tmp_path):

    model = capt.get_capt_model(tiny_llama())
    with pytest.raises(TypeError, match="config must be a CaptConfig, got dict"):
        model.add_adapter("other", {"init": "normal"})
    with pytest.raises(ValueError, match=r"no adapter named 'nope' is loaded; loaded: \['default'\]"):
        model.save_pretrained(tmp_path / "a", adapter_name="nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="file is a file; save the adapter into a folder"):
        model.save_pretrained(tmp_path / "file")


def test_a_config_folder_or_an_output_file_names_the_flag(tmp_path, capsys):
    (tmp_path / "blocker").write_text("")
    train = ["train", *TINY]
    assert "--config " + str(tmp_path) + ": a folder; give a YAML file" in _error(
        capsys, [*train, "--config", str(tmp_path), "--output-dir", str(tmp_path / "out")]
    )
    assert "no such file" in _error(capsys, [*train, "--config", str(tmp_path / "none.yaml")])
    err = _error(capsys, [*train, "--output-dir", str(tmp_path / "blocker")])
    assert f"--output-dir {tmp_path / 'blocker'}: {tmp_path / 'blocker'} is a file, not a folder" in err


def test_causal_lm_labels_of_another_shape_are_refused_before_they_skip_the_target_masking():
    model = capt.get_capt_model(tiny_llama())
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"labels has shape \(1, 2\), input_ids has \(1, 3\): a causal LM takes one"):
        model(input_ids=ids, labels=ids[:, :2])
    assert model(input_ids=ids, labels=torch.tensor([[-100, 6, 7]])).loss.isfinite()


@pytest.mark.slow  # test_reliability.py resumes a killed run with more seeds in the default suite (13 s)
def test_several_seeds_resume_after_a_kill_between_two_seeds(tmp_path, capsys):
    """Seed 0 finished, seed 1 killed before its first checkpoint: --resume keeps seed 0 and trains seed 1 (it
    said "no checkpoint.pt ... start it again with --overwrite", which retrains seed 0 too)."""
    import shutil

    out = tmp_path / "seeds"
    argv = ["train", *TINY, "--epochs", "1", "--seeds", "2", "--output-dir", str(out)]
    assert main(argv) == 0
    expected = json.loads((out / "results.json").read_text())
    seed_0 = (out / "seed-0" / "trainable.safetensors").stat().st_mtime_ns
    shutil.rmtree(out / "seed-1")
    (out / "results.json").unlink()
    assert main([*argv, "--resume"]) == 0
    assert (out / "seed-0" / "trainable.safetensors").stat().st_mtime_ns == seed_0
    got = json.loads((out / "results.json").read_text())
    assert got["test"] == expected["test"] and got["seeds"] == [0, 1]


def test_settings_a_method_does_not_read_never_block_its_read_back():
    """A new default of a method-only setting (DePT's second lr went 1e-4 -> 5e-4) must not make every other
    method's finished runs "other settings"; for the method that reads it, it still counts."""
    from capt.recipes.run import RunConfig, setting_differences

    assert setting_differences(RunConfig(method="capt"), RunConfig(method="capt", lr_secondary=1e-4)) == {}
    assert setting_differences(RunConfig(method="lora", lora_rank=4), RunConfig(method="lora")) == {"lora_rank": (8, 4)}
    assert setting_differences(RunConfig(method="capt", lora_rank=4), RunConfig(method="capt")) == {}
    stored = RunConfig(method="dept", lr_secondary=1e-4)
    assert setting_differences(RunConfig(method="dept"), stored) == {"lr_secondary": (1e-4, 5e-4)}


def test_a_run_of_an_older_method_revision_is_not_read_back_as_this_method(finished_run, tmp_path, capsys, monkeypatch):
    """A method whose definition changed (a revision bump) must not have its old runs reused by compare/sweep."""
    import json
    import shutil

    from capt.recipes import methods

    run = tmp_path / "root" / "cb" / "capt"
    shutil.copytree(finished_run, run)
    assert json.loads((run / "results.json").read_text())["runs"][0]["method_revision"] == 1
    compare = ["compare", "--tasks", "cb", "--methods", "capt", *TINY[4:], "--model", "tiny-llama"]
    compare += ["--epochs", "1", "--output-dir", str(tmp_path / "root")]
    monkeypatch.setitem(methods.METHOD_REVISIONS, "capt", 2)  # as if capt's definition had changed since
    err = _error(capsys, compare)
    assert f"{run} holds a finished run with other settings: method_revision 1 -> 2" in err
