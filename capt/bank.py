"""Serving many tasks from one frozen model: a capsule bank, and predictions for batches that mix tasks.

A task costs its capsules (capsule layers x hidden floats) plus its trained head, if it has one; the frozen
backbone is shared. `CaptModel.load_adapter` / `set_adapter` and `adapter_names=[...]` are the primitives;
these helpers are what a command line or a server calls.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from .model import CaptModel


def load_bank(base_model: PreTrainedModel, adapters: Mapping[str, str | os.PathLike]) -> CaptModel:
    """Attach saved adapters (task name -> adapter folder) to one frozen model; the first one is active.

    Raises ValueError if an adapter does not fit the model or the others (slot count, capsule layers, heads).

    Example:
        >>> bank = load_bank(base, {"rte": "adapters/rte", "boolq": "adapters/boolq"})  # doctest: +SKIP
        >>> list(bank.adapter_configs)  # doctest: +SKIP
        ['rte', 'boolq']
    """
    if not adapters:
        raise ValueError("load_bank needs at least one adapter")
    (first_name, first_path), *others = adapters.items()
    bank = CaptModel.from_pretrained(base_model, first_path, adapter_name=first_name)
    for name, path in others:
        bank.load_adapter(path, adapter_name=name)
    return bank


@torch.no_grad()
def predict_mixed(
    bank: CaptModel, inputs: Mapping[str, torch.Tensor], adapter_names: Sequence[str], **generate_kwargs
) -> torch.Tensor:
    """Predictions for a batch whose rows belong to different tasks (`adapter_names`, one per row).

    Models that generate (T5, decoder-only) return `generate`'s token ids (decoder-only prompts left-padded);
    classifiers return the predicted class per row (per token for token classification).

    Example:
        >>> ids = predict_mixed(bank, tokenizer(texts, return_tensors="pt", padding=True),  # doctest: +SKIP
        ...                     ["rte", "boolq"], max_new_tokens=3)
    """
    if bank.family == "encoder":
        return bank(**inputs, adapter_names=adapter_names).logits.argmax(-1)
    return bank.generate(**inputs, adapter_names=adapter_names, **generate_kwargs)
