"""Runs of several trainings: the seeds of one setting, a methods x tasks comparison, and a tuned sweep.

All resume: a finished run (its results.json) is read back instead of trained again, once its stored settings
(run_config.json) are those asked for; a finished run with other settings is refused, never silently reused. A run
that was killed continues from its last checkpoint when that was written under the same settings (on CPU the result
equals an uninterrupted run's); otherwise it starts over.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..saving import atomic_write_text
from .bench.time_to_accuracy import best_epoch_and_time
from .methods import method_revision
from .metrics import superglue_average
from .reporting import aggregate_seeds, comparison_table
from .run import (
    CHECKPOINT_NAME,
    DEFAULT_LR,
    LOCK_NAME,
    RESULTS_NAME,
    RUN_CONFIG_NAME,
    RunConfig,
    describe_differences,
    read_json,
    read_results,
    read_run_config,
    reading_back,
    run_lock,
    setting_differences,
)
from .train import interrupted_settings, pause_point, train

COMPARISON_NAME = "comparison"
SWEEP_NAME = "sweep"


def train_seeds(config: RunConfig, seeds: int, overwrite: bool, resume: bool = False) -> dict[str, Any]:
    """Train `seeds` seeds (one writes into output_dir, several into output_dir/seed-<n>); output_dir/results.json
    gets the summary over seeds (mean and std of every test metric, the per-seed results under "runs").

    `resume` continues an interrupted run: finished seeds are read back, a seed with a checkpoint continues
    from it, the others start fresh.
    """
    out = Path(config.output_dir)
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    with run_lock(out):
        return _train_seeds_locked(config, seeds, overwrite, resume)


def _train_seeds_locked(config: RunConfig, seeds: int, overwrite: bool, resume: bool) -> dict[str, Any]:
    out = Path(config.output_dir)
    for stale in out.rglob(".*.tmp"):  # left by a writer killed mid-write; we hold the lock, so none is live
        stale.unlink()
    if (out / RESULTS_NAME).exists():
        finished = finished_run(config, seeds) if resume else None
        if finished is not None:
            return finished
        if not (overwrite or resume) and any(out.rglob(CHECKPOINT_NAME)):
            raise FileExistsError(
                f"{out} holds a finished run and an interrupted re-run beside it: pass --resume to complete the "
                "re-run or --overwrite to start it again"
            )
        if not (overwrite or resume):
            raise FileExistsError(f"{out} already holds {RESULTS_NAME}; pass --overwrite to replace it")

    if resume and seeds > 1:
        _adopt_one_seed_run(config, seeds)
    # Several seeds resume from any finished seed too (a kill between two seeds leaves no checkpoint).
    progress = [*out.rglob(CHECKPOINT_NAME), *(out.glob(f"seed-*/{RESULTS_NAME}") if seeds > 1 else [])]
    if resume and not progress:
        raise FileNotFoundError(
            f"cannot resume: no {CHECKPOINT_NAME} under {out} (killed before the first checkpoint?); "
            "start it again with --overwrite"
        )

    def run(seed_config: RunConfig) -> dict[str, Any]:
        finished = finished_run(seed_config, 1) if resume and seeds > 1 else None
        if finished is not None:
            return finished["runs"][0]  # the seed's own results
        return train(seed_config, resume=resume and (Path(seed_config.output_dir) / CHECKPOINT_NAME).exists())

    runs = [run(seed_config) for seed_config in seed_configs(config, seeds)]
    summary = aggregate_seeds(runs)
    pause_point("summary")
    atomic_write_text(out / RESULTS_NAME, json.dumps(summary, indent=2) + "\n")
    return summary


def _adopt_one_seed_run(config: RunConfig, seeds: int) -> None:
    """A one-seed run killed in output_dir is the first seed of a several-seed run of the same settings: `--resume
    --seeds N` moves its files into that seed's folder, so that it continues from its checkpoint instead of being
    trained again, and no stale checkpoint is left where `compare` and `sweep` would read an unfinished run."""
    out = Path(config.output_dir)
    interrupted = interrupted_settings(out)
    if interrupted is None:
        return
    first = seed_configs(config, seeds)[0]
    settings, revision = interrupted
    differing = setting_differences(dataclasses.replace(first, output_dir=str(out)), settings)
    if differing or revision != method_revision(config.method):
        raise ValueError(
            f"{out / CHECKPOINT_NAME} is a one-seed run with other settings "
            f"({describe_differences(differing) or 'another method revision'}); resume it with them, or --overwrite"
        )
    target = Path(first.output_dir)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{out} holds a one-seed run and {target} another run of seed {first.seed}; --overwrite")
    target.mkdir(parents=True, exist_ok=True)
    for item in out.iterdir():
        if item.is_file() and item.name != LOCK_NAME:
            item.rename(target / item.name)  # same folder tree: atomic, nothing copied


def compare(configs: list[RunConfig], seeds: int, overwrite: bool) -> str:
    """Train every config (each into <output_dir>/<task>/<method>) and write comparison.{md,json} beside them.

    Returns the Markdown table. A finished cell is read back unless `overwrite` (refused if its settings differ).
    """
    root = Path(configs[0].output_dir)
    results = [
        _finished_or_trained(dataclasses.replace(c, output_dir=str(root / c.task / c.method)), seeds, overwrite)
        for c in configs
    ]
    table = comparison_table(results)
    atomic_write_text(root / f"{COMPARISON_NAME}.md", table)
    summaries = [{k: v for k, v in r.items() if k != "runs"} for r in results]
    atomic_write_text(root / f"{COMPARISON_NAME}.json", json.dumps(summaries, indent=2) + "\n")
    return table


def seed_configs(config: RunConfig, seeds: int) -> list[RunConfig]:
    """The run of each seed: `config` itself for one seed; for several, seed + k in output_dir/seed-<seed + k>."""
    if seeds == 1:
        return [config]
    out = Path(config.output_dir)
    return [
        dataclasses.replace(config, seed=config.seed + k, output_dir=str(out / f"seed-{config.seed + k}"))
        for k in range(seeds)
    ]


def finished_run(config: RunConfig, seeds: int, retrain: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The summary in config.output_dir when it holds a finished run of `config` over `seeds` seeds, else None.

    None also when the stored settings (run_config.json of the run or of each seed folder) differ only in fields
    of `retrain`: the caller trains it again. Any other difference in a setting that changes results is refused
    with a ValueError naming it. Settings missing from a stored file (fields added since) take their defaults.
    """
    out = Path(config.output_dir)
    if not (out / RESULTS_NAME).exists() or any(out.rglob(CHECKPOINT_NAME)):
        return None  # not finished (a checkpoint: interrupted, perhaps while overwriting)
    advice = "pass --overwrite to replace it or choose another --output-dir"
    results = read_results(out / RESULTS_NAME)
    stored_seeds = len(results["runs"])
    differing = {"seeds": (stored_seeds, seeds)} if stored_seeds != seeds else {}
    revisions = {run.get("method_revision", 1) for run in results["runs"]}  # runs before revisions were recorded: 1
    if revisions != {method_revision(config.method)}:  # the method's definition changed since: another method
        differing["method_revision"] = (min(revisions), method_revision(config.method))
    if not differing:  # the same seeds: compare the settings of each seed's run
        try:
            for seed_config in seed_configs(config, seeds):
                differing.update(setting_differences(seed_config, read_run_config(seed_config.output_dir)))
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot check the settings of the finished run in {out} ({err}); {advice}") from err
    if set(differing) - retrain:
        raise ValueError(f"{out} holds a finished run with other settings: {describe_differences(differing)}; {advice}")
    return None if differing else results


