"""LoPA: an instance-specific soft prompt, a task-shared part gated by a low-rank instance part.

Z(x) = Z_S * sigmoid(u(x) v(x)),   f = tanh(W pool(E) + b),  u(x) = U f (m x r),  v(x) = V f (r x d)
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
        self.encoder = nn.Linear(hidden, options.encoder_hidden, device=device)
        self.u = nn.Linear(options.encoder_hidden, options.length * options.rank, device=device)
        self.v = nn.Linear(options.encoder_hidden, options.rank * hidden, device=device)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        o = self.options
        features = torch.tanh(self.encoder(pooled_input(hidden, weights, self.encoder.weight.dtype)))
        u = self.u(features).view(-1, o.length, o.rank)
        v = self.v(features).view(-1, o.rank, hidden.shape[-1])
        return (self.shared * torch.sigmoid(u @ v)).to(hidden.dtype)
