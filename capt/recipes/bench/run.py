"""Run the benchmark grid: backbones x lengths x methods, then `generate` latency, into one results dict."""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...model import count_parameters
from ..backbones import Backbone, RandomSize, load_backbone, random_backbone
from .inputs import floor_inputs, synthetic_batch
from .measure import TrainStep, interleaved, peak_bytes
from .methods import Method, attach

GENERATE_METHODS = ("floor", "capt-add", "prompt-tuning-100")
BACKBONES = ("minilm", "llama", "t5")  # the default run
# Real pretrained decoders, run only when named: 30 real layers cost far more CPU than the 2-layer random ones.
REAL_DECODERS = {
    "smollm2": "SmolLM2-135M-Instruct, real weights: Llama decoder, 30 layers, d=576, causal LM",
    "gemma3-270m": "Gemma-3-270M, real weights: Gemma-3 decoder, 18 layers (sliding-window and full), d=640, causal LM",
}


@dataclass(frozen=True)
class Options:
    """What to run; `capt bench`'s command line, parsed."""

    backbones: list[str]
    lengths: list[int]
    methods: list[Method]
    batch_size: int
    repeats: int
    warmup: int
    random_size: RandomSize
    gen_lengths: list[int]
    gen_new_tokens: int
    gen_batch_size: int
    seed: int
    clock: str  # "cpu" or "wall": which measurement the ratios use


def build_backbone(name: str, size: RandomSize, seed: int) -> Backbone:
    """One benchmark backbone, in training mode (dropout on, as in a real training step).

    `minilm` has its real weights and a 2-way classifier; `llama` and `t5` are random-weight models with the width
    and head/FFN proportions of real models, only depth and vocabulary cut so a run fits a CPU budget. Every method
    adds a per-layer cost to a per-layer cost, so the ratios barely depend on depth.
    """
    if name == "minilm":
        backbone = load_backbone("minilm", num_labels=2, seed=seed)
        backbone.model.train()
        backbone.description = "all-MiniLM-L6-v2, real weights: BERT encoder, 6 layers, d=384, sequence classifier"
        return backbone
    if name in ("llama", "t5"):
        return random_backbone(name, size, seed)
    if name in REAL_DECODERS:
        backbone = load_backbone(name, seed=seed)
        backbone.model.train()
        backbone.description = REAL_DECODERS[name]
        return backbone
    raise ValueError(f"unknown backbone {name!r}; choose from {', '.join(BACKBONES + tuple(REAL_DECODERS))}")


def run_backbone(name: str, options: Options, log: Callable[[str], None]) -> dict:
    """Every method on one backbone: training cells per length, then `generate` for decoder-only models."""
    backbone = build_backbone(name, options.random_size, options.seed)
    result = {
        "description": backbone.description,
        "parameters": count_parameters(backbone.model)[1],
        "notes": [],
        "methods": {},
    }
    models = {}
    for method in options.methods:
        entry = result["methods"].setdefault(method.name, {"train": {}})
        try:
            models[method.name] = attach(method, backbone, copy.deepcopy(backbone.model))
        except Exception as err:  # a method that cannot be built on this backbone is a result, not a crash
            entry["error"] = _one_line(err)
            log(f"  {method.name}: cannot be built: {entry['error']}")
            continue
        entry["trainable"] = count_parameters(models[method.name])[0]
        if method.method == "ptv2" and backbone.family == "encoder-decoder":
            entry["not_a_peer"] = (
                "PEFT puts prefixes only into the decoder of an encoder-decoder model (peft#2989): no gradient "
                "reaches the encoder, so it is no input-side method and is left out of the peer targets"
            )

    steps = {name: TrainStep(model, embed_inputs=name == "floor") for name, model in models.items()}
    # The models are long-lived: keeping them out of the collector's scans makes `gc.collect()` before each
    # timed step cost microseconds instead of ~0.2 s.
    gc.freeze()
    try:
        _train_cells(backbone, steps, options, result, log)
        if backbone.family == "decoder" and options.gen_lengths:
            usable = {name: model for name, model in models.items() if "error" not in result["methods"][name]}
            result["generate"] = _generate_latency(backbone, usable, options, log)
    finally:
        gc.unfreeze()  # the hooks of attached models form reference cycles: let the collector free them
    return result


def _train_cells(
    backbone: Backbone, steps: dict[str, TrainStep], options: Options, result: dict, log: Callable[[str], None]
) -> None:
    """Time and memory of every method at every length."""
    for length, tokens in _fitting_lengths(backbone, options, result["notes"]):
        started = time.perf_counter()
        batch = synthetic_batch(backbone, options.batch_size, tokens, options.seed)
        for name, step in steps.items():
            step.inputs = floor_inputs(batch) if name == "floor" else batch
        peaks = _memory_round(steps, result["methods"], log)
        times = interleaved(steps, options.warmup, options.repeats)
        for name, seconds in times.items():
            result["methods"][name]["train"][str(length)] = {
                "tokens": tokens,
                **_summary(seconds, times["floor"], options.clock),
                "peak_bytes": peaks[name],
                "memory_ratio": peaks[name] / peaks["floor"],
            }
        log(f"  {backbone.name} N={tokens}: {time.perf_counter() - started:.0f} s")


