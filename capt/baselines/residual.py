"""Residual Prompt Tuning: prompts reparameterised by a shallow MLP with a residual and LayerNorm.

    P' = P + LayerNorm(W_up ReLU(W_down P + b_down) + b_up)

After training the MLP folds away: `fold_residual_prompt(model)` replaces it by the plain prompts P', which give
the same outputs.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ._common import prompt_table
from .options import ResidualPromptOptions, options_dict


class ResidualPrompt(nn.Module):
    def __init__(self, options: ResidualPromptOptions, num_layers: int, hidden: int, device=None):
        super().__init__()
        self.options = options
        self.prompt = prompt_table(options.length, hidden, device=device)
        self.mlp = None
        if options.reparameterize:
            self.mlp = nn.Sequential(
                nn.Linear(hidden, options.bottleneck, device=device),
                nn.ReLU(),
                nn.Linear(options.bottleneck, hidden, device=device),
                nn.LayerNorm(hidden, device=device),
            )

    def prompts(self) -> torch.Tensor:
        """The (m, d) prompt the model sees."""
        return self.prompt if self.mlp is None else self.prompt + self.mlp(self.prompt)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.prompts().unsqueeze(0).expand(hidden.shape[0], -1, -1).to(hidden.dtype)


def fold_residual_prompt(model) -> None:
    """Fold the active adapter's MLP of a `capt.CaptModel` with Residual Prompt Tuning into plain prompts, in place.

    Example:
        >>> model = capt.get_capt_model(base, capt.CaptConfig(prompt_method="residual"))  # doctest: +SKIP
        >>> fold_residual_prompt(model)  # same outputs; only the m x d prompt is left  # doctest: +SKIP
    """
    config = model.capt_config
    module = model.capsules
    if config.prompt_method != "residual" or not isinstance(module, ResidualPrompt):
        raise ValueError(f"fold_residual_prompt needs a Residual Prompt Tuning adapter, got {config.prompt_method!r}")
    folded_options = replace(module.options, reparameterize=False)
    folded = ResidualPrompt(folded_options, 0, module.prompt.shape[-1], device=module.prompt.device)
    with torch.no_grad():
        folded.prompt.copy_(module.prompts())
    folded.prompt.requires_grad_(module.prompt.requires_grad)
    model.capsules = folded
    model.adapter_configs[model.active_adapter] = replace(config, prompt_options=options_dict(folded_options))
