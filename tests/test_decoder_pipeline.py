"""The decoder pipeline's fast paths give what the plain path gives: every position through the LM head."""

import dataclasses
import json
import math
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch

import capt
from capt.bank import load_bank
from capt.recipes.backbones import load_backbone
from capt.recipes.data import paper_splits
from capt.recipes.formats import OptionScoringFormat, make_format, prompt_pass_is_exact
from capt.recipes.methods import apply_method

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
DECODER_METHODS = ("capt", "deep-prompt", "prompt", "ptv2", "lora")


def _trained_looking(model) -> None:
    """Non-zero adapter weights, so a path that drops the adapter or leaks targets into the capsule shows."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in (p for p in model.parameters() if p.requires_grad):
            param.add_(torch.randn(param.shape, generator=generator) * 0.3)


def _model_and_batch(method: str, task: str = "cb", count: int = 6):
    backbone = load_backbone("tiny-llama")
    fmt = make_format(backbone.family, task, backbone.tokenizer, 96)
    model = apply_method(backbone, method).eval()
    _trained_looking(model)
    examples = paper_splits(task, DATA)["train"][:count]
    return model, fmt, fmt.collate([fmt.encode(ex) for ex in examples])


@pytest.mark.parametrize("method", DECODER_METHODS)
def test_option_scores_from_trailing_logits_equal_the_full_forward(method):
    model, fmt, batch = _model_and_batch(method)
    inputs = batch["score_inputs"]
    with torch.no_grad():
        fast = fmt.row_scores(model, inputs)
        plain = OptionScoringFormat.row_scores(fmt, model, inputs)  # labels in, every position's logits out
    assert (inputs["labels"][:, -1] == -100).any()  # some right-padded rows end their targets early
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["capt", "deep-prompt", "lora", "ia3", "adapter", "bare"])
@pytest.mark.parametrize("task", ["copa", "cb"])
def test_option_scores_from_one_prompt_pass_equal_one_pass_per_option(method, task):
    if method == "bare":  # the zero-shot reference: the backbone itself
        backbone = load_backbone("tiny-llama")
        model = backbone.model.eval()
        fmt = make_format(backbone.family, task, backbone.tokenizer, 96)
        batch = fmt.collate([fmt.encode(ex) for ex in paper_splits(task, DATA)["train"][:6]])
    else:
        model, fmt, batch = _model_and_batch(method, task)
    inputs, options = batch["score_inputs"], batch["options"]
    prompts = (inputs["attention_mask"].bool() & (inputs["labels"] == -100)).sum(-1)
    assert len(set(prompts.tolist())) > 1  # the prompt batch is left-padded
    if task == "copa":
        assert len(set((inputs["labels"] != -100).sum(-1).tolist())) > 1  # options of different lengths
    assert prompt_pass_is_exact(model)
    with torch.no_grad():
        one_pass = fmt.scores_from_prompt_pass(model, inputs, options)
        per_row = fmt.row_scores(model, inputs)
        table = fmt.scores(model, batch)
    torch.testing.assert_close(one_pass, per_row, atol=1e-4, rtol=0)
    assert torch.equal(table[torch.isfinite(table)], one_pass)  # scores() takes the one-pass path


@pytest.mark.parametrize("task", ["copa", "cb"])
def test_a_bank_with_per_row_adapters_scores_from_one_prompt_pass_too(task, tmp_path):
    """`capt predict` and `/v1/classify`: adapters mixed row by row, each with its own `lm_head`, which answers the
    continued pass of COPA's longer options too."""
    backbone = load_backbone("tiny-llama")
    for seed, name in enumerate(("a", "b"), start=1):
        model = capt.get_capt_model(load_backbone("tiny-llama").model, capt.CaptConfig(modules_to_save=["lm_head"]))
        _trained_looking(model)
        with torch.no_grad():
            model.base_model.lm_head.weight.normal_(generator=torch.Generator().manual_seed(seed))
        model.save_pretrained(tmp_path / name)
    bank = load_bank(backbone.model, {name: tmp_path / name for name in ("a", "b")}).eval()
    fmt = make_format(backbone.family, task, backbone.tokenizer, 96)
    batch = fmt.collate([fmt.encode(ex) for ex in paper_splits(task, DATA)["train"][:6]])
    inputs, options = batch["score_inputs"], batch["options"]
    names = [name for i, n in enumerate(options) for name in ["ab"[i % 2]] * n]
    mixed = partial(bank, adapter_names=names)
    assert prompt_pass_is_exact(mixed)
    with torch.no_grad():
        table = fmt.scores(mixed, batch)
        per_row = fmt.row_scores(mixed, inputs)
        only_a = fmt.row_scores(partial(bank, adapter_names=["a"] * len(names)), inputs)
    # The random lm_heads make these log-likelihoods hundreds of nats: float32 rounding alone (which differs
    # between AVX2 and AVX512 kernels) reaches 1e-4 there, hence rtol at float32's scale.
    torch.testing.assert_close(table[torch.isfinite(table)], per_row, atol=1e-4, rtol=1e-6)
    assert not torch.allclose(per_row, only_a, atol=1e-2)  # the "b" rows really answer with their own adapter