def _finished_or_trained(
    config: RunConfig, seeds: int, overwrite: bool, retrain: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The results of config's folder: read back when finished with these settings (so an experiment resumes),
    continued when a run of these settings was killed there, trained otherwise (see `finished_run` for `retrain`
    and for the settings that are refused)."""
    finished = None if overwrite else finished_run(config, seeds, retrain)
    if finished is not None:
        return finished
    return train_seeds(config, seeds, overwrite=True, resume=not overwrite and _interrupted_run_of(config, seeds))


def _interrupted_run_of(config: RunConfig, seeds: int) -> bool:
    """Whether config's folder holds a killed run of exactly these settings: some progress (a seed's checkpoint, or
    with several seeds a finished seed), all of it made with them, so continuing gives what starting over would."""
    progress = 0
    for seed_config in seed_configs(config, seeds):
        folder = Path(seed_config.output_dir)
        interrupted = interrupted_settings(folder)
        if interrupted is not None:
            settings, revision = interrupted
            if setting_differences(seed_config, settings) or revision != method_revision(config.method):
                return False
            progress += 1
        elif seeds > 1 and (folder / RESULTS_NAME).exists():
            try:
                if finished_run(seed_config, 1) is None:
                    return False
            except ValueError:  # made with other settings: the whole run starts over
                return False
            progress += 1
    return progress > 0


def default_lr_grid(method: str) -> list[float]:
    """Three learning rates around the method's default: DEFAULT_LR / 3, DEFAULT_LR, 3 x DEFAULT_LR.

    Example:
        >>> default_lr_grid("capt")
        [0.0033333333333333335, 0.01, 0.03]
    """
    return [DEFAULT_LR[method] / 3, DEFAULT_LR[method], DEFAULT_LR[method] * 3]


def parse_lr_grid(text: str) -> dict[str, list[float]]:
    """`capt=3e-3,1e-2;lora=1e-4,5e-4` -> {"capt": [0.003, 0.01], "lora": [0.0001, 0.0005]} (the --lr-grid flag).

    Example:
        >>> parse_lr_grid("capt=3e-3,1e-2;lora=1e-4")
        {'capt': [0.003, 0.01], 'lora': [0.0001]}
    """
    grid = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        method, _, rates = item.partition("=")
        if not rates.strip():
            raise ValueError(f"--lr-grid: {item!r} gives no learning rates")
        try:
            grid[method.strip()] = [float(r) for r in rates.split(",")]
        except ValueError:
            raise ValueError(f"--lr-grid: {item!r} is not METHOD=LR,LR,... (e.g. capt=3e-3,1e-2,3e-2)") from None
        bad = [r for r in grid[method.strip()] if not math.isfinite(r) or r < 0]
        if bad:
            raise ValueError(f"--lr-grid: {item!r} has learning rate(s) {bad}; each must be a finite number >= 0")
    return grid


def sweep(
    configs: list[RunConfig],
    lr_grid: dict[str, list[float]],
    seeds: int,
    overwrite: bool,
    references: bool = True,
    finished_only: bool = False,
    extend: int = 0,
) -> str:
    """Tune the learning rate of every method x task on VALIDATION, then train the chosen rate over `seeds` seeds.

    Each cell <output_dir>/<task>/<method> holds grid/lr-<rate>/ (one run per rate, seed 0), seed-<k>/ for the other
    seeds of the chosen rate (its seed 0 is the grid run itself: runs are deterministic), and a results.json with
    the summary over seeds plus "chosen_lr" and "grid" (each rate's validation and test scores, epochs and seconds
    to the best validation score). Ties go to the first rate of the grid. `references` adds the zero-shot backbone
    and the majority class per task. Writes sweep.{md,json} beside the cells and returns the Markdown table; it
    resumes, as `compare` does, from every finished grid point and seed (a cell's summary is rebuilt from them, so
    an extended grid is tuned again); a seed folder trained at a rate that is no longer the chosen one is retrained.
    `finished_only` trains nothing: the table holds the cells whose results.json exists, as written, and names the
    others below it. `extend` > 0: while the best rate is at an end of the grid (alone), one more rate beyond that
    end is trained, at the grid's outer ratio, up to `extend` times per cell (`next_rate_beyond_edge`).

    Example:
        >>> table = sweep([RunConfig(task="cb", model="tiny-llama", epochs=1)], {}, seeds=3)  # doctest: +SKIP
    """
    root = Path(configs[0].output_dir)
    grids = [lr_grid.get(c.method) or default_lr_grid(c.method) for c in configs]
    done = [root / c.task / c.method / RESULTS_NAME for c in configs]
    if finished_only:
        cells = [_read_cell(path) for path in done if path.exists()]
    else:
        cells = [_sweep_cell(c, root, grid, seeds, overwrite, extend) for c, grid in zip(configs, grids, strict=True)]
    tasks = list(dict.fromkeys(c.task for c in configs))
    reference_rows = [reference_results(c) for c in {c.task: c for c in configs}.values()] if references else []
    unfinished = [(c, grid) for c, grid, path in zip(configs, grids, done, strict=True) if not path.exists()]
    # A task still being run stays out of the averages, so they keep meaning the same tasks until it is finished.
    unfinished_tasks = {c.task for c, _ in unfinished}
    finished_tasks = [task for task in tasks if task not in unfinished_tasks]
    table = sweep_table(cells, [row for rows in reference_rows for row in rows], tasks, finished_tasks)
    progress = [cell_progress(root / c.task / c.method, grid, seeds, extend) for c, grid in unfinished]
    if progress:
        table += f"\nNot finished yet: {'; '.join(map(str, progress))}.\n\n{work_left(progress, root)}\n"
    atomic_write_text(root / f"{SWEEP_NAME}.md", table)
    summaries = [{k: v for k, v in r.items() if k != "runs"} for r in cells]
    output = {"cells": summaries, "references": reference_rows}
    atomic_write_text(root / f"{SWEEP_NAME}.json", json.dumps(output, indent=2) + "\n")
    return table


def _sweep_cell(
    config: RunConfig, root: Path, grid: list[float], seeds: int, overwrite: bool, extend: int = 0
) -> dict[str, Any]:
    # No shortcut through the cell's results.json: it is rebuilt from its runs, each read back only when its
    # settings match, so a changed grid or setting never returns a stale cell.
    cell = root / config.task / config.method
    points = [_grid_point(config, cell, lr, overwrite) for lr in grid]
    for _ in range(extend):
        beyond = next_rate_beyond_edge({p["lr"]: p["validation_score"] for p in points})
        if beyond is None:
            break
        points.append(_grid_point(config, cell, beyond, overwrite))  # last: a tie keeps the earlier winner
    best = max(points, key=lambda p: p["validation_score"])  # max keeps the first of equal scores
    runs, times = [best["run"]], [(best["epochs_to_best"], best["seconds_to_best"])]
    for seed in range(1, seeds):
        run_dir = cell / f"seed-{seed}"
        seed_config = dataclasses.replace(config, lr=best["lr"], seed=seed, output_dir=str(run_dir))
        # A seed folder follows the chosen lr: one trained at another (a grid extended since) is trained again.
        runs.append(_finished_or_trained(seed_config, 1, overwrite, retrain=frozenset({"lr"}))["runs"][0])
        times.append(best_epoch_and_time(run_dir))
    summary = {
        **aggregate_seeds(runs),
        "chosen_lr": best["lr"],
        "epochs_to_best": statistics.fmean(e for e, _ in times),
        "seconds_to_best": statistics.fmean(t for _, t in times),
        "grid": [{k: v for k, v in p.items() if k != "run"} for p in points],
    }
    atomic_write_text(cell / RESULTS_NAME, json.dumps(summary, indent=2) + "\n")
    return summary


def grid_point_name(lr: float) -> str:
    """The folder name of a sweep cell's grid point at `lr` (under cell/grid/): the rate to 6 significant digits.

    Example:
        >>> grid_point_name(0.01 / 3), grid_point_rate(grid_point_name(0.01 / 3))
        ('lr-0.00333333', 0.00333333)
    """
    return f"lr-{lr:g}"


def grid_point_rate(name: str) -> float:
    """The rate a grid point's folder name holds (`grid_point_name`), rounded as the name is."""
    return float(name.removeprefix("lr-"))


