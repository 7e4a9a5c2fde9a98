"""VFPT (Visual Fourier Prompt Tuning): deep prompts, part of each layer's table seen through a 2D Fourier transform.

    P_l' = [Re(FFT_seq(FFT_hidden(P_l[:k]))) ; P_l[k:]],   k = floor(fourier_fraction x m)

The transform has no parameters: it changes what the trained vectors look like to the model (each Fourier prompt
mixes every entry of the k x d block), not how many there are.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import prompt_table
from .options import VFPTOptions


class VFPTPrompt(nn.Module):
    def __init__(self, options: VFPTOptions, num_layers: int, hidden: int, device=None):
        super().__init__()
        self.options = options
        self.prompts = prompt_table(num_layers if options.every_layer else 1, options.length, hidden, device=device)

    def layer_prompts(self, layer: int) -> torch.Tensor:
        """The (m, d) prompts layer `layer` sees."""
        table = self.prompts[layer if self.options.every_layer else 0]
        k = self.options.fourier_tokens
        if k == 0:
            return table
        return torch.cat([torch.fft.fft2(table[:k]).real, table[k:]])  # both axes at once: the 2D DFT is separable

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.layer_prompts(layer).unsqueeze(0).expand(hidden.shape[0], -1, -1).to(hidden.dtype)
