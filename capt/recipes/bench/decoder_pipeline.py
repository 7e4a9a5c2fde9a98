"""Time of the decoder pipeline on CB: training batches and option scoring, fast path against the plain one.

The backbone is random-weight at SmolLM2-135M's shape (LlamaForCausalLM, 30 layers x 576, 9 heads / 3 key-value
heads, FFN 1536, vocabulary 49152, tied embeddings) on the MiniLM tokenizer, so timings are shape-equivalent, not
the real model's. `--path plain` is the pipeline before the fast paths: labels go into the model, the LM head and
a log-softmax run over every position. `--path fast` scores each (prompt + option) row with logits only at target
positions; `--path one-pass` is today's `CausalLMFormat.scores`: each prompt once, the options from its KV cache
(training as `fast`).

    python -m capt.recipes.bench.decoder_pipeline --path fast --train-batches 6 --eval-examples 23
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..backbones import Backbone, model_source, random_config
from ..data import paper_splits
from ..formats import CausalLMFormat, OptionScoringFormat, _per_example
from ..methods import apply_method

SMOLLM2_SHAPE = dict(width=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152, tie_word_embeddings=True)


def smollm2_shaped(method: str = "capt", seed: int = 0):
    """A random-weight model at SmolLM2-135M's shape, wrapped by `method`, and its (MiniLM) tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(model_source("minilm"))
    torch.manual_seed(seed)
    config = random_config("llama", pad_token_id=tokenizer.pad_token_id, **SMOLLM2_SHAPE)
    backbone = Backbone(AutoModelForCausalLM.from_config(config), tokenizer=None, family="decoder", name="smollm2")
    return apply_method(backbone, method), tokenizer


def measure(path: str, bf16: bool, train_batches: int, eval_examples: int, data_dir: str | None) -> dict:
    model, tokenizer = smollm2_shaped()
    fmt = CausalLMFormat(task="cb", tokenizer=tokenizer, max_length=160)
    splits = paper_splits("cb", data_dir)
    train = [fmt.encode(ex) for ex in splits["train"][: 8 * train_batches]]
    evaluation = [fmt.encode(ex) for ex in splits["validation"][:eval_examples]]
    plain = path == "plain"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model.train()
    started = time.perf_counter()
    for start in range(0, len(train), 8):
        batch = fmt.collate(train[start : start + 8])
        with autocast:
            loss = model(**batch["train_inputs"]).loss if plain else fmt.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    train_s = time.perf_counter() - started

    model.eval()
    predictions, scores = [], []
    started = time.perf_counter()
    with torch.no_grad(), autocast:
        for start in range(0, len(evaluation), 8):
            batch = fmt.collate(evaluation[start : start + 8])
            inputs = batch["score_inputs"]
            if plain:
                rows = OptionScoringFormat.row_scores(fmt, model, inputs)
            elif path == "fast":
                rows = fmt.row_scores(model, inputs)
            else:
                rows = fmt.scores_from_prompt_pass(model, inputs, batch["options"])
            scores += rows.tolist()
            predictions += _per_example(rows, batch["options"]).argmax(-1).tolist()
    eval_s = time.perf_counter() - started
    return {
        "path": path,
        "bf16": bf16,
        "train_batches": len(range(0, len(train), 8)),
        "train_s_per_batch": train_s / len(range(0, len(train), 8)),
        "eval_examples": len(evaluation),
        "eval_examples_per_s": len(evaluation) / eval_s,
        "predictions": predictions,
        "scores": scores,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=("plain", "fast", "one-pass"), default="fast")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast for training and scoring")
    parser.add_argument("--train-batches", type=int, default=6, help="CB training batches of 8 to time")
    parser.add_argument("--eval-examples", type=int, default=23, help="CB validation examples to score")
    parser.add_argument("--data-dir", help="SuperGLUE folder (default: CAPT_DATA_DIR)")
    parser.add_argument("--out", help="write the measurement here as JSON")
    args = parser.parse_args(argv)
    result = measure(args.path, args.bf16, args.train_batches, args.eval_examples, args.data_dir)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("predictions", "scores")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
