"""PNG figures of the analyses (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..reporting import pyplot
from .anchors import GROUPS
from .attention import StreamMap, StreamSummary
from .tokens import SLOT, STRUCTURAL

ROLE_COLORS = {SLOT: "#c0392b", STRUCTURAL: "#1f5fbf"}  # input tokens stay black
INPUT_COLOR = "#222222"


def _shown(m: StreamMap, max_tokens: int) -> tuple[torch.Tensor, int, int, str]:
    """The map cut to the first max_tokens queries and keys, and a note when it was cut."""
    queries, keys = min(len(m.query_tokens), max_tokens), min(len(m.key_tokens), max_tokens)
    cut = queries < len(m.query_tokens) or keys < len(m.key_tokens)
    note = f" (first {max_tokens} of {max(len(m.query_tokens), len(m.key_tokens))} tokens)" if cut else ""
    return m.attention[:, :queries, :keys], queries, keys, note


def _draw(axes, matrix: torch.Tensor, m: StreamMap, queries: int, keys: int, fontsize: float):
    from matplotlib.colors import PowerNorm

    # A square-root scale: the anchor columns would otherwise wash out everything else.
    image = axes.imshow(matrix.numpy(), cmap="viridis", norm=PowerNorm(0.5, vmin=0.0, vmax=1.0), aspect="auto")
    axes.set_xticks(range(keys), m.key_tokens[:keys], rotation=90, fontsize=fontsize)
    axes.set_yticks(range(queries), m.query_tokens[:queries], fontsize=fontsize)
    for labels, roles in (
        (axes.get_xticklabels(), m.key_roles[:keys]),
        (axes.get_yticklabels(), m.query_roles[:queries]),
    ):
        for label, role in zip(labels, roles, strict=True):
            label.set_color(ROLE_COLORS.get(role, INPUT_COLOR))
            label.set_fontweight("normal" if role not in ROLE_COLORS else "bold")
    return image


def plot_token_map(path: Path, m: StreamMap, title: str, max_tokens: int = 48) -> Path:
    """Heatmap averaged over heads and layers; slot (red) and structural (blue) tokens labelled in colour.

    Example:
        >>> import tempfile
        >>> m = StreamMap(torch.full((2, 3, 3), 1 / 3), ["[CAPSULE]", "[CLS]", "cat"], ["[CAPSULE]", "[CLS]", "cat"],
        ...               ["slot", "structural", "input"], ["slot", "structural", "input"], cross=False)
        >>> plot_token_map(Path(tempfile.mkdtemp()) / "map.png", m, "demo").stat().st_size > 0
        True
    """
    plt = pyplot()
    matrix, queries, keys, note = _shown(m, max_tokens)
    size = 2.5 + 0.16 * keys
    figure, axes = plt.subplots(figsize=(size + 1.2, 2.5 + 0.16 * queries))
    image = _draw(axes, matrix.mean(0), m, queries, keys, fontsize=7)
    axes.set(xlabel="attended token (key)", ylabel="attending token (query)", title=title + note)
    figure.colorbar(image, ax=axes, label="attention (square-root scale)", fraction=0.04)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_layer_maps(path: Path, m: StreamMap, title: str, max_tokens: int = 48) -> Path:
    """One heatmap per layer (averaged over heads), in a grid."""
    plt = pyplot()
    matrix, queries, keys, note = _shown(m, max_tokens)
    layers = matrix.shape[0]
    columns = min(layers, 3)
    rows = -(-layers // columns)
    cell = 1.8 + 0.09 * keys
    size = (cell * columns, cell * rows * queries / keys + 1)
    figure, grid = plt.subplots(rows, columns, figsize=size, squeeze=False)
    for layer, axes in enumerate(grid.flat):
        if layer >= layers:
            axes.axis("off")
            continue
        _draw(axes, matrix[layer], m, queries, keys, fontsize=3.5)
        axes.set_title(f"layer {layer + 1}", fontsize=9)
    figure.suptitle(title + note, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return path


def plot_role_matrices(path: Path, summaries: dict[str, StreamSummary], title: str) -> Path:
    """Group-to-group attention (anchor / structural / input) of each subject, averaged over examples."""
    plt = pyplot()
    figure, grid = plt.subplots(1, len(summaries), figsize=(max(3.4 * len(summaries), 6.0), 3.4), squeeze=False)
    for axes, (name, summary) in zip(grid.flat, summaries.items(), strict=True):
        values = torch.tensor([[float("nan") if v is None else v for v in row] for row in summary.role_matrix])
        axes.imshow(values.numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        for row in range(len(GROUPS)):
            for column in range(len(GROUPS)):
                value = values[row, column].item()
                text = "n/a" if value != value else f"{value:.2f}"
                axes.text(column, row, text, ha="center", va="center", color="white" if value < 0.6 else "black")
        axes.set_xticks(range(len(GROUPS)), GROUPS)
        axes.set_yticks(range(len(GROUPS)), GROUPS)
        axes.set(title=name, xlabel="to (keys)", ylabel="from (queries)")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_by_layer(path: Path, summaries: dict[str, StreamSummary], metrics: dict[str, str], title: str) -> Path:
    """One panel per metric: its value per layer, one line per subject."""
    plt = pyplot()
    figure, grid = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.0), squeeze=False)
    for axes, (metric, label) in zip(grid.flat, metrics.items(), strict=True):
        for name, summary in summaries.items():
            values = [float("nan") if v is None else v for v in summary.per_layer[metric]]
            axes.plot(range(1, len(values) + 1), values, marker="o", label=name)
        axes.set(xlabel="layer", title=label, ylim=(0, 1))
        axes.legend(fontsize=7, loc="best")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_instance_tokens(path: Path, scores: dict[int, float], title: str) -> Path:
    """Bar chart of the test score per number k of training-free instance tokens (the paper's Figure 2).

    Example:
        >>> import tempfile
        >>> plot_instance_tokens(Path(tempfile.mkdtemp()) / "k.png", {0: 0.6, 1: 0.62}, "demo").stat().st_size > 0
        True
    """
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(1.2 + 1.0 * len(scores), 3.2))
    ks = list(scores)
    bars = axes.bar([str(k) for k in ks], [100 * scores[k] for k in ks], color="#4c72b0")
    axes.bar_label(bars, fmt="%.2f", fontsize=8)
    low, high = min(scores.values()), max(scores.values())
    axes.set_ylim(max(0.0, 100 * low - 5), 100 * high + 3)
    axes.set(xlabel="instance-aware tokens k", ylabel="test score (%)", title=title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
