"""Time to accuracy (the paper's Table 2, on this machine) from the logs of a `capt compare` folder.

For every task/method/seed run under COMPARE_DIR it reads metrics.jsonl and finds the epoch with the best
validation score (the one early stopping keeps) and the wall time elapsed when it ended; the table gives the
mean over seeds and each method's time relative to CaPT's.

    python -m capt.recipes.bench.time_to_accuracy results/minilm-cb-full --out benchmarks/results/time_to_accuracy
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ..reporting import read_log


def best_epoch_and_time(run_dir: Path) -> tuple[int, float]:
    """(epoch of the best validation score, seconds elapsed at its end); ties keep the first, as training does."""
    epochs = [r for r in read_log(run_dir) if r["kind"] == "epoch"]
    best = max(epochs, key=lambda r: (r["validation_score"], -r["epoch"]))
    return best["epoch"], best["elapsed_s"]


def collect(compare_dir: Path) -> list[dict]:
    rows = []
    for task_dir in sorted(p for p in compare_dir.iterdir() if p.is_dir()):
        for method_dir in sorted(p for p in task_dir.iterdir() if p.is_dir()):
            runs = sorted(method_dir.glob("seed-*")) or [method_dir]
            measured = [best_epoch_and_time(run) for run in runs if (run / "metrics.jsonl").is_file()]
            if not measured:
                continue
            rows.append(
                {
                    "task": task_dir.name,
                    "method": method_dir.name,
                    "seeds": len(measured),
                    "epochs_to_best": statistics.fmean(e for e, _ in measured),
                    "seconds_to_best": statistics.fmean(t for _, t in measured),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| task | method | seeds | epochs to best | time to best | relative to capt |",
        "|---|---|---|---|---|---|",
    ]
    capt = {r["task"]: r["seconds_to_best"] for r in rows if r["method"] == "capt"}
    for r in rows:
        relative = f"{r['seconds_to_best'] / capt[r['task']]:.2f}x" if r["task"] in capt else "n/a"
        lines.append(
            f"| {r['task']} | {r['method']} | {r['seeds']} | {r['epochs_to_best']:.1f} | "
            f"{r['seconds_to_best']:.0f} s | {relative} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix: writes .md and .json")
    args = parser.parse_args()
    rows = collect(args.compare_dir)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# Time to accuracy\n\nFrom the logs of `{args.compare_dir}` "
        f"(`python -m capt.recipes.bench.time_to_accuracy {args.compare_dir} --out {args.out}`).\n\n" + table(rows)
    )
    print(table(rows))


if __name__ == "__main__":
    main()
