"""One method's test-score gap to every other finished cell of a sweep, per task, with Welch p (issue 39).

`sweep.md` compares each method with CaPT only. A variant of CaPT (`capt-rms`) needs its gap to plain CaPT *and*
to each peer: this reads the finished cells (`<study>/<task>/<method>/results.json`) and prints, per task, the
method's mean test score minus each other method's, in points, with the two-sided p of Welch's t-test over their
seeds (`experiments.versus_capt`, the same numbers as sweep.md's last column). With every task finished, the
average over the tasks too.

    python -m capt.recipes.analysis.method_gaps --study results/smollm2-study --method capt-rms --tasks cb,copa,rte,wic
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..experiments import versus_capt
from ..metrics import superglue_average

RESULTS = "results.json"


def finished_cells(study: Path, task: str) -> dict[str, dict[str, Any]]:
    """method -> its finished cell (a results.json with its chosen rate and seeds) on `task`."""
    cells = {}
    for path in sorted((study / task).glob(f"*/{RESULTS}")):
        cell = json.loads(path.read_text())
        if "chosen_lr" in cell:
            cells[path.parent.name] = cell
    return cells


def gaps_table(study: Path, method: str, tasks: Sequence[str]) -> str:
    """Markdown: per task, `method`'s score and its gap to each other finished cell (with Welch p)."""
    lines = [
        f"| task | {method}: test (chosen lr) | other method | its test | {method} minus it (Welch p) |",
        "|---|---|---|---|---|",
    ]
    missing = []
    for task in tasks:
        cells = finished_cells(study, task)
        mine = cells.pop(method, None)
        if mine is None:
            missing.append(task)
            continue
        own = f"{100 * mine['score']['mean']:.1f} ± {100 * mine['score']['std']:.1f} ({mine['chosen_lr']:g})"
        for other, cell in cells.items():
            score = f"{100 * cell['score']['mean']:.1f} ± {100 * cell['score']['std']:.1f}"
            lines.append(f"| {task} | {own} | {other} | {score} | {versus_capt(mine, cell)} |")
    if not missing:
        lines += ["", _averages(study, method, tasks)]
    else:
        lines += ["", f"Not finished for {method}: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def _averages(study: Path, method: str, tasks: Sequence[str]) -> str:
    """The mean test score over `tasks` of each method finished on all of them (sweep.md's `average` rows)."""
    by_method: dict[str, dict[str, float]] = {}
    for task in tasks:
        for name, cell in finished_cells(study, task).items():
            by_method.setdefault(name, {})[task] = cell["score"]["mean"]
    complete = {name: 100 * superglue_average(s) for name, s in by_method.items() if len(s) == len(tasks)}
    others = ", ".join(f"{name} {score:.1f}" for name, score in complete.items() if name != method)
    return f"Average over {', '.join(tasks)}: {method} {complete[method]:.1f}; {others}."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--tasks", default="cb,copa,rte,wic")
    args = parser.parse_args(argv)
    print(gaps_table(args.study, args.method, args.tasks.split(",")), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
