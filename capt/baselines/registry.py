"""Builds the slot module of a prompt method (what `CaptModel` calls instead of `Capsules`)."""

from __future__ import annotations

import torch
from torch import nn

from ..capsule import FALLBACK_NORM_EPS, Capsules
from .dept import DePTPrompt
from .idpg import IDPGPrompt
from .lopa import LoPAPrompt
from .options import make_options
from .residual import ResidualPrompt
from .smop import SMoPPrompt
from .vfpt import VFPTPrompt

PROMPT_MODULES = {
    "dept": DePTPrompt,
    "lopa": LoPAPrompt,
    "idpg": IDPGPrompt,
    "m-idpg": IDPGPrompt,
    "smop": SMoPPrompt,
    "residual": ResidualPrompt,
    "vfpt": VFPTPrompt,
}


def build_prompt_module(method: str, options: dict, num_layers: int, hidden: int, device=None) -> nn.Module:
    """The slot module of `method`: `module(layer, hidden, weights)` -> (B, num_tokens, d)."""
    return PROMPT_MODULES[method](make_options(method, options), num_layers, hidden, device=device)


def build_slot_module(
    config, num_layers: int, hidden: int, device=None, norm_eps: float = FALLBACK_NORM_EPS
) -> nn.Module:
    """The slot module of a `CaptConfig`: the prompt module of `config.prompt_method`, else the capsules (`norm_eps`:
    the backbone's RMSNorm eps, for `mean_norm="rms"`)."""
    if config.prompt_method is not None:
        return build_prompt_module(config.prompt_method, config.prompt_options, num_layers, hidden, device=device)
    return Capsules(config, num_layers, hidden, device=device, norm_eps=norm_eps)


def auxiliary_loss(module: nn.Module) -> torch.Tensor | None:
    """`module.auxiliary_loss()` where it has one, else None: a slot module's loss of the last training pass (SMoP's
    load balancing; None in evaluation). `CaptModel` and the PEFT tuner answer `auxiliary_loss()` with their slot
    module's, and the training recipe asks the model it trains."""
    hook = getattr(module, "auxiliary_loss", None)
    return hook() if hook is not None else None
