"""The untrained capsule's norm against the other tokens' norms, layer by layer, for both means (issue 39).

CaPT writes at the front of every layer's input S_i = p_i + Mean(instance tokens). With p_i = 0 (the untrained
capsule, `init="zeros"`) S_i is the mean alone, so its norm shows what p_i has to steer against. In Llama-family
models a few tokens (the first above all) carry massive activations in the middle layers; the plain mean is then
mostly that token divided by N, while the RMS-normalised mean (`CaptConfig.mean_norm="rms"`) weighs every token
at unit scale. This module measures, at the input of each layer, over a few examples encoded exactly as the study
encodes them (the prompt of the task format, the instance tokens the capsule averages at scoring time):
- the norm of the first instance token, and the median and maximum norm of the other instance tokens;
- the norm of the capsule the layer reads, with the plain mean and with the normalised one.

    python -m capt.recipes.analysis.capsule_norms --model smollm2 --task cb --examples 8 \
        --data-dir ../shared/data/superglue --max-length 160 --output docs/reports/capsule-norms-smollm2-cb.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ...config import CaptConfig
from ...model import CaptModel, get_capt_model
from ...saving import atomic_write_text
from ..backbones import load_backbone
from ..data.superglue import load_split
from ..formats import make_format

MEANS = ("none", "rms")


def prompt_ids(task: str, tokenizer, max_length: int, examples: Sequence) -> list[list[int]]:
    """The instance tokens of each example: its first row's prompt (labels -100), as the study's format encodes it."""
    form = make_format("decoder", task, tokenizer, max_length)
    prompts = []
    for example in examples:
        row = form.encode(example)["rows"][0]
        prompts.append([t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label == -100])
    return prompts


def layer_norms(model: CaptModel, ids: list[int]) -> list[dict[str, float]]:
    """Per layer, at its input: the capsule's norm (slot row 0), the first instance token's, the median and max of
    the other instance tokens' norms and the max's position among the instance tokens (one example, no padding);
    and the bare model's (no capsule in front) first-token and largest other-token norms."""
    rows = [
        {**capsule, **{f"bare_{k}": v for k, v in bare.items() if k in ("first", "max_other")}}
        for capsule, bare in zip(_norms(model, ids, slots=1), _bare_norms(model, ids), strict=True)
    ]
    return rows


def _bare_norms(model: CaptModel, ids: list[int]) -> list[dict[str, float]]:
    with model.disable_adapter():
        return _norms(model, ids, slots=0)


def _norms(model: CaptModel, ids: list[int], slots: int) -> list[dict[str, float]]:
    seen: list[torch.Tensor] = []

    def record(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"])[0].detach())

    layers = model.base_model.model.layers
    # Registered after CaPT's own pre-hooks, so each reads the layer input with the capsule written in it.
    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    for hidden in seen:
        norms = hidden.float().norm(dim=-1)
        tokens = norms[slots:]
        rows.append(
            {
                "capsule": norms[0].item() if slots else float("nan"),
                "first": tokens[0].item(),
                "median_other": tokens[1:].median().item(),
                "max_other": tokens[1:].max().item(),
                "max_position": float(tokens[1:].argmax().item() + 1),
            }
        )
    return rows


def measure(model_name: str, task: str, count: int, data_dir: str | None, max_length: int) -> dict[str, list]:
    """{mean: [per layer: {stat: median over the examples}]} for the plain ('none') and normalised ('rms') mean."""
    examples = load_split(task, "val", data_dir)[:count]
    results = {}
    for mean in MEANS:
        backbone = load_backbone(model_name)
        model = get_capt_model(backbone.model, CaptConfig(mean_norm=mean)).eval()  # p_i = 0: the mean alone
        per_example = [layer_norms(model, ids) for ids in prompt_ids(task, backbone.tokenizer, max_length, examples)]
        results[mean] = [
            {stat: statistics.median(ex[layer][stat] for ex in per_example) for stat in per_example[0][layer]}
            for layer in range(len(per_example[0]))
        ]
    return results


def markdown(results: dict[str, list], command: str, model_name: str, task: str, count: int) -> str:
    lines = [
        f"# The untrained capsule's norm per layer: {model_name}, {task}, {count} validation examples",
        "",
        f"Made with `{command}`.",
        "",
        "At the input of each layer (layer 0 reads the embeddings), the median over the examples of: the norm of the",
        "first instance token, the median and the largest norm of the other instance tokens, and the norm of the",
        'capsule the layer reads with p_i = 0 (the mean alone): plain mean (`mean_norm="none"`, the study\'s `capt`)',
        'and RMS-normalised mean (`mean_norm="rms"`, `capt-rms`). Token norms are from the plain-mean model; the',
        'normalised-mean model\'s differ only where its capsule changes the layers below. "largest at": the median',
        "position of the largest other token among the instance tokens (0 is the first). The bare model (no capsule in",
        "front, so its first token sits at position 0) for comparison.",
        "",
        "| layer | bare model: first token | bare model: largest other | first token | other tokens: median | "
        "other tokens: largest | largest at | capsule, plain mean | capsule, normalised mean | plain capsule / "
        "median token | normalised capsule / median token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layer, (plain, rms) in enumerate(zip(results["none"], results["rms"], strict=True)):
        lines.append(
            f"| {layer} | {plain['bare_first']:,.1f} | {plain['bare_max_other']:,.1f} | {plain['first']:,.1f} | "
            f"{plain['median_other']:,.1f} | {plain['max_other']:,.1f} | {plain['max_position']:.0f} | "
            f"{plain['capsule']:,.2f} | {rms['capsule']:,.2f} | {plain['capsule'] / plain['median_other']:.2f} | "
            f"{rms['capsule'] / rms['median_other']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="cb")
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--max-length", type=int, default=160)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    results = measure(args.model, args.task, args.examples, args.data_dir, args.max_length)
    command = "python -m capt.recipes.analysis.capsule_norms " + " ".join(argv if argv is not None else sys.argv[1:])
    atomic_write_text(args.output, markdown(results, command, args.model, args.task, args.examples))
    print(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
