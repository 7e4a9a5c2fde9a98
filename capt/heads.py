"""Task heads trained with the capsules (`modules_to_save`): which ones, and one copy per adapter.

A classification model's fresh head (`classifier`, `score`) must learn with the capsules. Each adapter gets its
own trainable copy. The active adapter's copies sit in the base model where the originals were, so the model runs
unchanged; the originals wait in `TaskHeads.original` (put back by `disable_adapter` and `unload`), the other
adapters' copies in `TaskHeads.stored`. In a batch that mixes adapters, the installed head recomputes the rows of
other adapters with their own copies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from .injector import group_rows, run_by_rows

# The fresh task heads transformers gives its models: BERT-style `classifier`, decoder `score`, DistilBERT's
# `pre_classifier` (a randomly initialised layer before its `classifier`), question answering's `qa_outputs`.
HEAD_NAMES = ("classifier", "score", "pre_classifier", "qa_outputs")
HEAD_MODEL_SUFFIXES = ("ForSequenceClassification", "ForMultipleChoice", "ForTokenClassification")


def resolve_head_names(model: PreTrainedModel, requested: Sequence[str] | None) -> list[str]:
    """The submodules trained and saved with the capsules: `requested`, or the fresh task head of a classifier.

    A requested name selects every module whose dotted name ends with it, PEFT's rule for `modules_to_save`, so
    both APIs train and save the same modules (PEFT's 'classifier' also selects DistilBERT's 'pre_classifier').
    PEFT adds the usual head names ('classifier', 'score' and, from PEFT 0.22, 'pre_classifier') to every
    classifier's config, so a missing usual head name is skipped; any other missing name is an error.
    """
    if requested is None:
        is_head_model = type(model).__name__.endswith(HEAD_MODEL_SUFFIXES)
        requested = [name for name in HEAD_NAMES if is_head_model and hasattr(model, name)]
    module_names = [name for name, _ in model.named_modules() if name]
    selected = set()
    for name in requested:
        matches = {module for module in module_names if module.endswith(name)}
        if not matches and name not in HEAD_NAMES:
            raise ValueError(f"CaptConfig.modules_to_save names {name!r}, which {type(model).__name__} does not have")
        selected |= matches
    # A module inside a selected one is trained and saved with it already.
    inner = {name for name in selected if any(name.startswith(f"{outer}.") for outer in selected)}
    # In the model's order, so that equal selections compare equal.
    return [name for name in module_names if name in selected - inner]


class TaskHeads(nn.Module):
    """The trained head copies of every adapter on one base model.

    `row_adapters()` returns the adapter of each example during a pass that mixes adapters (else None).
    """

    def __init__(
        self, base_model: PreTrainedModel, names: list[str], row_adapters: Callable[[], list[str] | None]
    ) -> None:
        super().__init__()
        self._base = [base_model]  # a list, so the base model is not registered (and saved) twice
        self._row_adapters = row_adapters
        self.names = names
        self.original = nn.ModuleDict({_key(name): base_model.get_submodule(name) for name in names})
        self.stored = nn.ModuleDict()  # adapter name -> its copies, for the loaded adapters that are not active

    @property
    def base_model(self) -> PreTrainedModel:
        return self._base[0]

    def install_new(self) -> None:
        """Install fresh trainable copies for the first (active) adapter."""
        for name in self.names:
            _set_submodule(self.base_model, name, self._trained_copy(name))

    def add(self, adapter_name: str) -> None:
        """Fresh trainable copies for an adapter that is not active."""
        self.stored[adapter_name] = nn.ModuleDict({_key(name): self._trained_copy(name) for name in self.names})

    def installed(self) -> dict[str, nn.Module]:
        """The active adapter's heads, by dotted name."""
        return {name: self.base_model.get_submodule(name) for name in self.names}

    def trained_parameters(self) -> list[nn.Parameter]:
        """The parameters of every adapter's head copies: the active adapter's, installed in the model under the
        original modules' names, and the stored ones of the others."""
        installed = [param for head in self.installed().values() for param in head.parameters()]
        return [*installed, *self.stored.parameters()]

    def of(self, adapter_name: str, active: bool) -> dict[str, nn.Module]:
        """An adapter's heads, by dotted name."""
        if active:
            return self.installed()
        return {_name(key): head for key, head in self.stored[adapter_name].items()}

    def activate(self, incoming: str, outgoing: str) -> None:
        """Install `incoming`'s heads and store those of the adapter that was active."""
        installed = nn.ModuleDict({_key(name): head for name, head in self.installed().items()})
        for key, head in self.stored[incoming].items():
            _set_submodule(self.base_model, _name(key), head)
        del self.stored[incoming]
        self.stored[outgoing] = installed

    def remove(self, adapter_name: str) -> None:
        del self.stored[adapter_name]

    def swap_original(self) -> None:
        """Exchange the installed heads with the originals (twice restores the state)."""
        for key in list(self.original):
            current = self.base_model.get_submodule(_name(key))
            _set_submodule(self.base_model, _name(key), self.original[key])
            self.original[key] = current

    def _trained_copy(self, name: str) -> nn.Module:
        """A trainable copy of the original head `name`, which answers for every adapter in a mixed batch."""
        head = copy.deepcopy(self.original[_key(name)]).requires_grad_(True)
        head.register_forward_hook(partial(self._mixed_batch_head, name))
        return head

    def _mixed_batch_head(self, name: str, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """On the installed head, recompute the rows of other adapters with their own heads."""
        row_adapters = self._row_adapters()
        if row_adapters is None or module is not self.base_model.get_submodule(name):
            return output
        groups = group_rows(row_adapters, args[0].shape[0], output.device)

        def head_output(adapter: str, rows) -> torch.Tensor:
            if adapter not in self.stored:  # the active adapter: its head is the installed one
                return output[rows]
            return self.stored[adapter][_key(name)](args[0][rows], *args[1:])

        return run_by_rows(groups, head_output)


def _key(name: str) -> str:
    """ModuleDict keys cannot hold dots."""
    return name.replace(".", "__")


def _name(key: str) -> str:
    return key.replace("__", ".")


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)
