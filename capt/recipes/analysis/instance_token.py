"""`capt analyze instance-token`: the paper's Finding II on a prompt-tuned model.

Prepend k training-free instance-aware tokens to a trained Deep Prompt-Tuning model (m learned slots per
layer) and score it again, with no training. An instance-aware token is an untrained CaPT capsule with p = 0:
at every layer it holds the masked mean of that layer's input, over the instance tokens at the first layer and
over the instance tokens and all slot outputs of the previous layer after that (the same weights CaPT uses).

How: the model runs as a CaPT model with m + k slots per layer. `CapsuleInjector` (the hooks behind
`CaptModel`) takes its capsules from an owner; during the study the owner is a small wrapper whose first k
slots are the mean and whose last m are the adapter's learned prompts, untouched. The k tokens sit at position
0 onward, in front of the prompts, where CaPT puts its capsule. With k = 0 the wrapper writes exactly the
learned prompts, so the score equals the plain evaluation bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...capsule import Capsules, masked_mean
from ...config import CaptConfig
from ...injector import CapsuleInjector
from ...model import CaptModel
from ..data import Example
from ..evaluate import evaluate
from ..formats import TaskFormat


class InstanceTokenCapsules(torch.nn.Module):
    """`learned`'s slots behind k instance-aware tokens (the masked mean of the layer input, no parameters)."""

    def __init__(self, learned: Capsules, k: int):
        super().__init__()
        self.learned = learned
        self.k = k

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(B, k + learned slots, d): what `CapsuleInjector` writes at the front of layer `layer`'s input."""
        learned = self.learned(layer, hidden, weights)
        mean = masked_mean(hidden, weights).unsqueeze(1).expand(-1, self.k, -1)
        return torch.cat([mean.to(learned.dtype), learned], dim=1)


@dataclass
class _Owner:
    """The `CapsuleOwner` the injector asks for capsules: the wrapper, whatever the row's adapter name."""

    active_adapter: str
    capsules: InstanceTokenCapsules

    def capsules_for(self, adapter_name: str) -> InstanceTokenCapsules:
        return self.capsules


@contextmanager
def instance_tokens(model: CaptModel, k: int) -> Iterator[CaptModel]:
    """Inside the block, `model` (a Deep Prompt-Tuning or CaPT model) runs with k instance-aware tokens in front
    of its learned slots.

    The model's own hooks are detached meanwhile and attached afresh on exit (trained heads stay in place).

    Example:
        >>> import torch, capt
        >>> from capt.recipes.backbones import load_backbone
        >>> model = capt.get_capt_model(load_backbone("tiny-llama").model,
        ...                             capt.CaptConfig(num_slots=3, instance_aware=False))
        >>> ids = torch.tensor([[5, 6, 7]])
        >>> plain = model(input_ids=ids).logits
        >>> with instance_tokens(model, 0):
        ...     torch.equal(model(input_ids=ids).logits, plain)
        True
        >>> with instance_tokens(model, 2):
        ...     torch.equal(model(input_ids=ids).logits, plain)
        False
    """
    if len(model.adapter_configs) > 1:
        raise ValueError("instance tokens need a model with one adapter loaded")
    config = model.capt_config
    layout = CaptConfig(
        num_slots=model.num_slots + k, instance_aware=False, target=config.target, layers_path=config.layers_path
    )
    model.injector.detach()
    try:
        owner = _Owner(model.active_adapter, InstanceTokenCapsules(model.capsules, k))
        injector = CapsuleInjector(model.base_model, layout, owner=owner)
        try:
            yield model
        finally:
            injector.detach()
    finally:
        model.injector = CapsuleInjector(model.base_model, config, owner=model)


def instance_token_scores(
    model: CaptModel,
    fmt: TaskFormat,
    features: list[dict],
    examples: list[Example],
    ks: list[int],
    batch_size: int = 32,
) -> dict[int, dict[str, float]]:
    """The task metrics with k instance tokens, for every k in `ks` (k = 0: the plain model).

    Example:
        >>> config, model, fmt = load_run("runs/rte-deep-prompt")  # doctest: +SKIP
        >>> examples = load_splits(config)["test"]  # doctest: +SKIP
        >>> features = encode_cached(fmt, examples, config)  # doctest: +SKIP
        >>> scores = instance_token_scores(model, fmt, features, examples, [0, 1])  # doctest: +SKIP
        >>> scores[1]["score"] - scores[0]["score"]  # what one instance token changes  # doctest: +SKIP
    """
    scores = {}
    for k in ks:
        with instance_tokens(model, k):
            scores[k] = evaluate(model, fmt, features, examples, batch_size)
    return scores
