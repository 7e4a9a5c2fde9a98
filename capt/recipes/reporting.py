"""Run logs (JSONL + CSV), learning-curve plots and comparison tables."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from .. import __version__
from ..saving import atomic_write, atomic_write_text
from .metrics import superglue_average
from .settings import CAPT_METHODS

LOG_JSONL = "metrics.jsonl"
LOG_CSV = "metrics.csv"
CURVES_PNG = "learning_curves.png"


def environment() -> dict[str, Any]:
    """The machine and software a result was measured on, recorded beside it (a training run's results.json, a
    benchmark's report). `cpu_capability` is torch's kernel level (AVX2, AVX512, ...): float32 runs agree across
    levels only to rounding (results/smollm2-study/reproduction.md), and bf16 is 18x slower without AVX512-BF16.

    Example:
        >>> sorted(environment())[:4]
        ['cpu', 'cpu_capability', 'cpu_count', 'git']
    """
    return {
        "cpu": _cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "capt": __version__,
        },
        "git": _git_revision(),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _git_revision() -> str | None:
    """The checkout's commit (with -dirty for uncommitted changes), or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class MetricsLog:
    """Appends one record per step/epoch to metrics.jsonl and metrics.csv (step and epoch rows share one CSV,
    with blank cells where a column does not apply).

    `keep_until_step` (resuming) keeps the records of an earlier attempt up to that step and drops the rest,
    which the resumed run is about to redo.
    """

    COLUMNS = (
        "kind",
        "epoch",
        "step",
        "loss",
        "lr",
        "elapsed_s",
        "validation_score",
        "validation_accuracy",
        "validation_f1",
        "validation_f1a",
        "validation_em",
    )

    def __init__(self, directory: Path, keep_until_step: int | None = None):
        kept = []
        if keep_until_step is not None and (directory / LOG_JSONL).is_file():
            kept = [r for r in read_log(directory) if r["step"] <= keep_until_step]
        # The kept records are rewritten atomically, then appended to: a full disk cannot lose them.
        rows = io.StringIO()
        table = csv.DictWriter(rows, fieldnames=self.COLUMNS, extrasaction="ignore")
        table.writeheader()
        table.writerows(kept)
        atomic_write_text(directory / LOG_CSV, rows.getvalue())
        atomic_write_text(directory / LOG_JSONL, "".join(_json_line(r) for r in kept))
        self._jsonl = (directory / LOG_JSONL).open("a")
        self._csv_file = (directory / LOG_CSV).open("a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self.COLUMNS, extrasaction="ignore")

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(_json_line(record))
        self._csv.writerow(record)
        self._jsonl.flush()
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


def _json_line(record: dict[str, Any]) -> str:
    # NaN/inf are not JSON: they are logged as null
    record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(record, allow_nan=False) + "\n"


def read_log(directory: Path) -> list[dict[str, Any]]:
    with (directory / LOG_JSONL).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def pyplot():
    """`matplotlib.pyplot` on the file-only Agg backend: every figure of the recipes works without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curves(directory: Path) -> Path:
    """Training loss per step and validation score per epoch, side by side."""
    plt = pyplot()
    records = read_log(directory)
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot([r["step"] for r in steps], [r["loss"] for r in steps], linewidth=0.8)
    left.set(xlabel="step", ylabel="training loss", title="loss")
    right.plot([r["epoch"] for r in epochs], [r["validation_score"] for r in epochs], marker="o")
    right.set(xlabel="epoch", ylabel="validation score", title="validation")
    figure.tight_layout()
    path = directory / CURVES_PNG
    try:  # atomically: a full disk leaves the previous picture (or none), never a torn one; the error names it
        atomic_write(path, lambda tmp: figure.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(figure)
    return path


def aggregate_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and standard deviation over seeds of every test metric, plus the per-seed results."""
    metrics = runs[0]["test"].keys()
    summary = {
        name: {
            "mean": statistics.fmean(r["test"][name] for r in runs),
            "std": statistics.stdev([r["test"][name] for r in runs]) if len(runs) > 1 else 0.0,
        }
        for name in metrics
    }
    first = runs[0]
    return {
        "task": first["task"],
        "method": first["method"],
        "variant": first["variant"],
        "model": first["model"],
        "seeds": [r["seed"] for r in runs],
        "test": summary,
        "score": summary["score"],
        "trainable_params": first["trainable_params"],
        "total_params": first["total_params"],
        "trainable_percent": first["trainable_percent"],
        "epochs_run": [r["epochs_run"] for r in runs],
        "best_epoch": [r["best_epoch"] for r in runs],
        "wall_time_s": round(sum(r["wall_time_s"] for r in runs), 1),
        **({"scored_split": first["scored_split"]} if "scored_split" in first else {}),
        "runs": runs,
    }


def comparison_table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per method, one column per task (score mean ± std, in %), the average, params, time."""
    tasks = sorted({r["task"] for r in results})
    methods = list(dict.fromkeys(method_label(r) for r in results))
    cell = {(method_label(r), r["task"]): r for r in results}
    header = ["method", *tasks, "average", "trainable params (%)", "wall time"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        row, scores, params, seconds = [method], {}, "", 0.0
        for task in tasks:
            r = cell.get((method, task))
            if r is None:
                row.append("n/a")
                continue
            mean, std = r["score"]["mean"], r["score"]["std"]
            scores[task] = mean
            row.append(f"{100 * mean:.1f} ± {100 * std:.1f}")
            params = f"{r['trainable_params']:,} ({r['trainable_percent']:.4f}%)"
            seconds += r["wall_time_s"]
        row.append(f"{100 * superglue_average(scores):.1f}" if len(scores) == len(tasks) else "n/a")
        row += [params, f"{seconds / 60:.1f} min"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def method_label(result: dict[str, Any]) -> str:
    """'capt' (or 'capt-rms') for the default variant, 'capt-<variant>' (or 'capt-rms-<variant>') otherwise, else
    the method name."""
    if result["method"] in CAPT_METHODS and result["variant"] != "add":
        return f"{result['method']}-{result['variant']}"
    return result["method"]
