"""How long `capt --help` takes, against `python -c pass`, interleaved in one run (issue 37: under 1 s more).

    python benchmarks/cli_startup.py --rounds 7   # -> benchmarks/results/cli_startup.{json,md}

Each round starts, in a rotating order, one fresh interpreter per command: `python -c pass` (the floor every
command pays), `capt --help`, `capt train --help`, and, for scale, `python -c "import capt.recipes.run"` (torch,
transformers and peft: what every `--help` imported before 0.3). Reported per command: the median over rounds of
its wall time and of its CPU time (user + system of the child, what a busy machine disturbs least), and the median
of the paired difference to `python -c pass` in the same round. The load average before and after is recorded:
on a busy machine the differences within one run are what counts, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "capt --help": ["-m", "capt.recipes.cli", "--help"],
    "capt train --help": ["-m", "capt.recipes.cli", "train", "--help"],
    "import capt.recipes.run (torch)": ["-c", "import capt.recipes.run"],
}
FLOOR = "python -c pass"


def _timed(args: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh interpreter running `args`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(rounds: int) -> dict:
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    names = list(COMMANDS)
    for args in COMMANDS.values():  # warm the file cache: the first start of each reads its files from disk
        _timed(args)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            times[name].append(_timed(COMMANDS[name]))
    summary = {}
    for name, samples in times.items():
        summary[name] = {
            "wall_s": statistics.median(w for w, _ in samples),
            "cpu_s": statistics.median(c for _, c in samples),
            "wall_minus_floor_s": statistics.median(w - f[0] for (w, _), f in zip(samples, times[FLOOR], strict=True)),
            "cpu_minus_floor_s": statistics.median(c - f[1] for (_, c), f in zip(samples, times[FLOOR], strict=True)),
            "samples": samples,
        }
    return summary


def report(summary: dict, meta: dict) -> str:
    lines = [
        "# `capt --help` start-up, against `python -c pass`",
        "",
        f"`{meta['command']}`: {meta['rounds']} interleaved rounds on {meta['cpus']} CPUs, load average "
        f"{meta['load_before']:.1f} before and {meta['load_after']:.1f} after; Python {meta['python']}.",
        "",
        "| command | wall (median) | CPU (median) | wall - `python -c pass` | CPU - `python -c pass` |",
        "|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        lines.append(
            f"| `{name}` | {row['wall_s']:.3f} s | {row['cpu_s']:.3f} s | {row['wall_minus_floor_s']:+.3f} s "
            f"| {row['cpu_minus_floor_s']:+.3f} s |"
        )
    lines += [
        "",
        "Target (issue 37): `capt --help` under 1 s more than `python -c pass` on an idle machine. The differences are "
        "paired per round, so load that hits a round hits both; the CPU column is the child's own compute.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default: 7)")
    parser.add_argument(
        "--output-dir",
        default="benchmarks/results",
        help="where cli_startup.{json,md} go (default: benchmarks/results)",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    summary = measure(args.rounds)
    meta = {
        "command": "python benchmarks/cli_startup.py --rounds " + str(args.rounds),
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "python": platform.python_version(),
        "machine": platform.platform(),
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from capt.saving import atomic_write_text  # imports torch: only after the measurement

    atomic_write_text(out / "cli_startup.json", json.dumps({"meta": meta, "results": summary}, indent=2) + "\n")
    text = report(summary, meta)
    atomic_write_text(out / "cli_startup.md", text)
    print(text)


if __name__ == "__main__":
    main()
