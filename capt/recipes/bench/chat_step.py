"""Time of a CaPT training step on chat data against the frozen model's own forward and backward.

    capt bench chat --model smollm2 --batch-size 8 --batches 4 --repeats 20 --data-dir ../shared/data/superglue \
        --out benchmarks/results/chat-step.json

The rows are chat data as a user would bring it, built from SuperGLUE RTE's validation split: the premise and the
question as the user's turn, "True" or "False" as the assistant's. `ChatFormat` writes them with the model's own
chat template (plain prompt and completion for a tokenizer without one) and cuts them into batches in file order.

Three calls per batch, interleaved (`capt.recipes.bench.measure.interleaved`: one call of each per round, in a
rotating order, the same batch for all in a round), each a forward, a backward and (CaPT) an optimizer step:

- `capt`: `ChatFormat.loss` on a CaptModel (the prompt as instance, logits at answer positions only), AdamW on the
  capsules.
- `floor`: the frozen model alone, on the same rows one token longer (where the capsule sits), gradients to its
  input embeddings (the only way a frozen model's backward runs), the same loss.
- `floor-full-logits`: as `floor`, with the model's own loss (labels into the model: the LM head on every
  position), what a plain `model(**batch, labels=...)` costs.

The reported cost of CaPT is the median over rounds of capt / floor in the same round (the target: at most 1.05).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...model import get_capt_model
from ...saving import atomic_write_text
from ..backbones import load_backbone
from ..chat import ChatFormat
from ..data import Example, load_split
from ..formats import target_logprobs
from ..reporting import environment
from .measure import interleaved

TARGET_RATIO = 1.05


def chat_rows(data_dir: str | None, count: int) -> list[Example]:
    """`count` RTE validation examples as prompt/completion chat rows (a user turn and an assistant answer)."""
    rows = []
    for example in load_split("rte", "val", data_dir)[:count]:
        fields = example.fields
        prompt = f"{fields['premise']}\nQuestion: {fields['hypothesis']} True or False?"
        answer = "True" if example.label == 0 else "False"  # RTE's label 0 is entailment
        rows.append(Example("rte-chat", example.idx, {"prompt": prompt, "completion": answer}, None))
    return rows


def floor_loss(base: nn.Module, inputs: dict[str, torch.Tensor], full_logits: bool) -> torch.Tensor:
    """The frozen model's loss on the rows with one more context token in front, from input embeddings that need
    a gradient; with `full_logits`, the model's own loss over every position."""
    ids = torch.cat([inputs["input_ids"][:, :1], inputs["input_ids"]], 1)
    mask = torch.cat([inputs["attention_mask"][:, :1], inputs["attention_mask"]], 1)
    labels = torch.cat([torch.full_like(inputs["labels"][:, :1], -100), inputs["labels"]], 1)
    embeds = base.get_input_embeddings()(ids).detach().requires_grad_(True)
    if full_logits:
        return base(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    first_target = int((labels != -100).int().argmax(-1).min())
    logits = base(inputs_embeds=embeds, attention_mask=mask, logits_to_keep=labels.shape[1] - first_target + 1).logits
    return -target_logprobs(logits, labels, shifted=True).sum() / (labels[:, 1:] != -100).sum()


def measure(
    model_name: str, batch_size: int, batches: int, repeats: int, warmup: int, max_length: int, data_dir: str | None
) -> dict[str, Any]:
    backbone = load_backbone(model_name)
    floor_model = copy.deepcopy(backbone.model).train().requires_grad_(False)
    capt_model = get_capt_model(backbone.model).train()
    fmt = ChatFormat(task="rte-chat", tokenizer=backbone.tokenizer, max_length=max_length)
    rows = [fmt.encode(example) for example in chat_rows(data_dir, batch_size * batches)]
    collated = [fmt.collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    optimizer = torch.optim.AdamW([p for p in capt_model.parameters() if p.requires_grad], lr=1e-3)

    def capt_step(batch: dict[str, Any]) -> None:
        fmt.loss(capt_model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    calls = {
        "capt": capt_step,
        "floor": lambda batch: floor_loss(floor_model, batch["train_inputs"], full_logits=False).backward(),
        "floor-full-logits": lambda batch: floor_loss(floor_model, batch["train_inputs"], full_logits=True).backward(),
    }
    rounds = {name: iter(range(warmup + repeats)) for name in calls}

    def bound(name: str):
        return lambda: calls[name](collated[next(rounds[name]) % len(collated)])

    times = interleaved({name: bound(name) for name in calls}, warmup, repeats)
    return {
        "model": model_name,
        "batch_size": batch_size,
        "batches": len(collated),
        "mean_tokens_per_row": statistics.fmean(len(r["input_ids"]) for r in rows),
        "mean_answer_tokens_per_row": statistics.fmean(sum(t != -100 for t in r["labels"]) for r in rows),
        "repeats": repeats,
        "warmup": warmup,
        "threads": torch.get_num_threads(),
        "times": times,
        "environment": environment(),
    }


def summarize(result: dict[str, Any], clock: str) -> dict[str, Any]:
    """Median seconds per call and the paired ratios capt / floor and capt / floor-full-logits on `clock`."""
    times = {name: seconds[clock] for name, seconds in result["times"].items()}

    def ratio(over: str) -> float:
        return statistics.median(c / f for c, f in zip(times["capt"], times[over], strict=True))

    return {
        "clock": clock,
        "median_s": {name: statistics.median(seconds) for name, seconds in times.items()},
        "ratio_to_floor": ratio("floor"),
        "ratio_to_floor_full_logits": ratio("floor-full-logits"),
        "target": TARGET_RATIO,
        "meets_target": ratio("floor") <= TARGET_RATIO,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="capt bench chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="decoder backbone (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, taken in turn by the rounds")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds; medians are reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's choice)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="clock of the ratios")
    parser.add_argument("--data-dir", help="SuperGLUE folder (default: CAPT_DATA_DIR)")
    parser.add_argument("--out", type=Path, help="write the measurement and its summary here as JSON")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.batches, args.repeats, args.max_length) < 1 or min(args.warmup, args.threads) < 0:
        parser.error("--batch-size, --batches, --repeats and --max-length must be >= 1; --warmup, --threads >= 0")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = measure(
            args.model, args.batch_size, args.batches, args.repeats, args.warmup, args.max_length, args.data_dir
        )
    finally:
        torch.set_num_threads(threads)
    result["command"] = "capt bench chat " + shlex.join(argv if argv is not None else sys.argv[1:])
    result["summary"] = summarize(result, args.clock)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
