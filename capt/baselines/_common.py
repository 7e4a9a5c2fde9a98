"""What the prompt modules share: a soft-prompt table and the pooled input."""

from __future__ import annotations

import torch
from torch import nn

from ..capsule import masked_mean

PROMPT_INIT_STD = 0.02


def prompt_table(*shape: int, device=None) -> nn.Parameter:
    """A float32 soft prompt drawn from N(0, 0.02^2) (left as is on the meta device)."""
    table = nn.Parameter(torch.zeros(shape, device=device, dtype=torch.float32))
    if table.device.type != "meta":
        nn.init.normal_(table, std=PROMPT_INIT_STD)
    return table


def pooled_input(hidden: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The masked mean of the instance tokens of the first layer's input: the methods' sentence representation."""
    return masked_mean(hidden, weights).to(dtype)
