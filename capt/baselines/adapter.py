"""Bottleneck adapters (Houlsby et al., 2019) on module hooks: h + up(GELU(down(h))) after every attention and
feed-forward sublayer, before its residual sum. As in the authors' code (google-research/adapter-bert,
`optimization.py`: the "adapters", "layer_norm" and "head" collections train), the model's layer norms train too.

The `adapters` library (AdapterHub) would be the well-kept choice, but its latest release (1.3.0) pins
transformers ~= 4.57, and this project runs transformers 5.x; PEFT has no Houlsby adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from .options import AdapterOptions

# The output projection of each sublayer, per architecture: attention first, then the feed-forward block.
SUBLAYER_OUTPUTS = (
    ("attention.output.dense", "output.dense"),  # BERT, RoBERTa
    ("self_attn.o_proj", "mlp.down_proj"),  # Llama, Qwen2, Mistral
    ("attn.c_proj", "mlp.c_proj"),  # GPT-2
    ("layer.0.SelfAttention.o", "layer.1.DenseReluDense.wo"),  # T5 encoder block
    ("layer.0.SelfAttention.o", "layer.1.EncDecAttention.o", "layer.2.DenseReluDense.wo"),  # T5 decoder block
)


# How the norm classes of the supported families are named (nn.LayerNorm subclasses aside): LlamaRMSNorm, T5LayerNorm.
NORM_SUFFIXES = ("LayerNorm", "RMSNorm")


class BottleneckAdapter(nn.Module):
    """down (d -> b), GELU, up (b -> d), added to its input; up starts at zero (the identity)."""

    def __init__(self, hidden: int, bottleneck: int, device=None):
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck, device=device)
        self.up = nn.Linear(bottleneck, hidden, device=device)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        update = self.up(nn.functional.gelu(self.down(hidden.to(self.down.weight.dtype))))
        return hidden + update.to(hidden.dtype)


def add_adapters(layers: nn.ModuleList, hidden: int, options: AdapterOptions) -> list[BottleneckAdapter]:
    """Attach an adapter after each sublayer output projection of every layer in `layers`; returns them.

    Each adapter is registered as the child `adapter` of the projection it follows (so it is saved and counted with
    the model) and runs from a forward hook on that projection.

    Example:
        >>> adapters = add_adapters(model.model.layers, 576, AdapterOptions())  # doctest: +SKIP
    """
    added = []
    for layer in layers:
        names = next((names for names in SUBLAYER_OUTPUTS if all(_has(layer, n) for n in names)), None)
        if names is None:
            raise ValueError(
                f"bottleneck adapters: no known sublayer outputs in {type(layer).__name__}; "
                f"known: {', '.join(' + '.join(n) for n in SUBLAYER_OUTPUTS)}"
            )
        device = next(layer.parameters()).device
        for name in names:
            projection = layer.get_submodule(name)
            projection.adapter = BottleneckAdapter(hidden, options.bottleneck, device=device)
            projection.register_forward_hook(_run_adapter)
            added.append(projection.adapter)
    return added


def train_layer_norms(model: nn.Module) -> list[nn.Parameter]:
    """Make the parameters of every layer norm in `model` (LayerNorm, RMSNorm, T5LayerNorm) trainable; returns them.

    Example:
        >>> norms = train_layer_norms(model)  # doctest: +SKIP
    """
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm) or type(m).__name__.endswith(NORM_SUFFIXES)]
    params = [p for norm in norms for p in norm.parameters(recurse=False)]
    for param in params:
        param.requires_grad_(True)
    return params


def _run_adapter(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return module.adapter(output)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
