"""Optimizer parameter groups for an adapted model: its capsules, its trained task heads and DePT's low-rank pair
each take their own learning rate (the `capt train` command's `--lr`, `--head-lr`, `--lr-secondary`).

One rule serves `CaptModel`, CaPT through PEFT and PEFT's own methods. A head is every module the adapter trains
whole (`modules_to_save`: the fresh task head, or any module the user names, such as `pooler.dense` or `lm_head`),
plus a bare fresh head that a method trains in place (one of `capt.heads.HEAD_NAMES`). PEFT's copies carry
`modules_to_save` in their parameter names (`base_model.model.classifier.modules_to_save.default.weight`);
`CaptModel` installs its copies where the originals were, so they are found through its `TaskHeads`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .heads import HEAD_NAMES, TaskHeads

# The module under which DePT keeps its low-rank pair (capt.baselines).
SECONDARY_NAME = "secondary"


def is_head(name: str) -> bool:
    """Whether a parameter name belongs to a task head: a copy PEFT trains (`modules_to_save` in its path) or a fresh
    head trained in place (one of `capt.heads.HEAD_NAMES` in its path)."""
    parts = name.split(".")
    return "modules_to_save" in parts or any(part in HEAD_NAMES for part in parts)


def _capt_head_parameters(model: nn.Module) -> set[int]:
    """The ids of the parameters of every head copy a `CaptModel` trains (installed, or stored for another adapter),
    whatever the module is called: `CaptModel` puts its copies where the originals were, under their own names."""
    heads = (module for module in model.modules() if isinstance(module, TaskHeads))
    return {id(param) for module in heads for param in module.trained_parameters()}


def is_secondary(name: str) -> bool:
    """Whether a parameter name belongs to DePT's low-rank pair."""
    return SECONDARY_NAME in name.split(".")


def param_groups(
    model: nn.Module, lr: float, head_lr: float | None = None, secondary_lr: float | None = None
) -> list[dict[str, Any]]:
    """The trainable parameters of `model` as optimizer groups: the capsules (and any other adapter weights) at
    `lr`, the task heads and every other module trained whole (`modules_to_save`) at `head_lr`, DePT's low-rank pair
    at `secondary_lr` (each None: `lr`). Parameters that share a rate share a group; frozen ones are left out.

    Example:
        >>> import capt, torch
        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> base = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=4, intermediate_size=64, num_labels=2))
        >>> model = capt.get_capt_model(base)
        >>> groups = capt.param_groups(model, lr=3e-2, head_lr=1e-3)
        >>> [(g["lr"], len(g["params"])) for g in groups]  # capsules; the classifier's weight and bias
        [(0.03, 1), (0.001, 2)]
        >>> optimizer = torch.optim.AdamW(groups)  # for transformers.Trainer: optimizers=(optimizer, None)
    """
    head_lr, secondary_lr = (lr if rate is None else rate for rate in (head_lr, secondary_lr))
    rates: dict[float, list[nn.Parameter]] = {rate: [] for rate in (lr, secondary_lr, head_lr)}  # groups in order
    capt_heads = _capt_head_parameters(model)
    for name, param in model.named_parameters():
        if param.requires_grad:
            head = is_head(name) or id(param) in capt_heads
            rates[head_lr if head else secondary_lr if is_secondary(name) else lr].append(param)
    return [{"params": params, "lr": rate} for rate, params in rates.items() if params]
