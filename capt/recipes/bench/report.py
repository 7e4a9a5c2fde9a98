"""Results on disk: `<stem>.json` (everything), `<stem>.md` (tables and targets), `<stem>.png` (cost vs. length)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..reporting import pyplot
from .methods import METHODS

TRAIN_LIMIT = 1.05  # capt-add training step, x floor
GENERATE_LIMIT = 1.03  # capt-add generate latency, x base model


def evaluate_targets(results: dict) -> list[dict]:
    """One check per (target, backbone, length): the issue's targets for `capt-add`."""
    checks = []
    for backbone, data in results["backbones"].items():
        methods = data["methods"]
        for length, cell in methods.get("capt-add", {}).get("train", {}).items():
            where = {"backbone": backbone, "length": int(length)}
            checks.append(
                {"target": f"train <= {TRAIN_LIMIT}x floor", **where, "value": cell["ratio"], "limit": TRAIN_LIMIT}
            )
            for peer, peer_data in methods.items():
                other = peer_data["train"].get(length)
                if not METHODS[peer].prompt_style or other is None or "not_a_peer" in peer_data:
                    continue
                checks.append(
                    {"target": "faster than prompt-style peers", **where, "peer": peer}
                    | {"value": cell["ratio"], "limit": other["ratio"], "strict": True}
                )
                checks.append(
                    {"target": "memory <= prompt-style peers", **where, "peer": peer}
                    | {"value": cell["peak_bytes"], "limit": other["peak_bytes"]}
                )
        for length, cell in data.get("generate", {}).get("lengths", {}).items():
            if "capt-add" in cell:
                checks.append(
                    {"target": f"generate <= {GENERATE_LIMIT}x base", "backbone": backbone, "length": int(length)}
                    | {"value": cell["capt-add"]["ratio"], "limit": GENERATE_LIMIT}
                )
    for check in checks:
        strict = check.pop("strict", False)
        check["met"] = check["value"] < check["limit"] if strict else check["value"] <= check["limit"]
    return checks


def write_all(results: dict, directory: Path, stem: str) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{stem}.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(results, image=paths[2].name))
    plot(results, paths[2])
    return paths


def markdown(results: dict, image: str) -> str:
    meta, config = results["meta"], results["config"]
    env = meta["environment"]
    lines = [
        "# CaPT benchmark",
        "",
        f"Command: `{meta['command']}`  ",
        f"Started {meta['started_utc']} (UTC), took {meta['duration_s'] / 60:.1f} min; "
        f"load average {meta['load_average_start']} at the start, {meta['load_average_end']} at the end.  ",
        f"Machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['memory_gib']} GiB, {env['platform']}.  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + f", python {env['python']}"
        f"; git {env['git']}.  ",
        f"Batch {config['batch_size']}, {config['threads']} torch thread(s), {config['clock']} clock; "
        f"{config['repeats']} timed rounds after {config['warmup']} warm-up round(s) and the memory round.",
        "",
        "**Time**: training step (forward + backward + AdamW step), median over rounds of the method's time "
        "divided by the floor's time in the same round. **Memory**: peak training memory above the frozen "
        "weights (peak allocations within a step + optimizer state), divided by the floor's. The floor is the "
        "frozen base model, forward + backward on N+1 tokens with gradients to the input embeddings. N is the "
        "number of user tokens.",
        "",
        f"![cost vs. length]({image})",
        "",
        *_targets_section(results["targets"]),
    ]
    for backbone, data in results["backbones"].items():
        lines += [f"## {backbone}", "", f"{data['description']}; {data['parameters']:,} parameters.", ""]
        noise = _noise(data, config["clock"])
        if noise is not None:
            lines.append(
                f"- noise: the per-round time ratios of a cell spread over +/-{100 * noise:.1f}% (median over cells "
                "of half their range); the medians below are steadier, but differences of that size are not resolved"
            )
        lines += [f"- {note}" for note in data["notes"]]
        lines += [f"- `{name}` did not run: {m['error']}" for name, m in data["methods"].items() if "error" in m]
        lines += [f"- `{name}`: {m['not_a_peer']}" for name, m in data["methods"].items() if "not_a_peer" in m]
        lines += ["", *_train_table(data, "time"), "", *_train_table(data, "memory"), ""]
        if "generate" in data:
            lines += [*_generate_table(data["generate"]), ""]
            lines += [
                f"- `{name}` `generate` fails: {error}" for name, error in data["generate"].get("errors", {}).items()
            ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, LogLocator, NullFormatter

    plt = pyplot()
    backbones = list(results["backbones"])
    names = [name for name in results["config"]["methods"] if name != "floor"]
    colors = dict(zip(names, plt.get_cmap("tab20").colors, strict=False))  # the default cycle repeats after 10
    fig, axes = plt.subplots(2, len(backbones), figsize=(5 * len(backbones), 8), squeeze=False)
    for column, backbone in enumerate(backbones):
        methods = results["backbones"][backbone]["methods"]
        tokens = sorted({cell["tokens"] for method in methods.values() for cell in method["train"].values()})
        for row, (key, label) in enumerate((("ratio", "step time"), ("memory_ratio", "peak memory"))):
            ax = axes[row][column]
            for name, method in methods.items():
                cells = sorted(method["train"].values(), key=lambda c: c["tokens"])
                if name == "floor" or not cells:
                    continue
                style = "-" if name.startswith("capt") else "--" if METHODS[name].prompt_style else ":"
                ax.plot(
                    [c["tokens"] for c in cells],
                    [c[key] for c in cells],
                    style,
                    marker="o",
                    color=colors[name],
                    linewidth=2.2 if name == "capt-add" else 1.2,
                    label=name,
                )
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(FixedLocator(tokens))
            ax.xaxis.set_major_formatter(FormatStrFormatter("%d"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0)))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%.2g"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"{backbone}: {label}")
            ax.set_xlabel(f"user tokens N (batch {results['config']['batch_size']})")
            ax.set_ylabel(f"{label} / floor")
    # Methods that failed on one backbone are missing from its axes: collect the legend from all of them.
    legend = {}
    for ax in axes.flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    ordered = [name for name in names if name in legend]
    fig.legend([legend[n] for n in ordered], ordered, loc="lower center", ncol=min(7, max(1, len(ordered))))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _targets_section(checks: list[dict]) -> list[str]:
    lines = ["## Targets (`capt-add`)", "", "| target | met | misses |", "|---|---|---|"]
    for target in dict.fromkeys(c["target"] for c in checks):
        group = [c for c in checks if c["target"] == target]
        misses = [
            f"{c['backbone']} N={c['length']}" + (f" vs {c['peer']}" if "peer" in c else "") + f" ({_fmt(c)})"
            for c in group
            if not c["met"]
        ]
        lines.append(f"| {target} | {len(group) - len(misses)}/{len(group)} | {'; '.join(misses) or '-'} |")
    return [*lines, ""]


