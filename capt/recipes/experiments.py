"""Runs of several trainings: the seeds of one setting, and a methods x tasks comparison.

Both resume: a finished run (its results.json) is read back instead of trained again.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..saving import atomic_write_text
from .reporting import aggregate_seeds, comparison_table
from .run import CHECKPOINT_NAME, RESULTS_NAME, RunConfig, read_results, run_lock
from .train import pause_point, train

COMPARISON_NAME = "comparison"


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
        if resume and not (out / CHECKPOINT_NAME).exists():
            return read_results(out / RESULTS_NAME)
        if not (overwrite or resume):
            raise FileExistsError(f"{out} already holds {RESULTS_NAME}; pass --overwrite to replace it")

    if resume and not any(out.rglob(CHECKPOINT_NAME)):
        raise FileNotFoundError(
            f"cannot resume: no {CHECKPOINT_NAME} under {out} (killed before the first checkpoint?); "
            "start it again with --overwrite"
        )

    def run(seed_config: RunConfig) -> dict[str, Any]:
        seed_out = Path(seed_config.output_dir)
        if resume and seeds > 1 and (seed_out / RESULTS_NAME).exists() and not (seed_out / CHECKPOINT_NAME).exists():
            return json.loads((seed_out / RESULTS_NAME).read_text())  # a seed's own results
        return train(seed_config, resume=resume and (seed_out / CHECKPOINT_NAME).exists())

    if seeds == 1:
        runs = [run(config)]
    else:
        runs = [
            run(dataclasses.replace(config, seed=config.seed + k, output_dir=str(out / f"seed-{config.seed + k}")))
            for k in range(seeds)
        ]
    summary = aggregate_seeds(runs)
    pause_point("summary")
    atomic_write_text(out / RESULTS_NAME, json.dumps(summary, indent=2) + "\n")
    return summary


def compare(configs: list[RunConfig], seeds: int, overwrite: bool) -> str:
    """Train every config (each into <output_dir>/<task>/<method>) and write comparison.{md,json} beside them.

    Returns the Markdown table. A cell whose results.json exists is read back unless `overwrite`.
    """
    root = Path(configs[0].output_dir)
    results = []
    for config in configs:
        config = dataclasses.replace(config, output_dir=str(root / config.task / config.method))
        done = Path(config.output_dir) / RESULTS_NAME
        if done.exists() and not overwrite and not (done.parent / CHECKPOINT_NAME).exists():
            results.append(read_results(done))  # a comparison resumes where it stopped
            continue
        results.append(train_seeds(config, seeds, overwrite=True))
    table = comparison_table(results)
    atomic_write_text(root / f"{COMPARISON_NAME}.md", table)
    summaries = [{k: v for k, v in r.items() if k != "runs"} for r in results]
    atomic_write_text(root / f"{COMPARISON_NAME}.json", json.dumps(summaries, indent=2) + "\n")
    return table