def _fitting_lengths(backbone: Backbone, options: Options, notes: list[str]) -> list[tuple[int, int]]:
    """(requested length, tokens run) pairs: a model with an absolute position table (BERT: 512) runs at most
    as many tokens as leave room for the longest prompt among the selected methods, so all methods stay
    comparable at the same N."""
    limit = backbone.max_positions
    if limit is None:
        return [(length, length) for length in options.lengths]
    room = limit - max(m.extra_positions for m in options.methods)
    pairs = [(length, min(length, room)) for length in options.lengths]
    for length, tokens in pairs:
        if tokens < length:
            notes.append(
                f"length {length} runs as N={tokens}: {limit} positions minus "
                f"{limit - room} for the longest selected prompt"
            )
    return pairs


def _memory_round(steps: dict[str, TrainStep], entries: dict, log: Callable[[str], None]) -> dict[str, int]:
    """Peak bytes per method; a method whose step fails is recorded and dropped from `steps`."""
    peaks = {}
    for name, step in list(steps.items()):
        try:
            if step.optimizer is not None and not step.optimizer.state:
                step()  # the first step creates the optimizer state; memory is measured in a steady step
            peaks[name] = peak_bytes(step)
        except Exception as err:  # e.g. a PEFT method that this transformers version breaks
            if name == "floor":
                raise
            entries[name]["error"] = _one_line(err)
            log(f"  {name}: training step fails: {entries[name]['error']}")
            del steps[name]
    return peaks


def _generate_latency(backbone: Backbone, models: dict, options: Options, log: Callable[[str], None]) -> dict:
    """Greedy `generate` latency of the base model, `capt-add` and prompt tuning, interleaved like training."""
    chosen = {name: models[name] for name in GENERATE_METHODS if name in models}
    for model in chosen.values():
        model.eval()
    result = {"new_tokens": options.gen_new_tokens, "batch_size": options.gen_batch_size, "lengths": {}, "errors": {}}
    for length in options.gen_lengths:
        started = time.perf_counter()
        prompt = synthetic_batch(backbone, options.gen_batch_size, length, options.seed + 1)
        kwargs = {
            "input_ids": prompt["input_ids"],
            "attention_mask": prompt["attention_mask"],
            "max_new_tokens": options.gen_new_tokens,
            "min_new_tokens": options.gen_new_tokens,  # exactly this many, whatever the random model emits
            "do_sample": False,
            "pad_token_id": 0,
        }
        calls = {name: _bind_generate(model, kwargs) for name, model in chosen.items()}
        positions = {}
        for name in list(calls):
            try:
                positions[name] = _positions_per_call(chosen[name], calls[name])
            except Exception as err:  # a baseline whose generate() breaks is recorded, not fatal
                if name == "floor":
                    raise
                result["errors"][name] = _one_line(err)
                log(f"  {name}: generate fails: {result['errors'][name]}")
                del calls[name]
        times = interleaved(calls, options.warmup, options.repeats)
        result["lengths"][str(length)] = {
            name: _summary(seconds, times["floor"], options.clock) | {"layer0_positions": positions[name]}
            for name, seconds in times.items()
        }
        log(f"  generate prompt={length}: {time.perf_counter() - started:.0f} s")
    for model in chosen.values():
        model.train()
    return result


def _positions_per_call(model: torch.nn.Module, call: Callable[[], object]) -> int:
    """Sequence positions the first layer processes during one untimed call (which also warms the call up).

    With a KV cache that is the prompt (plus prompt tokens or slots) plus one per new token; more means the
    method recomputes something at every decoding step.
    """
    # Decoder-only HF models keep their blocks in `<...>.layers`; wrappers only add prefixes to the name.
    first = next(module for name, module in model.named_modules() if name.endswith("layers.0"))
    seen = []
    handle = first.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True,
    )
    try:
        call()
    finally:
        handle.remove()
    return sum(seen)


def _bind_generate(model: torch.nn.Module, kwargs: dict) -> Callable[[], object]:
    return lambda: model.generate(**kwargs)


def _summary(seconds: dict[str, list], floor: dict[str, list], clock: str) -> dict:
    """Raw times on both clocks, the median and the paired ratio to the floor on the chosen clock."""
    ratios = [s / f for s, f in zip(seconds[clock], floor[clock], strict=True)]
    return {
        "wall_s": seconds["wall"],
        "cpu_s": seconds["cpu"],
        "median_s": statistics.median(seconds[clock]),
        "ratio": statistics.median(ratios),
    }


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