def _fmt(check: dict) -> str:
    if "memory" in check["target"]:
        return f"{check['value'] / 2**20:.1f} vs {check['limit'] / 2**20:.1f} MiB"
    return f"{check['value']:.3f}x vs {check['limit']:.3f}x"


def _train_table(data: dict, kind: str) -> list[str]:
    tokens = {}
    for method in data["methods"].values():
        for length, cell in method["train"].items():
            tokens[int(length)] = cell["tokens"]
    lengths = sorted(tokens)
    title = "Training step time (x floor)" if kind == "time" else "Peak training memory (x floor)"
    lines = [
        f"**{title}**",
        "",
        "| method | trainable | " + " | ".join(f"N={tokens[n]}" for n in lengths) + " |",
        "|---|---:|" + "---:|" * len(lengths),
    ]
    for name, method in data["methods"].items():
        cells = []
        for length in lengths:
            cell = method["train"].get(str(length))
            if cell is None:
                cells.append("-")
            elif name == "floor":
                cells.append(_duration(cell["median_s"]) if kind == "time" else f"{cell['peak_bytes'] / 2**20:.1f} MiB")
            else:
                cells.append(f"{cell['ratio' if kind == 'time' else 'memory_ratio']:.3f}x")
        trainable = f"{method['trainable']:,}" if "trainable" in method else "-"
        lines.append(f"| {name} | {trainable} | " + " | ".join(cells) + " |")
    return lines


def _generate_table(gen: dict) -> list[str]:
    lengths = list(gen["lengths"])
    names = list(next(iter(gen["lengths"].values()), {}))
    lines = [
        f"**`generate` latency (greedy, {gen['new_tokens']} new tokens, batch {gen['batch_size']}; x base)**",
        "",
        "| method | " + " | ".join(f"prompt {n}" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name in names:
        cells = [gen["lengths"][n][name] for n in lengths]
        text = [_duration(c["median_s"]) if name == "floor" else f"{c['ratio']:.3f}x" for c in cells]
        lines.append(f"| {'base' if name == 'floor' else name} | " + " | ".join(text) + " |")
    lines += ["", "Positions the first layer processes per `generate` call (prompt + new tokens with a KV cache):", ""]
    lines += ["| method | " + " | ".join(f"prompt {n}" for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for name in names:
        counts = [str(gen["lengths"][n][name]["layer0_positions"]) for n in lengths]
        lines.append(f"| {'base' if name == 'floor' else name} | " + " | ".join(counts) + " |")
    return lines


def _noise(data: dict, clock: str) -> float | None:
    """Median over cells of half the range of the per-round paired time ratios."""
    floor = data["methods"]["floor"]["train"]
    halves = []
    for name, method in data["methods"].items():
        for length, cell in method["train"].items():
            ratios = [s / f for s, f in zip(cell[f"{clock}_s"], floor[length][f"{clock}_s"], strict=True)]
            if name != "floor" and len(ratios) > 1:
                halves.append((max(ratios) - min(ratios)) / 2)
    return statistics.median(halves) if halves else None


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
