"""capt.recipes.bench.time_to_accuracy reads the best epoch and its elapsed time from compare logs."""

import json
from pathlib import Path

from capt.recipes.bench import time_to_accuracy as tta


def _run(directory: Path, scores: list[float], seconds_per_epoch: float) -> None:
    directory.mkdir(parents=True)
    records = [{"kind": "step", "epoch": 1, "step": 1, "loss": 1.0}]
    records += [
        {
            "kind": "epoch",
            "epoch": e + 1,
            "step": e + 1,
            "elapsed_s": seconds_per_epoch * (e + 1),
            "validation_score": s,
        }
        for e, s in enumerate(scores)
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_best_epoch_mean_over_seeds_and_ratio_to_capt(tmp_path):
    _run(tmp_path / "cb" / "capt" / "seed-0", [0.5, 0.7, 0.7, 0.6], 10.0)  # tie: the first best epoch counts
    _run(tmp_path / "cb" / "capt" / "seed-1", [0.8, 0.6], 10.0)
    _run(tmp_path / "cb" / "prompt", [0.4, 0.5, 0.6], 20.0)
    rows = {r["method"]: r for r in tta.collect(tmp_path)}
    assert (rows["capt"]["epochs_to_best"], rows["capt"]["seconds_to_best"]) == (1.5, 15.0)
    assert (rows["prompt"]["epochs_to_best"], rows["prompt"]["seconds_to_best"]) == (3.0, 60.0)
    assert "| cb | prompt | 1 | 3.0 | 60 s | 4.00x |" in tta.table(list(rows.values()))