def _grid_point(config: RunConfig, cell: Path, lr: float, overwrite: bool) -> dict[str, Any]:
    """One grid point of a sweep cell (seed 0 at `lr`, in cell/grid/`grid_point_name(lr)`), read back or trained."""
    folder = cell / "grid" / grid_point_name(lr)
    point = dataclasses.replace(config, lr=_stored_rate(folder, lr), seed=0, output_dir=str(folder))
    result = _finished_or_trained(point, 1, overwrite)["runs"][0]  # the seed's own record
    epochs, seconds = best_epoch_and_time(folder)
    return {
        "lr": point.lr,
        "validation_score": result["best_validation_score"],
        "test_score": result["score"],
        "epochs_to_best": epochs,
        "seconds_to_best": seconds,
        "run": result,
        "dir": point.output_dir,
    }


def next_rate_beyond_edge(validation: dict[float, float]) -> float | None:
    """{rate: validation score} of a grid -> the rate one step past the end where the best score sits, at the
    grid's own outer ratio. None when the best is inside the grid, shared with another rate, or the grid has
    a single rate: then nothing says the optimum lies outside.

    Example:
        >>> round(next_rate_beyond_edge({0.01: 0.5, 0.03: 0.6, 0.09: 0.7}), 6)
        0.27
        >>> round(next_rate_beyond_edge({0.01: 0.7, 0.03: 0.6, 0.09: 0.5}), 6)
        0.003333
        >>> next_rate_beyond_edge({0.01: 0.5, 0.03: 0.7, 0.09: 0.6}) is None
        True
    """
    rates = sorted(validation)
    top = max(validation.values())
    winners = [lr for lr in rates if validation[lr] == top]
    if len(rates) < 2 or len(winners) > 1 or winners[0] not in (rates[0], rates[-1]):
        return None
    if winners[0] == rates[-1]:
        return rates[-1] * rates[-1] / rates[-2]
    return rates[0] * rates[0] / rates[1]


