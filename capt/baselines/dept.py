"""DePT: a shorter soft prompt plus a low-rank update of the first input token embeddings.

E'_t = E_t + (alpha / sqrt(r)) (A B)_t   for token positions t < s   (A: s x r, B: r x d; positions count from the
first real token)

As in the authors' code (ZhengxiangShi/DePT, `peft/tuners/prompt_tuning_lora.py` and `peft/peft_model.py`): the
update is scaled by lora_alpha / sqrt(r) (alpha 8), A starts Kaiming-uniform and B at zero.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._common import prompt_table
from .options import DePTOptions


class DePTPrompt(nn.Module):
    """Slots: the prompt P (m x d). `token_offsets` gives the low-rank update; A and B sit in `secondary`, the
    parameters DePT trains with their own learning rate. B starts at zero, so the untrained update is zero."""

    def __init__(self, options: DePTOptions, num_layers: int, hidden: int, device=None):
        super().__init__()
        self.options = options
        self.prompt = prompt_table(options.length, hidden, device=device)
        self.secondary = nn.ParameterDict(
            {
                "a": nn.Parameter(torch.zeros(options.positions, options.rank, device=device)),
                "b": nn.Parameter(torch.zeros(options.rank, hidden, device=device)),
            }
        )
        if self.secondary["a"].device.type != "meta":
            nn.init.kaiming_uniform_(self.secondary["a"], a=math.sqrt(5))  # the authors' (and LoRA's) init of A
        self.scaling = options.alpha / math.sqrt(options.rank)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.prompt.unsqueeze(0).expand(hidden.shape[0], -1, -1).to(hidden.dtype)

    def token_offsets(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) token positions (-1 for padding) -> (B, T, d) additions to the token embeddings."""
        update = self.scaling * (self.secondary["a"] @ self.secondary["b"])  # (s, d)
        inside = (positions >= 0) & (positions < self.options.positions)
        rows = update[positions.clamp(0, self.options.positions - 1)]
        return rows * inside.unsqueeze(-1).to(rows.dtype)
