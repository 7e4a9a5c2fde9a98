"""bf16 against float32: every run of the float32 study (results/smollm2-study/) beside its bf16 twin, the run at the
same place in results/smollm2-study-bf16/ (run from the repository root; prints a Markdown table)."""

import json
import statistics
from pathlib import Path

FP32_STUDY, BF16_STUDY = Path("results/smollm2-study"), Path("results/smollm2-study-bf16")


def read(run: Path) -> tuple[dict[int, float], list[float], dict]:
    """A run's training loss by step, its validation score by epoch and its results.json."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}
    validation = [round(r["validation_score"] * 100, 1) for r in rows if r["kind"] == "epoch"]
    return losses, validation, json.loads((run / "results.json").read_text())


def test_score(results: dict) -> str:
    return f"{results['score']['mean'] * 100:.1f} (epoch {results['best_epoch'][0]} of {results['epochs_run'][0]})"


print("| run | lr | seed | loss gap, median relative (max) | validation by epoch: bf16 / fp32 | test: bf16 | fp32 |")
print("|---|---|---|---|---|---|---|")
runs = sorted(path.parent for path in FP32_STUDY.glob("*/*/**/metrics.jsonl"))  # runs, not cell summaries
for fp32_run in runs:
    where = fp32_run.relative_to(FP32_STUDY)
    if not (BF16_STUDY / where / "results.json").exists() or not (fp32_run / "results.json").exists():
        continue  # no bf16 twin, or still training
    (bf16_loss, bf16_val, bf16), (fp32_loss, fp32_val, fp32) = read(BF16_STUDY / where), read(fp32_run)
    steps = sorted(set(bf16_loss) & set(fp32_loss))
    relative = [abs(bf16_loss[s] - fp32_loss[s]) / abs(fp32_loss[s]) for s in steps]
    gaps = [abs(bf16_loss[s] - fp32_loss[s]) for s in steps]
    settings = json.loads((fp32_run / "run_config.json").read_text())
    validation = f"{', '.join(map(str, bf16_val))} / {', '.join(map(str, fp32_val))}"
    print(
        f"| {where.parts[0]} {where.parts[1]} | {settings['lr']:g} | {settings['seed']} "
        f"| {100 * statistics.median(relative):.1f}% ({max(gaps):.2f} nats) | {validation} "
        f"| {test_score(bf16)} | {test_score(fp32)} |"
    )