@dataclasses.dataclass(frozen=True)
class CellProgress:
    """How far an unfinished sweep cell got (`cell_progress`); str() is its line in sweep.md."""

    task: str
    method: str
    grid_done: int
    grid_size: int
    beyond: int  # finished runs at rates beyond the grid's ends (--extend-grid)
    seeds_done: int
    more_seeds: int  # the seeds after the grid's seed 0
    left: int  # runs still to train, grid points and seeds
    maybe: int  # extensions still possible: runs only if a best rate sits alone at an end of the grid
    minutes: tuple[float, ...]  # the wall time of each finished run

    def __str__(self) -> str:
        extensions = f" and {self.beyond} beyond it" if self.beyond else ""
        seeds = f", {self.seeds_done} of {self.more_seeds} more seeds" if self.more_seeds else ""
        maybe = f" + up to {self.maybe} beyond the grid" if self.maybe else ""
        pace = f", {statistics.fmean(self.minutes):.0f} min per run so far" if self.minutes else ""
        left = f"{self.left} run{'s' if self.left != 1 else ''} left"
        grid = f"{self.grid_done} of {self.grid_size} grid points{extensions}{seeds}"
        return f"{self.task}/{self.method}: {grid} ({left}{maybe}{pace})"


def cell_progress(cell: Path, grid: list[float], seeds: int, extend: int = 0) -> CellProgress:
    """Where an unfinished sweep cell stands, for a study that spans sessions: its finished grid points (and those
    trained beyond the grid's ends), seeds, the runs left, and the mean wall time of its finished runs (what each
    run left will take, roughly). `extend` is the sweep's `--extend-grid`: extensions not yet trained are named as
    "up to" runs, since they follow only a best rate alone at an end of the grid; once every rate tried so far has
    finished, the sweep's own rule (`next_rate_beyond_edge`) says whether one can still follow.

    A finished seed folder counts as done here; the sweep retrains it if the completed grid chooses another rate.

    Example:
        >>> str(cell_progress(Path("results/smollm2-study-bf16/cb/lora"), [1.66667e-4, 5e-4, 1.5e-3], 3))
        'cb/lora: 2 of 3 grid points, 0 of 2 more seeds (3 runs left, 30 min per run so far)'
    """
    grid_runs = [cell / "grid" / grid_point_name(lr) / RESULTS_NAME for lr in grid]
    beyond = sorted(set((cell / "grid").glob(f"*/{RESULTS_NAME}")) - set(grid_runs))
    seed_runs = [cell / f"seed-{seed}" / RESULTS_NAME for seed in range(1, seeds)]
    finished = [path for path in grid_runs + seed_runs if path.exists()] + beyond
    results = {path: read_json(path) for path in finished}
    maybe = max(extend - len(beyond), 0)
    if maybe and all(path in results for path in grid_runs):
        # Folder names hold the rate to 6 significant digits: enough to order the rates and find the best.
        validation = {}
        for path in grid_runs + beyond:
            with reading_back(path):
                validation[grid_point_rate(path.parent.name)] = results[path]["runs"][0]["best_validation_score"]
        maybe = maybe if next_rate_beyond_edge(validation) is not None else 0
    return CellProgress(
        task=cell.parent.name,
        method=cell.name,
        grid_done=sum(p.exists() for p in grid_runs),
        grid_size=len(grid_runs),
        beyond=len(beyond),
        seeds_done=sum(p.exists() for p in seed_runs),
        more_seeds=len(seed_runs),
        left=sum(not p.exists() for p in grid_runs + seed_runs),
        maybe=maybe,
        minutes=tuple(_wall_minutes(path, results[path]) for path in finished),
    )


