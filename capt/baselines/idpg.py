"""IDPG / M-IDPG: a bottleneck generator maps the sentence representation to the prompt tokens.

    P_l(x) = W_up GELU(W_down s(x) + b_down) + b_l,   s(x) = masked mean of the input embeddings

One generator (W_down, b_down, W_up) serves every layer; each prompted layer l has its own bias b_l (m x d). IDPG
prompts the input layer only (one bias); M-IDPG every layer, the authors' `--middle-prompt-mode layerb`
(CSerxy/IDPG, `fairseq/modules/transformer_sentence_encoder.py`). All layers read the same s(x), from layer 0.
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
        self.up = nn.Linear(options.bottleneck, options.length * hidden, bias=False, device=device)
        layers = num_layers if options.every_layer else 1
        self.layer_bias = nn.Parameter(torch.zeros(layers, options.length, hidden, device=device))
        self._generated: torch.Tensor | None = None  # W_up GELU(...) of the current pass, set at layer 0

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if layer == 0:  # the generator runs once per pass; deeper layers add their bias to its output
            features = nn.functional.gelu(self.down(pooled_input(hidden, weights, self.down.weight.dtype)))
            self._generated = self.up(features).view(hidden.shape[0], self.options.length, -1)
        return (self._generated + self.layer_bias[layer if self.options.every_layer else 0]).to(hidden.dtype)
