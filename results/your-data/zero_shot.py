"""The untrained SmolLM2 on the rte-chat test rows, scored as the CaPT run is (`ChatFormat.evaluate`): the
reference point of results/your-data/README.md.

    python results/your-data/zero_shot.py runs/your-data/rte-chat/task.yaml results/your-data/rte-chat-zero-shot.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from capt.recipes.backbones import load_backbone
from capt.recipes.formats import make_format
from capt.recipes.tasks import get_task, task_splits


def main(task_file: str, output: Path) -> None:
    spec, splits, _ = task_splits(get_task(task_file))
    backbone = load_backbone("smollm2")
    fmt = make_format(backbone.family, spec.name, backbone.tokenizer, 192)  # the run's --max-length
    features = [fmt.encode(example) for example in splits["test"]]
    scores = fmt.evaluate(backbone.model, features, batch_size=16)
    output.write_text(json.dumps({"task": spec.name, "model": "smollm2", "split": "test", **scores}, indent=2) + "\n")
    print(scores)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