def _wall_minutes(path: Path, results: dict[str, Any]) -> float:
    """A run's minutes (a summary's `wall_time_s`, as every results.json has); a damaged file is named."""
    with reading_back(path):
        return results["wall_time_s"] / 60


def _read_cell(path: Path) -> dict[str, Any]:
    """A sweep cell's results.json, checked by tabulating it alone: a damaged one is a ValueError naming it."""
    cell = read_json(path)
    with reading_back(path):
        sweep_table([cell], [], [cell["task"]])
    return cell


def work_left(progress: list[CellProgress], root: Path) -> str:
    """One line for sweep.md: the runs the unfinished cells still need, and about how long they would take, so
    that a study spread over sessions can size the next one. A cell with finished runs is priced at their mean;
    one without, at its task's pace times its method's (`run_minutes_model`, fitted to every finished run under
    `root`): Deep Prompt-Tuning's first RTE run is priced from how it ran on CB and COPA, not at RTE's mean over
    cheaper methods. Tasks with no finished run yet are named, not guessed.

    Example:
        >>> lora = cell_progress(Path("results/smollm2-study-bf16/cb/lora"), [1.66667e-4, 5e-4, 1.5e-3], 3)
        >>> print(work_left([lora], Path("results/smollm2-study-bf16")))  # doctest: +NORMALIZE_WHITESPACE
        Left in all: 3 runs; about 1.5 run-hours (cb 1.5): a cell's own mean run time so far, or before its first
        run its task's pace times its method's.
    """
    runs: dict[tuple[str, str], list[float]] = {}
    for path in [*root.glob(f"*/*/grid/*/{RESULTS_NAME}"), *root.glob(f"*/*/seed-*/{RESULTS_NAME}")]:
        task, method = path.relative_to(root).parts[:2]
        runs.setdefault((task, method), []).append(_wall_minutes(path, read_json(path)))
    minutes_of = run_minutes_model({cell: statistics.fmean(minutes) for cell, minutes in runs.items()})
    hours: dict[str, float] = {}
    unpaced: list[str] = []
    for cell in progress:
        minutes = statistics.fmean(cell.minutes) if cell.minutes else minutes_of(cell.task, cell.method)
        if minutes is not None:
            hours[cell.task] = hours.get(cell.task, 0.0) + minutes * cell.left / 60
        elif cell.task not in unpaced:
            unpaced.append(cell.task)
    left, maybe = sum(c.left for c in progress), sum(c.maybe for c in progress)
    line = f"Left in all: {left} run{'s' if left != 1 else ''}" + (
        f" (+ up to {maybe} beyond the grids)" if maybe else ""
    )
    if hours:
        by_task = ", ".join(f"{task} {h:.1f}" for task, h in hours.items())
        line += (
            f"; about {sum(hours.values()):.1f} run-hours ({by_task}): a cell's own mean run time so far, or before "
            "its first run its task's pace times its method's"
        )
    if unpaced:
        line += f"; no finished run yet on {', '.join(unpaced)}"
    return line + "."


