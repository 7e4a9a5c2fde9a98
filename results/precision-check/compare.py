"""bf16 against float32 on the two COPA grid points of results/precision-check/README.md (run from the repo root)."""

import json
import statistics
from pathlib import Path

PAIRS = {  # name: (the committed bf16 run, its float32 re-run)
    "capt lr 0.03": ("results/smollm2-study/copa/capt/grid/lr-0.03", "results/precision-check/copa-capt-fp32"),
    "deep-prompt lr 0.0033": (
        "results/smollm2-study/copa/deep-prompt/grid/lr-0.00333333",
        "results/precision-check/copa-deep-prompt-fp32",
    ),
}


def read(run: str) -> tuple[dict[int, float], list[float], dict]:
    """A run's training loss by step, its validation score by epoch and its results.json."""
    rows = [json.loads(line) for line in Path(run, "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}
    validation = [round(r["validation_score"] * 100, 1) for r in rows if r["kind"] == "epoch"]
    return losses, validation, json.loads(Path(run, "results.json").read_text())


def describe(results: dict) -> str:
    return (
        f"{results['score']['mean'] * 100:.1f} (best epoch {results['best_epoch']}, "
        f"{results['epochs_run'][0]} epochs, {results['wall_time_s']:.0f} s)"
    )


for name, (bf16_run, fp32_run) in PAIRS.items():
    (bf16_loss, bf16_val, bf16), (fp32_loss, fp32_val, fp32) = read(bf16_run), read(fp32_run)
    steps = sorted(set(bf16_loss) & set(fp32_loss))
    gaps = [abs(bf16_loss[s] - fp32_loss[s]) for s in steps]
    relative = [abs(bf16_loss[s] - fp32_loss[s]) / abs(fp32_loss[s]) for s in steps]
    print(
        f"{name} | steps {len(steps)} | loss |bf16-fp32| median {statistics.median(gaps):.4f} max {max(gaps):.4f}, "
        f"median rel {100 * statistics.median(relative):.2f}%"
    )
    print("  val by epoch bf16", bf16_val, "\n  val by epoch fp32", fp32_val)
    print(f"  test bf16 {describe(bf16)} | fp32 {describe(fp32)}")
