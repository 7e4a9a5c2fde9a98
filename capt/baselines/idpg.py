"""IDPG / M-IDPG: a bottleneck generator maps the sentence representation to the prompt tokens.

    P_l(x) = W_up GELU(W_down s(x) + b_down) + b_l,   s(x) = masked mean of the input embeddings

One generator (W_down, b_down, W_up) serves every layer; each prompted layer l has its own bias b_l (m x d). IDPG
prompts the input layer only (one bias); M-IDPG every layer, the authors' `--middle-prompt-mode layerb`
(CSerxy/IDPG, `fairseq/modules/transformer_sentence_encoder.py`). All layers read the same s(x), from layer 0.
With `phm=n`, W_down and W_up are PHM matrices, sum_i kron(S_i, W_i) (the paper's PHM generator).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import pooled_input
from .options import IDPGOptions

PHM_INIT_STD = 0.05  # the authors' init of every PHM factor


class PHMLinear(nn.Module):
    """x W (+ b) with W = sum_i kron(rules_i, factors_i): `terms` n x n rules and n (in / n) x (out / n) factors."""

    def __init__(self, inputs: int, outputs: int, terms: int, bias: bool, device=None):
        super().__init__()
        self.rules = nn.Parameter(torch.zeros(terms, terms, terms, device=device))
        self.factors = nn.Parameter(torch.zeros(terms, inputs // terms, outputs // terms, device=device))
        self.bias = nn.Parameter(torch.zeros(outputs, device=device)) if bias else None
        if self.rules.device.type != "meta":
            nn.init.normal_(self.rules, std=PHM_INIT_STD)
            nn.init.normal_(self.factors, std=PHM_INIT_STD)

    @property
    def matrix(self) -> torch.Tensor:
        """The (inputs, outputs) matrix: entry (a p + i, b q + j) is sum_k rules[k, a, b] factors[k, i, j]."""
        n, p, q = self.factors.shape
        return torch.einsum("kab,kij->aibj", self.rules, self.factors).reshape(n * p, n * q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.matrix
        return out if self.bias is None else out + self.bias


class IDPGPrompt(nn.Module):
    def __init__(self, options: IDPGOptions, num_layers: int, hidden: int, device=None):
        super().__init__()
        options.check_width(hidden)
        self.options = options
        width, out = options.bottleneck, options.length * hidden
        if options.phm:
            self.down = PHMLinear(hidden, width, options.phm, bias=True, device=device)
            self.up = PHMLinear(width, out, options.phm, bias=False, device=device)
        else:
            self.down = nn.Linear(hidden, width, device=device)
            self.up = nn.Linear(width, out, bias=False, device=device)
        layers = num_layers if options.every_layer else 1
        self.layer_bias = nn.Parameter(torch.zeros(layers, options.length, hidden, device=device))
        self._generated: torch.Tensor | None = None  # W_up GELU(...) of the current pass, set at layer 0

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if layer == 0:  # the generator runs once per pass; deeper layers add their bias to its output
            features = nn.functional.gelu(self.down(pooled_input(hidden, weights, self.layer_bias.dtype)))
            self._generated = self.up(features).view(hidden.shape[0], self.options.length, -1)
        return (self._generated + self.layer_bias[layer if self.options.every_layer else 0]).to(hidden.dtype)
