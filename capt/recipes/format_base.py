"""What every task format shares: the base class, the feature type, and the helpers that both the label formats
(`capt.recipes.formats`) and the chat format (`capt.recipes.chat`) score with. A module of its own so that the
formats can choose the chat format for a generate task without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from .data import Example
from .tasks import get_task
from .tasks.spec import TaskSpec

Features = dict[str, Any]


@dataclass
class TaskFormat:
    """Base: tokenisation limits and the label-id convention shared by all families."""

    task: str
    tokenizer: PreTrainedTokenizerBase
    max_length: int

    @property
    def spec(self) -> TaskSpec:
        """The task's spec (built-in, or a registered user task)."""
        return get_task(self.task)

    def encode(self, example: Example) -> Features:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """(examples, options) scores of every option of every example; missing options are -inf."""
        raise NotImplementedError

    def predict(self, model: nn.Module, batch: dict[str, Any]) -> list[int]:
        """The best option's index per example."""
        return self.scores(model, batch).argmax(-1).tolist()

    def collate(self, features: list[Features]) -> dict[str, Any]:
        raise NotImplementedError

    def cache_settings(self) -> dict[str, Any]:
        """Settings besides the task's name, tokenizer, family and max length that change `encode`'s output; they
        enter the key of the feature cache (`capt.recipes.evaluate.encode_cached`). Here: the task's spec (its
        templates and labels: a user task may change them under one name)."""
        return {"spec": self.spec.to_dict()}

    @staticmethod
    def length(features: Features) -> int:
        """Tokens in an encoded example, for length-grouped batching."""
        return features["length"]

    def _pad(self, rows: list[list[int]], value: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def has_capsules(model: nn.Module | partial) -> bool:
    """Whether capsule hooks sit on `model` (CaptModel, the bank, or CaPT through PEFT): it takes `instance_mask`.

    `model` may be a `functools.partial` of one (a bank called with its per-row `adapter_names`)."""
    module = model.func if isinstance(model, partial) else model
    return any(getattr(m, "_capt_attached", False) for m in module.modules())


def target_logprobs(logits: torch.Tensor, labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    """Summed log-probability of the labelled tokens of each row; (R, K, V), (R, T) -> (R,).

    The logits cover the last K positions of the labels' T: prompt methods prepend virtual tokens (K > T: only the
    last T are read), and `logits_to_keep` leaves only the trailing positions (K < T: labels without a logit must
    be -100).

    Example:
        >>> logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))
        >>> target_logprobs(logits, torch.tensor([[-100, 1]]), shifted=True).exp()
        tensor([0.5000])
    """
    width = min(logits.shape[1], labels.shape[1])
    logits, labels = logits[:, -width:], labels[:, -width:]
    if shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.float()
    # log_softmax at the picked tokens only: no second (R, K, V) tensor.
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return (picked * (labels != -100)).sum(-1)


def to_device(value: Any, device) -> Any:
    """Move the tensors of a (nested) batch to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
