"""LoPA: an instance-specific soft prompt, a task-shared part gated by a low-rank instance part.

Z(x) = Z_S * sigmoid(u(x) v(x)),   u(x) = U tanh(W_u pool(E) + b_u) (m x r),   v(x) = V tanh(W_v pool(E) + b_v) (r x d)

Two separate heads, as in the authors' `LatentPromptAttentionGenerator` (jabhinav/Prompt-Tuning-Strikes-Back-with-LOPA).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import pooled_input, prompt_table
from .options import LoPAOptions


class LoPAPrompt(nn.Module):
    def __init__(self, options: LoPAOptions, num_layers: int, hidden: int, device=None):
        super().__init__()
        self.options = options
        self.shared = prompt_table(options.length, hidden, device=device)
        self.u = _head(hidden, options.encoder_hidden, options.length * options.rank, device)
        self.v = _head(hidden, options.encoder_hidden, options.rank * hidden, device)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        o = self.options
        pooled = pooled_input(hidden, weights, self.shared.dtype)
        u = self.u(pooled).view(-1, o.length, o.rank)
        v = self.v(pooled).view(-1, o.rank, hidden.shape[-1])
        return (self.shared * torch.sigmoid(u @ v)).to(hidden.dtype)


def _head(hidden: int, width: int, out: int, device) -> nn.Sequential:
    """d -> width (tanh) -> out: one of LoPA's two heads."""
    return nn.Sequential(nn.Linear(hidden, width, device=device), nn.Tanh(), nn.Linear(width, out, device=device))
