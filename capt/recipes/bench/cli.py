"""Command line of `capt bench`."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from ..backbones import RandomSize
from ..reporting import environment
from .methods import METHODS, parse_methods
from .report import evaluate_targets, write_all
from .run import BACKBONES, REAL_DECODERS, Options, log_to_stderr, run_backbone


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capt bench",
        description="Training-step time and peak memory of CaPT vs. its floor and PEFT baselines, in one process "
        "(methods interleaved, median of paired ratios), plus decoder-only generate latency. `capt bench chat --help`: "
        "a CaPT training step on chat data against the frozen model's forward and backward.",
    )
    parser.add_argument(
        "--backbones",
        default=",".join(BACKBONES),
        help=f"comma list of: %(default)s (default), {', '.join(REAL_DECODERS)}",
    )
    parser.add_argument("--lengths", default="64,128,256,512", help="user tokens N per sequence (default %(default)s)")
    parser.add_argument(
        "--batch-size", type=int, default=4, help="sequences per step (default %(default)s; the issue asks 16)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is reported")
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="untimed rounds before the timed ones, after the memory round (a warm-up too)",
    )
    parser.add_argument("--methods", default="all", help=f"'all' or a comma list of: {', '.join(METHODS)}")
    parser.add_argument("--width", type=int, default=768, help="hidden size of the random llama/t5 backbones")
    parser.add_argument("--layers", type=int, default=2, help="layers of the random backbones (T5: per stack)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary of the random backbones")
    parser.add_argument("--gen-lengths", default="64,128,256,512", help="generate prompt lengths ('' to skip)")
    parser.add_argument("--gen-new-tokens", type=int, default=32)
    parser.add_argument("--gen-batch-size", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: steady under load from other processes; 0 = torch's choice)",
    )
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="clock of the reported times and ratios (default cpu: process CPU time, for one thread)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output-dir",
        "--out",
        dest="out",
        type=Path,
        default=Path("runs/bench"),
        help="folder of the outputs (default %(default)s; the committed runs are in benchmarks/results)",
    )
    parser.add_argument("--name", default="bench", help="file stem of the outputs (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chat"]:  # a sibling measurement with its own flags (capt bench chat --help)
        from .chat_step import main as chat_step

        return chat_step(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = Options(
            backbones=_names(args.backbones, BACKBONES + tuple(REAL_DECODERS)),
            lengths=_ints(args.lengths),
            methods=parse_methods(args.methods),
            batch_size=args.batch_size,
            repeats=args.repeats,
            warmup=args.warmup,
            random_size=RandomSize(width=args.width, layers=args.layers, vocab=args.vocab),
            gen_lengths=_ints(args.gen_lengths),
            gen_new_tokens=args.gen_new_tokens,
            gen_batch_size=args.gen_batch_size,
            seed=args.seed,
            clock=args.clock,
        )
    except ValueError as err:
        parser.error(str(err))
    if not options.lengths or min(options.batch_size, options.repeats, args.width, args.layers) < 1:
        parser.error("--lengths must name a length; --batch-size, --repeats, --width and --layers must be >= 1")
    if options.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(options, args, argv)
    finally:
        torch.set_num_threads(threads)  # main() may run inside a bigger process (tests, the capt CLI)


def _run(options: Options, args: argparse.Namespace, argv: list[str] | None) -> int:
    started, load_start = time.time(), _load()
    results = {
        "meta": {
            "command": ("capt bench " + shlex.join(argv if argv is not None else sys.argv[1:])).strip(),
            "started_utc": datetime.fromtimestamp(started, timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "load_average_start": load_start,
            "environment": environment(),
        },
        "config": {
            "batch_size": options.batch_size,
            "repeats": options.repeats,
            "warmup": options.warmup,
            "lengths": options.lengths,
            "methods": [m.name for m in options.methods],
            "random_backbones": asdict(options.random_size),
            "seed": options.seed,
            "clock": options.clock,
            "threads": torch.get_num_threads(),
        },
        "backbones": {},
    }
    with _quiet():
        for name in options.backbones:
            log_to_stderr(f"{name}:")
            results["backbones"][name] = run_backbone(name, options, log_to_stderr)
            # Written after every backbone so a long run that is cut short still leaves its results.
            results["meta"] |= {"duration_s": time.time() - started, "load_average_end": _load()}
            results["targets"] = evaluate_targets(results)
            paths = write_all(results, args.out, args.name)
    log_to_stderr("wrote " + ", ".join(str(p) for p in paths))
    return 0


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence load reports, progress bars and deprecation chatter of transformers and PEFT during the run."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load() -> list[float] | None:
    """Load average of the machine: other processes make timings noisy, so it is recorded."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if any(v < 1 for v in values):
        raise ValueError(f"lengths must be positive integers, got {text!r}")
    return values


def _names(text: str, known: tuple[str, ...]) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown or no backbones {unknown}; choose from {', '.join(known)}")
    return names
