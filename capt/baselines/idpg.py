"""IDPG / M-IDPG: a bottleneck generator maps the sentence representation to the prompt tokens.

    P(x) = W_up ReLU(W_down s(x) + b_down) + b_up,   s(x) = masked mean of the input embeddings

M-IDPG has one output projection per layer; all layers read the same s(x), taken at the first layer.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import pooled_input
from .options import IDPGOptions


class IDPGPrompt(nn.Module):
    def __init__(self, options: IDPGOptions, num_layers: int, hidden: int, device=None):
        super().__init__()
        self.options = options
        self.down = nn.Linear(hidden, options.bottleneck, device=device)
        outputs = num_layers if options.every_layer else 1
        self.up = nn.ModuleList(
            nn.Linear(options.bottleneck, options.length * hidden, device=device) for _ in range(outputs)
        )
        self._features: torch.Tensor | None = None  # ReLU(W_down s(x)) of the current pass, set at layer 0

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            self._features = torch.relu(self.down(pooled_input(hidden, weights, self.down.weight.dtype)))
        up = self.up[layer if self.options.every_layer else 0]
        return up(self._features).view(hidden.shape[0], self.options.length, -1).to(hidden.dtype)