def run_minutes_model(cell_minutes: dict[tuple[str, str], float]) -> Callable[[str, str], float | None]:
    """Fit log(minutes) = task term + method term to the mean run time of each (task, method) cell that has runs,
    and return a predictor for any cell: a task's length and a method's cost per step multiply. The fit is
    alternating means over the observed cells (least squares on the log scale). A method never run is priced at
    the average method; a task never run has no price (None).

    Example:
        >>> minutes = run_minutes_model({("cb", "capt"): 10.0, ("cb", "lora"): 30.0, ("copa", "capt"): 5.0})
        >>> round(minutes("copa", "lora"), 6), minutes("rte", "capt")
        (15.0, None)
    """
    logs = {cell: math.log(minutes) for cell, minutes in cell_minutes.items()}
    task_term = {task: 0.0 for task, _ in logs}
    method_term = {method: 0.0 for _, method in logs}
    for _ in range(100):  # the SmolLM2 study's 36 cells settle to 1e-9 in 21 rounds
        for task in task_term:
            task_term[task] = statistics.fmean(v - method_term[m] for (t, m), v in logs.items() if t == task)
        for method in method_term:
            method_term[method] = statistics.fmean(v - task_term[t] for (t, m), v in logs.items() if m == method)
    average_method = statistics.fmean(method_term.values()) if method_term else 0.0

    def minutes(task: str, method: str) -> float | None:
        if task not in task_term:
            return None
        return math.exp(task_term[task] + method_term.get(method, average_method))

    return minutes


