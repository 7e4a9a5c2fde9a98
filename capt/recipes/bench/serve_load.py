"""Load test of `capt serve`: mixed-task requests at several concurrencies, checked against one-at-a-time answers.

It starts the real server in this process (uvicorn on a free loopback port, `--adapters` or random-capsule
adapters named after tasks) and sends the same `--requests` requests at every concurrency of `--concurrency`:
three in four are greedy completions cycling through the adapters and the base model, one in four a
`/v1/classify` call with an official validation record of that adapter's task. Concurrency 1 is the
one-at-a-time reference: at every other level each answer must equal it, and none may be lost.

    python -m capt.recipes.bench.serve_load --model tiny-llama   # writes benchmarks/results/serve-tiny-llama.*
    python -m capt.recipes.bench.serve_load --model smollm2 --adapters rte=runs/rte,cb=runs/cb
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import torch
import uvicorn

import capt

from ..backbones import load_backbone
from ..data import TASKS
from ..data.superglue import read_jsonl, resolve_data_dir
from ..reporting import environment
from ..serve import Limits, build_engine, create_app

RESULTS = Path("benchmarks/results")  # relative to the repository root, where the command runs
PROMPTS = [
    "The capital of France is",
    "Question: is the sky blue? Answer:",
    "Once upon a time, in a small village,",
    "def add(a, b):",
    "The three primary colours are",
]


def random_adapters(model: str, names: list[str], folder: Path) -> dict[str, Path]:
    """Adapters with random capsules for `model`, one per name (for a load test, not for answers)."""
    adapters = {}
    for seed, name in enumerate(names):
        base = load_backbone(model).model
        torch.manual_seed(seed + 1)
        adapter = capt.get_capt_model(base, capt.CaptConfig(init="normal", init_std=1.0))
        adapter.save_pretrained(folder / name)
        adapter.unload()
        adapters[name] = folder / name
    return adapters


def make_requests(names: list[str], count: int, max_tokens: int, data_dir: str | None) -> list[tuple[str, dict]]:
    """(route, body) pairs: completions over adapters + base, and classify calls for the adapters that are tasks."""
    root = resolve_data_dir(data_dir)
    records = {}
    for name in names:
        if name in TASKS and root is not None:
            path = root / TASKS[name].folder / "val.jsonl"
            records[name] = [record for _, _, record in read_jsonl(path)][:20]
    models = ["base", *names]
    requests = []
    for i in range(count):
        task = names[i % len(names)]
        if i % 4 == 3 and task in records:
            record = {**records[task][i % len(records[task])], "task": task}
            requests.append(("/v1/classify", {"records": [record]}))
        else:
            body = {"model": models[i % len(models)], "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0}
            requests.append(("/v1/completions", {**body, "max_tokens": 1 + i % max_tokens}))
    return requests


async def run_level(url: str, requests: list[tuple[str, dict]], concurrency: int) -> tuple[list, list, float]:
    """Send every request with at most `concurrency` in flight; (answers, latencies in s, wall time in s)."""
    gate = asyncio.Semaphore(concurrency)
    answers: list = [None] * len(requests)
    latencies: list[float] = [0.0] * len(requests)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(i: int) -> None:
            route, body = requests[i]
            async with gate:
                started = time.perf_counter()
                response = await client.post(route, json=body)
                latencies[i] = time.perf_counter() - started
            if response.status_code == 200:
                data = response.json()
                answers[i] = data["choices"][0]["text"] if "choices" in data else _labels(data)
            else:
                answers[i] = f"HTTP {response.status_code}"

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(requests))))
        return answers, latencies, time.perf_counter() - started


def _labels(data: dict) -> list[str]:
    return [p["label"] for result in data["results"] for p in result["predictions"]]


def _lost(row: dict) -> str:
    """The lost count, with what those requests got (e.g. `1 (HTTP 504)`)."""
    detail = ", ".join(f"{n}x {status}" if n > 1 else status for status, n in row["errors"].items())
    return f"{row['lost']} ({detail})" if detail else "0"


def _command(argv: list[str]) -> str:
    """The command line that reproduces the run; the `--note` text is written apart, not repeated in it."""
    kept = [a for i, a in enumerate(argv) if a != "--note" and argv[i - 1 : i] != ["--note"]]
    return shlex.join(
        ["python", "-m", "capt.recipes.bench.serve_load", *(a for a in kept if not a.startswith("--note="))]
    )


def _time_split_row(row: dict) -> str:
    """A level's row of the "where the time goes" table: latency by route, then the worker's seconds by kind."""
    routes = row["by_route_p50_p99_ms"]
    cells = [f"{routes[r][0]:.0f} / {routes[r][1]:.0f}" if r in routes else "-" for r in ("completions", "classify")]
    seconds = row["worker_seconds"]
    cells += [f"{seconds[k]:.1f} ({seconds[k] / row['wall_s']:.0%})" for k in ("classify", "prefill", "decode")]
    return f"| {row['concurrency']} | " + " | ".join(cells) + " |"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capt.recipes.bench.serve_load", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="backbone name or folder (e.g. tiny-llama, smollm2)")
    parser.add_argument("--adapters", help="name=FOLDER pairs; default: random-capsule adapters named rte,cb")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated; the first is the reference")
    parser.add_argument("--max-tokens", type=int, default=16, help="completions ask 1..N tokens")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="the service's per-request timeout, seconds")
    parser.add_argument("--data-dir", help="SuperGLUE folder for the classify records (default: CAPT_DATA_DIR)")
    parser.add_argument("--output", help="results stem (default: benchmarks/results/serve-<model>)")
    parser.add_argument("--note", help="a line for the report, e.g. what else the machine was running")
    args = parser.parse_args(argv)
    command = _command(sys.argv[1:] if argv is None else argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    with tempfile.TemporaryDirectory() as scratch:
        if args.adapters:
            adapters = dict(pair.split("=", 1) for pair in args.adapters.split(","))
        else:
            adapters = random_adapters(args.model, ["rte", "cb"], Path(scratch))
        limits = Limits(
            max_batch=args.max_batch,
            batch_window_s=args.batch_window_ms / 1000,
            queue_size=4096,
            timeout_s=args.timeout,
        )
        engine = build_engine(args.model, adapters, limits)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        requests = make_requests(list(adapters), args.requests, args.max_tokens, args.data_dir)
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(run_level(url, requests[:8], 4))  # warm-up, not measured
            rows, reference = [], None
            for level in levels:
                busy_before = dict(engine.busy)
                answers, latencies, wall = asyncio.run(run_level(url, requests, level))
                busy = {kind: engine.busy[kind] - seconds for kind, seconds in busy_before.items()}
                by_route = {
                    route.removeprefix("/v1/"): [t for (r, _), t in zip(requests, latencies, strict=True) if r == route]
                    for route in ("/v1/completions", "/v1/classify")
                }
                reference = reference or answers
                errors = Counter(str(a) for a in answers if a is None or str(a).startswith("HTTP"))
                answered = [(a, r) for a, r in zip(answers, reference, strict=True) if str(a) not in errors]
                wrong = sum(a != r for a, r in answered)
                rows.append(
                    {
                        "concurrency": level,
                        "requests": len(requests),
                        "throughput_rps": len(requests) / wall,
                        "p50_ms": 1000 * percentile(latencies, 50),
                        "p99_ms": 1000 * percentile(latencies, 99),
                        "by_route_p50_p99_ms": {
                            route: [1000 * percentile(times, 50), 1000 * percentile(times, 99)]
                            for route, times in by_route.items()
                            if times
                        },
                        "worker_seconds": busy,
                        "wall_s": wall,
                        "lost": sum(errors.values()),
                        "errors": dict(errors),
                        "differ_from_one_at_a_time": wrong,
                    }
                )
                print(json.dumps(rows[-1]))
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            engine.stop()

    base = rows[0]["throughput_rps"]
    stem = Path(args.output) if args.output else RESULTS / f"serve-{Path(args.model).name}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": command,
        "note": args.note,
        "model": args.model,
        "adapters": list(adapters),
        "mix": "3/4 greedy completions (1..max_tokens tokens, adapters and base), 1/4 classify (one val record)",
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "batch_window_ms": args.batch_window_ms,
        "environment": environment(),
        "device": str(next(engine.bank.parameters()).device),
    }
    Path(f"{stem}.json").write_text(json.dumps({"meta": meta, "levels": rows}, indent=2) + "\n")
    lines = [
        f"# capt serve load test: {args.model}",
        "",
        f"`{command}`: {args.requests} requests ({meta['mix']}), "
        f"batch window {args.batch_window_ms:g} ms, up to {args.max_batch} per batch, "
        f"{meta['environment']['torch_threads']} torch thread(s), {meta['device']}. "
        f"Concurrency {levels[0]} is the one-at-a-time reference for the answers.",
        "",
        "| concurrency | requests/s | vs one at a time | p50 ms | p99 ms | lost | answers differing |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['concurrency']} | {r['throughput_rps']:.1f} | {r['throughput_rps'] / base:.2f}x | {r['p50_ms']:.0f} "
        f"| {r['p99_ms']:.0f} | {_lost(r)} | {r['differ_from_one_at_a_time']} |"
        for r in rows
    ]
    lines += [
        "",
        "Where the time goes: p50 / p99 latency by route, and the worker's time by kind of forward (seconds and share"
        " of the level's wall time; the rest is waiting for requests, HTTP and tokenizing).",
        "",
        "| concurrency | completions p50 / p99 ms | classify p50 / p99 ms | classify s | prefill s | decode s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_time_split_row(r) for r in rows]
    if args.note:
        lines += ["", args.note]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"written {stem}.md and {stem}.json")
    return 0 if all(r["lost"] == 0 and r["differ_from_one_at_a_time"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