@pytest.mark.parametrize("method", ["prompt", "ptv2", "dept"])
def test_methods_whose_prompt_pass_is_not_exact_score_every_row(method):
    model, fmt, batch = _model_and_batch(method)
    assert not prompt_pass_is_exact(model)
    with torch.no_grad():
        table = fmt.scores(model, batch)
        per_row = fmt.row_scores(model, batch["score_inputs"])
    assert torch.equal(table.flatten(), per_row)  # CB: three options per example, none missing


def test_bf16_autocast_scores_every_row_even_where_the_prompt_pass_is_exact(monkeypatch):
    """bf16 rounds the two paths differently (enough to flip near-tied predictions): a --bf16 run stays on the
    row-by-row path its committed results were made with."""
    model, fmt, batch = _model_and_batch("capt")
    assert prompt_pass_is_exact(model)

    def no_prompt_pass(*args, **kwargs):
        raise AssertionError("one prompt pass under bf16 autocast")

    monkeypatch.setattr(fmt, "scores_from_prompt_pass", no_prompt_pass)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        table = fmt.scores(model, batch)
        per_row = fmt.row_scores(model, batch["score_inputs"])
    assert torch.equal(table.flatten(), per_row)


@pytest.mark.parametrize("method", DECODER_METHODS)
def test_training_loss_and_gradients_equal_the_models_own_loss(method):
    model, fmt, batch = _model_and_batch(method)
    trainable = [p for p in model.parameters() if p.requires_grad]
    fast = fmt.loss(model, batch)
    fast_grads = torch.autograd.grad(fast, trainable)
    plain = model(**batch["train_inputs"]).loss
    plain_grads = torch.autograd.grad(plain, trainable)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)
    for got, want in zip(fast_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_sweep_picks_the_rate_by_validation_trains_the_seeds_and_resumes(tmp_path, monkeypatch, capsys):
    from capt.recipes.cli import main
    from capt.recipes.experiments import grid_point_name

    monkeypatch.setenv("HOME", str(tmp_path))  # the tokenisation cache
    out = tmp_path / "sweep"
    cell_argv = ["sweep", "--tasks", "cb", "--methods", "capt", "--seeds", "2"]
    argv = [*cell_argv, "--lr-grid", "capt=1e-3,3e-1"]
    quick = ["--model", "tiny-llama", "--limit-train", "8", "--limit-eval", "8", "--epochs", "1", "--batch-size", "4"]
    assert main([*argv, *quick, "--data-dir", str(DATA), "--output-dir", str(out)]) == 0
    cell = json.loads((out / "cb" / "capt" / "results.json").read_text())
    grid = {p["lr"]: p["validation_score"] for p in cell["grid"]}
    assert set(grid) == {1e-3, 3e-1}
    assert cell["chosen_lr"] == max(grid, key=grid.get)  # by validation; ties keep the first rate
    assert cell["seeds"] == [0, 1] and cell["runs"][1]["seed"] == 1
    chosen = out / "cb" / "capt" / "grid" / grid_point_name(cell["chosen_lr"]) / "results.json"
    assert [cell["runs"][0]] == json.loads(chosen.read_text())["runs"]  # seed 0 is the grid run, not retrained
    table = (out / "sweep.md").read_text()
    assert "| cb | capt |" in table and "| cb | zero-shot |" in table and "| cb | majority |" in table
    stamp = (out / "cb" / "capt" / "seed-1" / "results.json").stat().st_mtime_ns
    assert main([*argv, *quick, "--data-dir", str(DATA), "--output-dir", str(out)]) == 0  # resumes: trains nothing
    assert (out / "cb" / "capt" / "seed-1" / "results.json").stat().st_mtime_ns == stamp

    # The grid changes: seed-1 follows the chosen rate, retrained when it was trained at another one.
    def seed_lr() -> float:
        return json.loads((out / "cb" / "capt" / "seed-1" / "run_config.json").read_text())["lr"]

    chosen, other = cell["chosen_lr"], next(lr for lr in grid if lr != cell["chosen_lr"])
    rest = [*cell_argv, *quick, "--no-references", "--data-dir", str(DATA), "--output-dir", str(out)]
    assert main([*rest, "--lr-grid", f"capt={other:g}"]) == 0  # the grid point is read back, seed-1 retrained
    assert seed_lr() == other
    assert main([*rest, "--lr-grid", f"capt={chosen:g},{other:g}"]) == 0  # extended: the first winner again
    assert seed_lr() == chosen
    again = json.loads((out / "cb" / "capt" / "results.json").read_text())
    assert again["chosen_lr"] == chosen and again["runs"][1]["test"] == cell["runs"][1]["test"]
    capsys.readouterr()
    assert main([*rest, "--lr-grid", f"capt={chosen:g}", "--epochs", "2"]) == 1  # other settings: refused
    err = capsys.readouterr().err
    assert "holds a finished run with other settings: epochs 1 -> 2" in err and "--overwrite" in err


@pytest.fixture
def training_forbidden(monkeypatch):
    """The sweep under test must read every run back: training one fails the test, naming its folder."""
    from capt.recipes import experiments

    def no_training(config, resume=False):
        raise AssertionError(f"trained {config.output_dir} (it should have been read back)")

    monkeypatch.setattr(experiments, "train", no_training)


def _copy_files(files, source: Path, target: Path) -> None:
    """Each of `files` (paths under `source`) copied to the same place under `target`."""
    for path in files:
        copy = target / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(path.read_bytes())


@pytest.mark.parametrize(
    ("study", "task", "flags"), [("smollm2-study-bf16", "cb", ["--bf16"]), ("smollm2-study", "copa", [])]
)
def test_the_committed_smollm2_study_is_read_back_not_retrained(
    study, task, flags, tmp_path, monkeypatch, training_forbidden
):
    """The study command over a copy of the committed bf16 CB and float32 COPA cells, with the grid each cell
    records and the settings from the config's `per_task` section (COPA's max length 32) and `per_method` section
    (head-only and full fine-tuning read through the classification head), reads every run back and rewrites the
    same cells."""
    from capt.recipes.cli import main

    repo = Path(__file__).resolve().parents[1]
    study = Path("results") / study
    cells = {}
    for done in sorted((repo / study / task).glob("*/results.json")):
        cells[done.parent.name] = done.read_text()
        _copy_files(done.parent.rglob("*.json*"), repo, tmp_path)  # results, run_config, metrics.jsonl
    assert {"capt", "deep-prompt"} <= set(cells) and (
        study.name == "smollm2-study-bf16" or {"head", "full"} <= set(cells)
    )
    # Each rate as a user types it from the table (6 digits: 0.00333333 for the run trained at 0.01 / 3).
    grids = ";".join(f"{m}=" + ",".join(f"{p['lr']:g}" for p in json.loads(c)["grid"]) for m, c in cells.items())
    monkeypatch.setenv("HOME", str(tmp_path))  # another cache_dir than the study's: it cannot change a result
    monkeypatch.chdir(tmp_path)
    argv = ["sweep", "--config", str(repo / "configs" / "smollm2-study.yaml"), "--tasks", task, "--lr-grid", grids]
    argv += ["--methods", ",".join(cells), "--seeds", "3", *flags]
    argv += ["--data-dir", "../shared/data/superglue", "--output-dir", str(study), "--no-references"]
    assert main(argv) == 0
    for method, text in cells.items():
        assert (tmp_path / study / task / method / "results.json").read_text() == text  # rebuilt the same


def test_the_study_plan_holds_every_committed_cell():
    """`capt sweep --config configs/smollm2-study.yaml` (no --tasks, --methods) runs the plan: every committed
    float32 cell must be in it, or the one-command study would leave it out of the table."""
    from capt.recipes.cli import read_settings_file

    repo = Path(__file__).resolve().parents[1]
    plan = read_settings_file(str(repo / "configs" / "smollm2-study.yaml")).plan
    committed = {
        (p.parent.parent.name, p.parent.name) for p in (repo / "results" / "smollm2-study").glob("*/*/results.json")
    }
    assert len(committed) >= 28  # as of 2026-12-05; the study only grows
    assert committed <= {(task, method) for task, methods in plan.items() for method in methods}


def test_sweep_extends_a_grid_whose_best_rate_is_at_its_end(tmp_path, monkeypatch, capsys, training_forbidden):
    """On a copy of the committed bf16 CB CaPT cell (validation 0.0033: 46.5, 0.01: 53.5, 0.03: 64.4, 0.1: 61.0):
    the grid 0.0033, 0.01 is won by its top, so 0.03 (its ratio, 3x) is added and read back; 0.03 wins again at the
    new top, so a second extension asks for 0.09, which no run holds."""
    from capt.recipes.cli import main

    repo = Path(__file__).resolve().parents[1]
    study = Path("results") / "smollm2-study-bf16"
    _copy_files((repo / study / "cb" / "capt").rglob("*.json*"), repo, tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    argv = ["sweep", "--config", str(repo / "configs" / "smollm2-study.yaml"), "--tasks", "cb", "--methods", "capt"]
    argv += ["--lr-grid", "capt=0.00333333,0.01", "--seeds", "3", "--max-length", "160", "--bf16", "--no-references"]
    argv += ["--data-dir", "../shared/data/superglue", "--output-dir", str(study)]
    assert main([*argv, "--extend-grid", "1"]) == 0
    cell = json.loads((tmp_path / study / "cb" / "capt" / "results.json").read_text())
    assert [round(p["lr"], 8) for p in cell["grid"]] == [0.00333333, 0.01, 0.03]
    assert cell["chosen_lr"] == 0.03 and cell["seeds"] == [0, 1, 2]  # the committed seeds at 0.03, read back
    capsys.readouterr()
    assert main([*argv, "--extend-grid", "2"]) != 0
    assert f"trained {study}/cb/capt/grid/lr-0.09 " in capsys.readouterr().err
    assert main([*argv, "--extend-grid", "-1"]) == 1
    assert "--extend-grid must be 0 or more" in capsys.readouterr().err


def test_the_rate_beyond_the_grid_follows_its_outer_ratio_and_only_a_lone_winner_at_an_end():
    from capt.recipes.experiments import next_rate_beyond_edge

    assert next_rate_beyond_edge({0.01: 0.5, 0.03: 0.6, 0.1: 0.7}) == pytest.approx(0.1 * 0.1 / 0.03)
    assert next_rate_beyond_edge({0.03: 0.5, 0.01: 0.7, 0.1: 0.6}) == pytest.approx(0.01 / 3)  # any order
    assert next_rate_beyond_edge({0.01: 0.5, 0.03: 0.7, 0.1: 0.6}) is None  # inside
    assert next_rate_beyond_edge({0.01: 0.7, 0.03: 0.7, 0.1: 0.6}) is None  # the end ties with another rate
    assert next_rate_beyond_edge({0.01: 0.7}) is None  # one rate: no ratio


def test_a_grid_point_folder_names_its_rate_to_six_significant_digits_and_reads_back():
    from capt.recipes.experiments import grid_point_name, grid_point_rate

    assert grid_point_name(0.01 / 3) == "lr-0.00333333"  # the committed study's folder names
    assert grid_point_name(3e-4) == "lr-0.0003" and grid_point_name(1e-5) == "lr-1e-05"
    assert grid_point_rate("lr-0.00333333") == 0.00333333 and grid_point_rate("lr-1e-05") == 1e-5
    assert grid_point_name(grid_point_rate(grid_point_name(0.01 / 3))) == grid_point_name(0.01 / 3)


def test_sweep_finished_only_tabulates_what_exists_and_trains_nothing(tmp_path, training_forbidden):
    from capt.recipes.cli import main

    repo = Path(__file__).resolve().parents[1]
    archive = repo / "results" / "smollm2-study-bf16"
    # Two finished cells, and the unfinished LoRA cell's two finished grid points (of three).
    finished = [Path("cb", method, "results.json") for method in ("capt", "deep-prompt")]
    finished += [path.relative_to(archive) for path in (archive / "cb" / "lora").glob("grid/*/results.json")]
    _copy_files([archive / path for path in finished], archive, tmp_path / "study")
    lora_minutes = [json.loads((archive / p).read_text())["wall_time_s"] / 60 for p in finished[2:]]
    argv = ["sweep", "--tasks", "cb,copa", "--methods", "capt,deep-prompt,lora", "--finished-only", "--no-references"]
    assert main([*argv, "--seeds", "3", "--model", "smollm2", "--output-dir", str(tmp_path / "study")]) == 0
    table = (tmp_path / "study" / "sweep.md").read_text()
    assert "| cb | capt | 17,280 (0.0128%) | 0.03 |" in table and "| cb | deep-prompt |" in table
    assert len(lora_minutes) == 2
    pace = f"{sum(lora_minutes) / 2:.0f} min per run so far"
    lora = f"cb/lora: 2 of 3 grid points, 0 of 2 more seeds (3 runs left, {pace})"
    untouched = "{}: 0 of 3 grid points, 0 of 2 more seeds (5 runs left)"
    expected = "; ".join([lora, *(untouched.format(f"copa/{m}") for m in ("capt", "deep-prompt", "lora"))])
    assert f"Not finished yet: {expected}." in table
    cb_hours = sum(lora_minutes) / 2 * 3 / 60  # LoRA's 3 runs left at its own pace; COPA has no run to price
    priced = f"about {cb_hours:.1f} run-hours (cb {cb_hours:.1f}): a cell's own mean run time so far, or before its"
    unpriced = "first run its task's pace times its method's; no finished run yet on copa."
    assert f"Left in all: 18 runs; {priced} {unpriced}\n" in table
    assert "| average |" not in table  # no method has both tasks
    assert not (tmp_path / "study" / "cb" / "lora" / "results.json").exists()  # nor summarises an unfinished cell


def test_sweep_averages_only_the_tasks_whose_cells_are_all_finished(tmp_path, training_forbidden):
    """The committed CB and COPA CaPT cells, with RTE's not run: the average row is CB's and COPA's, as before RTE
    was planned, and the line under the table says RTE is left out."""
    from capt.recipes.cli import main

    study = Path(__file__).resolve().parents[1] / "results" / "smollm2-study"
    cells = {task: study / task / "capt" / "results.json" for task in ("cb", "copa")}
    _copy_files(cells.values(), study, tmp_path / "study")
    scores = {task: json.loads(path.read_text())["score"]["mean"] for task, path in cells.items()}
    argv = ["sweep", "--tasks", "cb,copa,rte", "--methods", "capt", "--finished-only", "--no-references"]
    assert main([*argv, "--seeds", "3", "--model", "smollm2", "--output-dir", str(tmp_path / "study")]) == 0
    table = (tmp_path / "study" / "sweep.md").read_text()
    average = 100 * (scores["cb"] + scores["copa"]) / 2
    assert f"| average | capt | - | - | - | {average:.1f} |" in table
    assert "The averages are over cb, copa; rte not finished." in table


def test_cell_progress_counts_runs_beyond_the_grid_and_names_the_extensions_still_possible(tmp_path):
    from capt.recipes.experiments import cell_progress

    cell = tmp_path / "cb" / "capt"

    def finish(folder: str, minutes: int, validation: float) -> None:
        (cell / folder).mkdir(parents=True, exist_ok=True)
        record = {"wall_time_s": 60 * minutes, "runs": [{"best_validation_score": validation}]}
        (cell / folder / "results.json").write_text(json.dumps(record))

    for folder, minutes, validation in [
        ("grid/lr-0.01", 10, 0.5),
        ("grid/lr-0.03", 20, 0.6),
        ("grid/lr-0.09", 30, 0.7),
        ("grid/lr-0.27", 40, 0.8),  # best alone at the upper end: a second extension may follow
    ]:
        finish(folder, minutes, validation)
    (cell / "grid" / "lr-0.81").mkdir()  # started, not finished: neither done nor counted
    grid = [0.01, 0.03, 0.09]
    extended = "cb/capt: 3 of 3 grid points and 1 beyond it, 0 of 2 more seeds"
    assert (
        str(cell_progress(cell, grid, 3, extend=2))
        == f"{extended} (2 runs left + up to 1 beyond the grid, 25 min per run so far)"
    )
    assert str(cell_progress(cell, grid, 3, extend=1)) == f"{extended} (2 runs left, 25 min per run so far)"
    finish("grid/lr-0.27", 40, 0.65)  # now the best (0.09) lies inside the rates tried: no extension can follow
    assert str(cell_progress(cell, grid, 3, extend=2)) == f"{extended} (2 runs left, 25 min per run so far)"
    fresh = cell_progress(tmp_path / "cb" / "lora", grid, 3, extend=1)
    assert str(fresh) == "cb/lora: 0 of 3 grid points, 0 of 2 more seeds (5 runs left + up to 1 beyond the grid)"
    finish("seed-1", 25, 0.7)
    progress = cell_progress(cell, grid, 3, extend=1)
    assert str(progress).endswith("1 of 2 more seeds (1 run left, 25 min per run so far)")


def test_work_left_prices_a_cell_at_its_own_pace_or_its_task_times_its_method_and_names_tasks_without_one(tmp_path):
    from capt.recipes.experiments import cell_progress, work_left

    finished = [("cb/capt/grid/lr-0.01", 10), ("cb/capt/seed-1", 20), ("cb/lora/grid/lr-0.001", 30)]
    for run, minutes in [*finished, ("copa/capt/grid/lr-0.01", 5)]:
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "results.json").write_text(json.dumps({"wall_time_s": 60 * minutes}))
    (tmp_path / "cb" / "lora" / "seed-1").mkdir()  # started, not finished: not part of the pace
    progress = [
        cell_progress(tmp_path / "cb" / "lora", [0.0003, 0.001, 0.003], 3, extend=1),  # 4 left + up to 1
        cell_progress(tmp_path / "copa" / "lora", [0.0003, 0.001, 0.003], 3),  # 5 left, no run of its own
        cell_progress(tmp_path / "rte" / "capt", [0.01], 2, extend=1),  # 2 left + up to 1, and no run on rte
    ]
    assert [(p.left, p.maybe) for p in progress] == [(4, 1), (5, 0), (2, 1)]
    # cb/lora at its own 30 min: 4 runs = 2.0 h. copa/lora has none: LoRA ran 2x CaPT's mean (30 vs 15 min) on CB,
    # so at 2 x COPA's CaPT pace (5 min) = 10 min: 5 runs = 0.8 h (a task-wide mean would say 5 min).
    assert work_left(progress, tmp_path) == (
        "Left in all: 11 runs (+ up to 2 beyond the grids); about 2.8 run-hours (cb 2.0, copa 0.8): a cell's own "
        "mean run time so far, or before its first run its task's pace times its method's; no finished run yet on "
        "rte."
    )


def test_run_minutes_model_fits_task_and_method_factors_that_multiply():
    from capt.recipes.experiments import run_minutes_model

    task_minutes, method_factor = {"cb": 12.0, "copa": 3.0, "rte": 20.0}, {"capt": 1.0, "prompt": 1.5, "lora": 2.5}
    truth = {(t, m): task_minutes[t] * method_factor[m] for t in task_minutes for m in method_factor}
    held_out = [("rte", "prompt"), ("rte", "lora"), ("copa", "lora")]
    minutes = run_minutes_model({cell: v for cell, v in truth.items() if cell not in held_out})
    for cell in truth:
        assert minutes(*cell) == pytest.approx(truth[cell], rel=1e-6)
    assert minutes("wic", "capt") is None
    # A method never run is priced at the average method: the geometric mean of the method factors.
    assert minutes("cb", "vfpt") == pytest.approx(12.0 * (1.0 * 1.5 * 2.5) ** (1 / 3), rel=1e-6)


def test_sweep_table_gives_parameters_and_the_average_of_methods_with_every_task():
    from capt.recipes.experiments import sweep_table

    def cell(task, method, score, seconds):
        grid = [{"lr": 0.01, "validation_score": 0.5}]
        return {
            "task": task,
            "method": method,
            "score": {"mean": score, "std": 0.1},
            "seeds": [0, 1, 2],
            "chosen_lr": 0.01,
            "grid": grid,
            "epochs_to_best": 2.0,
            "seconds_to_best": seconds,
            "trainable_params": 17280,
            "trainable_percent": 0.0128,
        }

    cells = [cell("cb", "capt", 0.5, 100), cell("copa", "capt", 0.7, 300), cell("cb", "lora", 0.6, 400)]
    zero_shot = {"task": "cb", "method": "zero-shot", "test": {"score": 0.2}}
    top = {"top_prediction": {"label": "neutral", "share": 1.0}}
    references = [zero_shot | top, {"task": "cb", "method": "majority", "test": {"score": 0.36}}]
    table = sweep_table(cells, references, ["cb", "copa"])
    assert "| cb | capt | 17,280 (0.0128%) | 0.01 | 0.01: 50.0 | 50.0 ± 10.0 | 3 | 2.0 | 100 s | 1.00x | - |" in table
    assert "| cb | zero-shot | 0 | - | - | 20.0 | - | 0 | - | - | - |" in table
    assert table.endswith("most frequent answer and its share of the test set: cb neutral 100%.\n")
    # LoRA vs CaPT: +10 points; Welch's t = 0.1 / sqrt(0.1² / 3 + 0.1² / 3) with 4 degrees of freedom, whose
    # two-sided p has a closed form: 1 - 2 (F(t) - 1/2), F(t) - 1/2 = 3/8 x (1 - t² / (12 (1 + t² / 4))).
    t = 0.1 / math.sqrt(0.1**2 / 3 + 0.1**2 / 3)
    x = t / math.sqrt(1 + t**2 / 4)
    p = 1 - 2 * (3 / 8) * x * (1 - t**2 / (12 * (1 + t**2 / 4)))
    lora = "| cb | lora | 17,280 (0.0128%) | 0.01 | 0.01: 50.0 | 60.0 ± 10.0 | 3 | 2.0 | 400 s | 4.00x "
    lora += f"| +10.0 (p {p:.2f}) |"
    assert lora in table and f"{p:.2f}" == "0.29"
    assert "| cb | majority | 0 | - | - | 36.0 | - | 0 | - | - | - |" in table
    assert (
        "| average | capt | - | - | - | 60.0 | - | - | 200 s | 1.00x | - |" in table
    )  # (50 + 70) / 2, (100 + 300) / 2
    assert "| average | lora |" not in table  # no COPA cell: no average
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert all(line.count("|") == 12 for line in rows)  # every row has the header's 11 columns
    # A third task still running (only its reference rows exist): averaging over every task would drop CaPT's row;
    # averaged over the finished tasks it stays as it was, and the line under the table says what is left out.
    started = sweep_table(cells, references, ["cb", "copa", "multirc"])
    assert "| average |" not in started
    finished = sweep_table(cells, references, ["cb", "copa", "multirc"], average_tasks=["cb", "copa"])
    assert "| average | capt | - | - | - | 60.0 | - | - | 200 s | 1.00x | - |" in finished
    assert "\nThe averages are over cb, copa; multirc not finished.\n" in finished
    assert "The averages are over" not in table  # nothing left out: no line


def test_versus_capt_gives_no_p_without_seed_noise():
    from capt.recipes.experiments import versus_capt

    capt = {"score": {"mean": 0.5, "std": 0.1}, "seeds": [0, 1, 2]}
    assert versus_capt({"score": {"mean": 0.62, "std": 0.0}, "seeds": [0]}, capt) == "+12.0"  # one seed
    steady = {"score": {"mean": 0.5, "std": 0.0}, "seeds": [0, 1, 2]}
    assert versus_capt(steady | {"score": {"mean": 0.45, "std": 0.0}}, steady) == "-5.0"  # neither varies
    assert versus_capt({"score": {"mean": 0.9, "std": 0.001}, "seeds": [0, 1, 2]}, steady) == "+40.0 (p < 0.001)"


def test_reference_rows_score_the_majority_label_and_count_the_zero_shot_answers(tmp_path):
    from capt.recipes.experiments import reference_results
    from capt.recipes.run import RunConfig

    config = RunConfig(task="cb", model="tiny-llama", data_dir=str(DATA), cache_dir=str(tmp_path), limit_eval=20)
    zero_shot, majority = reference_results(config)
    splits = paper_splits("cb", DATA)
    label = Counter(ex.label for ex in splits["train"]).most_common(1)[0][0]
    test = splits["test"][:20]
    assert majority["test"]["accuracy"] == sum(ex.label == label for ex in test) / len(test)

    # the untrained model's answers, one example at a time: no batching, padding or length order
    backbone = load_backbone("tiny-llama")
    fmt = make_format(backbone.family, "cb", backbone.tokenizer, config.max_length)
    with torch.no_grad():
        answers = [fmt.predict(backbone.model.eval(), fmt.collate([fmt.encode(ex)]))[0] for ex in test]
    top, count = Counter(answers).most_common(1)[0]
    assert zero_shot["top_prediction"] == {
        "label": ("entailment", "contradiction", "neutral")[top],
        "share": count / 20,
    }
    assert zero_shot["test"]["accuracy"] == pytest.approx(
        sum(a == ex.label for a, ex in zip(answers, test, strict=True)) / 20
    )


def test_zero_shot_answers_that_match_no_label_are_counted_as_none(tmp_path):
    from capt.recipes.experiments import reference_results
    from capt.recipes.run import RunConfig

    # an untrained T5 generates text that is neither label: every prediction is -1, which must not read as a label
    config = RunConfig(task="rte", model="tiny-t5", data_dir=str(DATA), cache_dir=str(tmp_path), limit_eval=8)
    zero_shot = reference_results(dataclasses.replace(config, t5_generate=True))[0]
    assert zero_shot["top_prediction"] == {"label": "(none of the labels)", "share": 1.0}
    assert zero_shot["test"]["accuracy"] == 0.0


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("method", ["capt", "deep-prompt", "ptv2", "lora", "head"])  # not prompt: PEFT drops positions
def test_decoder_classifier_reads_the_last_real_token_whatever_the_padding(method, padding_side):
    backbone = load_backbone("tiny-llama", num_labels=3, decoder_head="classifier")
    assert type(backbone.model).__name__ == "LlamaForSequenceClassification"
    fmt = make_format(backbone.family, "cb", backbone.tokenizer, 96, decoder_head="classifier")
    fmt = dataclasses.replace(fmt, padding_side=padding_side)
    model = apply_method(backbone, method).eval()
    _trained_looking(model)
    features = [fmt.encode(ex) for ex in paper_splits("cb", DATA)["train"][:4]]
    assert len({f["length"] for f in features}) > 1  # the batch is padded
    assert backbone.tokenizer.pad_token_id == 0  # the slot's placeholder id too: the head must never see the slot
    with torch.no_grad():
        batched = model(**fmt.collate(features)["model_inputs"]).logits
        alone = torch.cat([model(**fmt.collate([f])["model_inputs"]).logits for f in features])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)