def _stored_rate(folder: Path, lr: float) -> float:
    """The exact rate of the finished run in `folder` where `lr` rounds to it: folders are named at 6 significant
    digits, so a grid typed as `0.00333333` reads back the run trained at 0.01 / 3 instead of refusing it."""
    if not (folder / RUN_CONFIG_NAME).is_file():
        return lr
    stored = read_run_config(folder).lr
    return stored if grid_point_name(stored) == grid_point_name(lr) else lr


def reference_results(config: RunConfig) -> list[dict[str, Any]]:
    """The rows every method must beat on config.task's test split: the frozen backbone and the majority class.

    zero-shot: the backbone with no training, scored by the task format (for decoders: the LM's own label-word
    likelihoods; an encoder's head is untrained, so its row is chance). Its "top_prediction" names the label it
    predicts most and the share of test examples that get it: a share of 1.0 means a constant predictor.
    majority: the most frequent training label for every test example (label tasks only).
    A generate task has the zero-shot row alone, scored as its runs are (`evaluate`: loss, perplexity, answers).
    """
    from .backbones import load_backbone
    from .chat import ChatFormat
    from .evaluate import encode_cached, evaluate, load_splits, predict, score_predictions
    from .formats import NO_OPTION, head_outputs, make_format
    from .tasks import get_task

    splits = load_splits(config)
    backbone = load_backbone(config.model, num_labels=head_outputs(config.task), seed=0)
    fmt = make_format(
        backbone.family,
        config.task,
        backbone.tokenizer,
        config.max_length,
        config.t5_generate,
        prompt_bos=config.prompt_bos,
    )
    test = splits["test"]
    features = encode_cached(fmt, test, config)
    if isinstance(fmt, ChatFormat):  # answers are texts: no label to count or vote
        scores = evaluate(backbone.model, fmt, features, test, config.eval_batch_size)
        return [{"task": config.task, "method": "zero-shot", "test": scores}]
    predictions = predict(backbone.model, fmt, features, config.eval_batch_size)
    zero_shot = {"task": config.task, "method": "zero-shot", "test": score_predictions(config.task, predictions, test)}
    spec = get_task(config.task)
    if spec.options_field:  # a prediction indexes the example's own options (ReCoRD): no label to count or vote
        return [zero_shot]
    top, count = Counter(predictions).most_common(1)[0]
    name = str(spec.labels[top]) if top != NO_OPTION else "(none of the labels)"
    zero_shot["top_prediction"] = {"label": name, "share": count / len(test)}
    rows = [zero_shot]
    train_labels = [ex.label for ex in splits["train"]]
    if None not in train_labels:
        majority = Counter(train_labels).most_common(1)[0][0]
        scores = score_predictions(config.task, [majority] * len(test), test)
        rows.append({"task": config.task, "method": "majority", "test": scores})
    return rows


