"""Build the "your own data" files of results/your-data/ from SuperGLUE, shaped as a user's data would be.

- cb-pairs/: CB's training rows as a CSV of sentence pairs with a user's column names (premise -> sentence1,
  hypothesis -> sentence2, label -> verdict); its test file is CB's official validation split.
- rte-chat/: RTE rows as OpenAI-style `messages` (the premise and the hypothesis as a question from the user, a
  "yes" or "no" from the assistant): train and validation from disjoint slices of RTE's training rows, test from
  its official validation split, and a task file that makes exact match the headline metric.

    python results/your-data/build_data.py ../shared/data/superglue data/your-data

The files are not committed: this script rebuilds them, byte for byte, from the SuperGLUE files.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

# Small enough for a run of about 10 minutes on one CPU thread.
RTE_SIZES = {"train": 160, "validation": 32, "test": 100}
RTE_TASK = """\
name: rte-chat
kind: generate
text_fields: [messages]
source: {train: train.jsonl, validation: validation.jsonl, test: test.jsonl}
metrics: [exact_match, token_f1, loss, perplexity]
"""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_pairs(rows: list[dict], path: Path) -> None:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sentence1", "sentence2", "verdict"])
        writer.writerows([row["premise"], row["hypothesis"], row["label"]] for row in rows)


def chat_row(row: dict) -> dict:
    question = f'{row["premise"]}\n\nDoes it follow that "{row["hypothesis"]}"? Answer yes or no.'
    answer = "yes" if row["label"] == "entailment" else "no"
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def main(superglue: Path, out: Path) -> None:
    pairs = out / "cb-pairs"
    pairs.mkdir(parents=True, exist_ok=True)
    write_pairs(read_jsonl(superglue / "CB" / "train.jsonl"), pairs / "train.csv")
    write_pairs(read_jsonl(superglue / "CB" / "val.jsonl"), pairs / "test.csv")

    chat = out / "rte-chat"
    chat.mkdir(parents=True, exist_ok=True)
    train = read_jsonl(superglue / "RTE" / "train.jsonl")
    splits = {
        "train": train[: RTE_SIZES["train"]],
        "validation": train[RTE_SIZES["train"] : RTE_SIZES["train"] + RTE_SIZES["validation"]],
        "test": read_jsonl(superglue / "RTE" / "val.jsonl")[: RTE_SIZES["test"]],
    }
    for split, rows in splits.items():
        lines = "".join(json.dumps(chat_row(row)) + "\n" for row in rows)
        (chat / f"{split}.jsonl").write_text(lines, encoding="utf-8")
    (chat / "task.yaml").write_text(RTE_TASK, encoding="utf-8")
    print(f"wrote {pairs} and {chat}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python results/your-data/build_data.py SUPERGLUE_DIR OUT_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
