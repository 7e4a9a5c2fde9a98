"""Serving many tasks from one frozen model: a capsule bank.

A task costs its capsules (capsule layers x hidden floats) plus its trained head, if it has one; the frozen
backbone is shared. `CaptModel.load_adapter` / `set_adapter` and `adapter_names=[...]` (one adapter per row, on
`forward` and `generate`) are the primitives; `load_bank` is what a command line or a server calls.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

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
    if not isinstance(adapters, Mapping):
        raise TypeError(f"adapters must map names to adapter folders, e.g. {{'rte': 'adapters/rte'}}; got {adapters!r}")
    if not adapters:
        raise ValueError("load_bank needs at least one adapter")
    (first_name, first_path), *others = adapters.items()
    bank = CaptModel.from_pretrained(base_model, first_path, adapter_name=first_name)
    try:
        for name, path in others:
            bank.load_adapter(path, adapter_name=name)
    except BaseException:
        bank.unload()  # leave the base model as it came, so that a corrected retry can attach
        raise
    return bank