def sweep_table(
    cells: list[dict[str, Any]],
    references: list[dict[str, Any]],
    tasks: list[str],
    average_tasks: list[str] | None = None,
) -> str:
    """Markdown: per task and method the trainable parameters, the chosen lr, every rate's validation score, test
    mean ± std over seeds, epochs and time to the best validation score, that time relative to CaPT's (the
    paper's Table 2), and the test score's difference from CaPT's with its Welch p (`versus_capt`). With several
    `average_tasks` (default: all `tasks`; `sweep` passes the tasks whose cells are all finished), an `average` row
    per method that has every one of them: the mean of its task scores and of its times to best; a line below the
    table names the tasks the averages leave out. Below it, the zero-shot model's most frequent answer per task and
    its share of the test set (100%: the row is a constant predictor's score)."""
    lines = [
        "| task | method | trainable | chosen lr | validation by lr | test score | seeds | epochs to best "
        "| time to best | x capt | vs capt (Welch p) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    capt_cells = {c["task"]: c for c in cells if c["method"] == "capt"}
    for task in tasks:
        capt = capt_cells.get(task)
        for c in (c for c in cells if c["task"] == task):
            grid = ", ".join(f"{p['lr']:g}: {100 * p['validation_score']:.1f}" for p in c["grid"])
            relative = f"{c['seconds_to_best'] / capt['seconds_to_best']:.2f}x" if capt else "n/a"
            lines.append(
                f"| {task} | {c['method']} | {c['trainable_params']:,} ({c['trainable_percent']:.4f}%) | "
                f"{c['chosen_lr']:g} | {grid} | {100 * c['score']['mean']:.1f} ± {100 * c['score']['std']:.1f} | "
                f"{len(c['seeds'])} | {c['epochs_to_best']:.1f} | {c['seconds_to_best']:.0f} s | {relative} | "
                f"{versus_capt(c, capt) if capt and c is not capt else '-'} |"
            )
        for r in (r for r in references if r["task"] == task):
            score = f"{100 * r['test']['score']:.1f}"
            lines.append(f"| {task} | {r['method']} | 0 | - | - | {score} | - | 0 | - | - | - |")
    average_tasks = tasks if average_tasks is None else average_tasks
    if len(average_tasks) > 1:
        lines += _average_rows(cells, average_tasks)
        left_out = [task for task in tasks if task not in average_tasks]
        if left_out:
            lines += ["", f"The averages are over {', '.join(average_tasks)}; {', '.join(left_out)} not finished."]
    tops = [r for r in references if "top_prediction" in r]
    if tops:
        shares = ", ".join(
            f"{r['task']} {r['top_prediction']['label']} {100 * r['top_prediction']['share']:.0f}%" for r in tops
        )
        lines += ["", f"The zero-shot model's most frequent answer and its share of the test set: {shares}."]
    return "\n".join(lines) + "\n"


def _average_rows(cells: list[dict[str, Any]], tasks: list[str]) -> list[str]:
    """One row per method with a cell on every task: mean test score and mean time to best (vs CaPT's mean)."""
    by_method: dict[str, dict[str, dict[str, Any]]] = {}
    for c in cells:
        by_method.setdefault(c["method"], {})[c["task"]] = c
    complete = {m: [row[t] for t in tasks] for m, row in by_method.items() if set(tasks) <= set(row)}
    capt_time = statistics.fmean(c["seconds_to_best"] for c in complete["capt"]) if "capt" in complete else None
    rows = []
    for method, row in complete.items():
        score = superglue_average({c["task"]: c["score"]["mean"] for c in row})
        seconds = statistics.fmean(c["seconds_to_best"] for c in row)
        relative = f"{seconds / capt_time:.2f}x" if capt_time else "n/a"
        rows.append(
            f"| average | {method} | - | - | - | {100 * score:.1f} | - | - | {seconds:.0f} s | {relative} | - |"
        )
    return rows


def versus_capt(cell: dict[str, Any], capt: dict[str, Any]) -> str:
    """A sweep cell's mean test score minus CaPT's on the same task, in points, with the two-sided p of Welch's
    t-test over their seeds (from the means and sample standard deviations): "+8.6 (p 0.21)". With 3 seeds a side,
    a gap needs p < 0.05 to stand out of the seed noise; no p where a side has fewer than 2 seeds or neither varies.

    Example:
        >>> side = {"score": {"mean": 0.5, "std": 0.1}, "seeds": [0, 1, 2]}
        >>> versus_capt(side | {"score": {"mean": 0.8, "std": 0.1}}, side)
        '+30.0 (p 0.021)'
    """
    from scipy.stats import ttest_ind_from_stats

    mean, std, n = cell["score"]["mean"], cell["score"]["std"], len(cell["seeds"])
    capt_mean, capt_std, capt_n = capt["score"]["mean"], capt["score"]["std"], len(capt["seeds"])
    gap = f"{100 * (mean - capt_mean):+.1f}"
    if min(n, capt_n) < 2 or std == capt_std == 0:
        return gap
    p = ttest_ind_from_stats(mean, std, n, capt_mean, capt_std, capt_n, equal_var=False).pvalue
    return f"{gap} (p {'< 0.001' if p < 0.001 else f'{p:.2g}'})"
