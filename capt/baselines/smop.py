"""SMoP: several short prompts and a top-1 router on the pooled input.

l = W pool(E),  g = softmax(l [+ l * eps, eps ~ N(0, std^2), in training]),  k* = argmax g,  P(x) = g_k* * P_k*

As in the authors' code (jyjohnchoi/SMoP, `peft_models/tuners/prompt_routing.py`): the router has no bias and starts
orthogonal, its perturbation is scaled Gaussian noise, proportional to the (detached) logit, and training adds a
load-balancing loss (`auxiliary_loss`), w * k * sum_j mean_b(g_bj) * f_j, f_j the fraction of the batch routed to j.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import pooled_input, prompt_table
from .options import SMoPOptions


class SMoPPrompt(nn.Module):
    def __init__(self, options: SMoPOptions, num_layers: int, hidden: int, device=None):
        super().__init__()
        self.options = options
        self.prompts = prompt_table(options.num_prompts, options.length, hidden, device=device)
        self.router = nn.Linear(hidden, options.num_prompts, bias=False, device=device)
        if self.router.weight.device.type != "meta":
            nn.init.orthogonal_(self.router.weight)
        self._balance: torch.Tensor | None = None  # the load-balancing loss of the last training pass

    def route(self, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(B, num_prompts) router probabilities; in training the logits get scaled Gaussian noise (router
        perturbation): l + l.detach() * eps, eps ~ N(0, noise_std^2)."""
        logits = self.router(pooled_input(hidden, weights, self.router.weight.dtype))
        if self.training and self.options.noise_std > 0:
            logits = logits + logits.detach() * torch.randn_like(logits) * self.options.noise_std
        return logits.softmax(-1)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        probs = self.route(hidden, weights)
        gate, choice = probs.max(-1)
        self._balance = self._balancing_loss(probs, choice) if self.training else None
        # The chosen prompt scaled by its probability, so the router learns through the gate.
        return (self.prompts[choice] * gate.view(-1, 1, 1)).to(hidden.dtype)

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward pass in training mode, to add to the task loss (None in
        evaluation, or with `balance_weight=0`). `capt.CaptModel.auxiliary_loss` reads it."""
        # The last training pass's loss outlives model.eval(): an evaluation loop must not add it to its loss.
        return self._balance if self.training else None

    def _balancing_loss(self, probs: torch.Tensor, choice: torch.Tensor) -> torch.Tensor | None:
        # Switch-Transformer style: the routed fractions carry no gradient; the mean probabilities do, and they
        # are pushed down where the load is high.
        if self.options.balance_weight == 0:
            return None
        k = self.options.num_prompts
        load = nn.functional.one_hot(choice, k).to(probs.dtype).mean(0)
        return self.options.balance_weight * k * (probs.mean(0) * load).sum()
