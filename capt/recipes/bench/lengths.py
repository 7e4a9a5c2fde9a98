"""How long each task's examples are in a backbone's own tokens, and what share a max length would truncate.

The study picks `--max-length` per task as small as the task allows (benchmarks/decoder-pipeline.md). This
measures it with the backbone's tokenizer and the exact format the run uses: an example's length is its longest
row (the prompt plus its longest option for decoders and T5; the packed pair for encoders), untruncated. The
capsule slot adds one position inside the model; it is not counted here, as `--max-length` does not count it.

    python -m capt.recipes.bench.lengths --model smollm2 --tasks cb,copa,rte,wic --limits 64,96,128,160,256 \
        --data-dir ../shared/data/superglue --out benchmarks/results/lengths-smollm2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from ...saving import atomic_write_text
from ...sites import config_family
from ..backbones import TINY_MODELS, model_source
from ..data.superglue import paper_splits
from ..formats import make_format

UNLIMITED = 10**9  # a max length no example reaches: the format then truncates nothing


def task_lengths(
    model: str, task: str, data_dir: str | None, first: int | None = None, decoder_head: str = "lm"
) -> list[int]:
    """Untruncated token lengths of the training split's examples (its first `first` if given).

    Example:
        >>> lengths = task_lengths("tiny-llama", "cb", "../shared/data/superglue", first=5)  # doctest: +SKIP
    """
    source = model_source(model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    family = ("encoder-decoder" if TINY_MODELS[model] == "t5" else "decoder") if model in TINY_MODELS else None
    fmt = make_format(
        family or config_family(AutoConfig.from_pretrained(source)),
        task,
        tokenizer,
        UNLIMITED,
        decoder_head=decoder_head,
    )
    train = paper_splits(task, data_dir)["train"][:first]
    return [fmt.length(fmt.encode(example)) for example in train]


def summarise(task: str, lengths: list[int], limits: list[int]) -> dict[str, Any]:
    """Median, 95th percentile, max, and the share of examples longer than each limit.

    Example:
        >>> summarise("cb", [10, 20, 30, 40], [25])["truncated"]
        {'25': 0.5}
    """
    ordered = sorted(lengths)
    return {
        "task": task,
        "examples": len(ordered),
        "median": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
        "max": ordered[-1],
        "truncated": {str(limit): sum(n > limit for n in ordered) / len(ordered) for limit in limits},
    }


def table(rows: list[dict[str, Any]], limits: list[int]) -> str:
    header = " / ".join(str(limit) for limit in limits)
    lines = [
        f"| task | examples | median | p95 | max | truncated at {header} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        shares = " / ".join(f"{100 * r['truncated'][str(limit)]:.1f}" for limit in limits)
        lines.append(f"| {r['task']} | {r['examples']} | {r['median']:g} | {r['p95']} | {r['max']} | {shares}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="backbone name or local folder (its tokenizer is read)")
    parser.add_argument("--tasks", default="cb,copa,rte,wic", help="comma-separated SuperGLUE tasks")
    parser.add_argument("--limits", default="64,96,128,160,256", help="comma-separated max lengths to report")
    parser.add_argument("--first", type=int, default=None, help="only the first N training examples per task")
    parser.add_argument("--decoder-head", default="lm", choices=("lm", "classifier"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    try:
        limits = [int(v) for v in args.limits.split(",")]
    except ValueError:
        parser.error(f"--limits: {args.limits!r} is not a comma-separated list of integers")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    rows = [
        summarise(task, task_lengths(args.model, task, args.data_dir, args.first, args.decoder_head), limits)
        for task in tasks
    ]
    text = table(rows, limits)
    print(text, end="")
    if args.out:
        atomic_write_text(Path(f"{args.out}.md"), f"Model: {args.model}\n\n{text}")
        atomic_write_text(Path(f"{args.out}.json"), json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