def test_prefix_tuning_of_a_decoder_classifier_equals_pefts_causal_lm_prefix_through_the_score_head():
    """PEFT's own sequence-classification path refuses these decoders (their forward names the cache `cache`); the
    classifier must read the same last hidden state as PEFT's causal-LM prefix tuning of the same trunk and prefix."""
    import peft

    classifier = load_backbone("tiny-llama", num_labels=3, decoder_head="classifier")
    fmt = make_format(classifier.family, "cb", classifier.tokenizer, 96, decoder_head="classifier")
    model = apply_method(classifier, "ptv2").eval()
    _trained_looking(model)
    language_model = load_backbone("tiny-llama").model
    language_model.model.load_state_dict(classifier.model.model.state_dict())
    prefix = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=20)
    reference = peft.get_peft_model(language_model, prefix)
    reference.prompt_encoder.load_state_dict(model.prompt_encoder.state_dict())
    inputs = fmt.collate([fmt.encode(ex) for ex in paper_splits("cb", DATA)["train"][:4]])["model_inputs"]
    with torch.no_grad():
        logits = model(**inputs).logits
        last_hidden = reference.eval()(**inputs, output_hidden_states=True).hidden_states[-1][:, -1]
        unprefixed = classifier.model.model(**inputs).last_hidden_state[:, -1]  # the prefix must matter
    score = model.base_model.score.modules_to_save.default
    torch.testing.assert_close(logits, score(last_hidden), atol=1e-5, rtol=0)
    assert not torch.allclose(logits, score(unprefixed), atol=1e-3)


def test_prefix_tuning_of_an_encoder_is_refused_since_its_attention_never_reads_the_prefix():
    with pytest.raises(ValueError, match="'ptv2'.*never reads"):
        apply_method(load_backbone("minilm", num_labels=3), "ptv2")


def test_decoder_classifier_trains_end_to_end_and_copa_is_multiple_choice(tmp_path, monkeypatch):
    from capt.recipes.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    backbone = load_backbone("tiny-llama", num_labels=1, decoder_head="classifier")
    fmt = make_format(backbone.family, "copa", backbone.tokenizer, 64, decoder_head="classifier")
    batch = fmt.collate([fmt.encode(ex) for ex in paper_splits("copa", DATA)["train"][:3]])
    assert batch["options"] == [2, 2, 2] and batch["model_inputs"]["input_ids"].shape[0] == 6
    out = tmp_path / "run"
    flags = ["--model", "tiny-llama", "--decoder-head", "classifier", "--limit-train", "8", "--limit-eval", "8"]
    assert (
        main(["train", "--task", "cb", "--epochs", "1", *flags, "--data-dir", str(DATA), "--output-dir", str(out)]) == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["trainable_params"] == 2 * 64 + 64 * 3  # capsules + the score head (no bias)
