"""Greedy `generate` on a real decoder LM (SmolLM2-135M, Gemma-3-270M): CaPT against the bare base model, interleaved.

    HF_HUB_OFFLINE=1 python benchmarks/generate_overhead.py --rounds 15 --new-tokens 32 [--prompt-tokens 256]

Each round runs the bare model (no hooks attached) and the CaPT model (attached for the run, then unloaded) on the
same prompt, in alternating order, on one torch thread. Reported: the median over rounds of the paired ratio
capt / base, on CPU time (`time.process_time`, what a busy machine disturbs least) and on wall time. Both runs
produce exactly `--new-tokens` tokens (`min_new_tokens`), so they do the same number of decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import capt
from capt.recipes.gguf import pretrained_folder

PROMPT = "Write one sentence about the history of the city of Paris and its river."


def _timed(run) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a real decoder backbone: smollm2 or gemma3-270m")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="repeat the request until the chat prompt has at least this many"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = pretrained_folder(args.model)
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    repeats = 1
    while True:
        request = " ".join([PROMPT] * repeats)
        chat = [{"role": "user", "content": request}]
        # The Gemma-3-270M package is the base model: it has no chat template, so it gets the plain request.
        text = (
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            if tokenizer.chat_template
            else request
        )
        if len(tokenizer(text)["input_ids"]) >= args.prompt_tokens:
            break
        repeats += 1
    inputs = tokenizer([text] * args.batch, return_tensors="pt")
    n = args.new_tokens
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    def run_base():
        base.generate(**inputs, **kwargs)

    def run_capt():
        model = capt.get_capt_model(base)
        try:
            model.generate(**inputs, **kwargs)
        finally:
            model.unload()

    for _ in range(args.warmup):
        run_base(), run_capt()
    ratios_cpu, ratios_wall, base_cpu, capt_cpu = [], [], [], []
    for r in range(args.rounds):
        order = (run_base, run_capt) if r % 2 == 0 else (run_capt, run_base)
        times = {fn: _timed(fn) for fn in order}
        (b_cpu, b_wall), (c_cpu, c_wall) = times[run_base], times[run_capt]
        ratios_cpu.append(c_cpu / b_cpu)
        ratios_wall.append(c_wall / b_wall)
        base_cpu.append(b_cpu)
        capt_cpu.append(c_cpu)
    print(
        f"{args.model}: prompt {inputs['input_ids'].shape[1]} tokens, batch {args.batch}, {n} new tokens, "
        f"{args.rounds} rounds, "
        f"torch {torch.__version__}, 1 thread"
    )
    print(f"base cpu s/run: median {statistics.median(base_cpu):.3f}; capt: {statistics.median(capt_cpu):.3f}")
    print(
        f"capt / base: cpu median {statistics.median(ratios_cpu):.3f} "
        f"(min {min(ratios_cpu):.3f}, max {max(ratios_cpu):.3f}); wall median {statistics.median(ratios_wall):.3f}"
    )


if __name__ == "__main__":
    main()
