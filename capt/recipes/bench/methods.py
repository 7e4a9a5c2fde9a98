"""The methods `capt bench` measures: labelled settings of the recipes' one method registry, plus the floor.

`floor` is not a method but the lower bound of every input-side method: the frozen base model, forward and
backward on the same N+1 tokens, with gradients only to the input embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from ...config import VARIANTS
from ..backbones import Backbone
from ..methods import PROMPT_METHODS, MethodOptions, apply_method, extra_positions

PROMPT_STYLE = ("deep-prompt", "prompt", "ptv2", *PROMPT_METHODS)


@dataclass(frozen=True)
class Method:
    """One benchmarked method: a label, the registry's method name (None for the floor) and its options."""

    name: str
    method: str | None
    options: MethodOptions = field(default_factory=MethodOptions)

    @property
    def extra_positions(self) -> int:
        """Sequence positions the method puts in front of the user's tokens (the floor: the capsule's one)."""
        return 1 if self.method is None else extra_positions(self.method, self.options)

    @property
    def prompt_style(self) -> bool:
        """A peer that `capt` must beat on time and memory."""
        return self.method in PROMPT_STYLE


METHODS = {
    m.name: m
    for m in (
        Method("floor", None),
        *(Method(f"capt-{v}", "capt", MethodOptions(variant=v)) for v in VARIANTS),
        *(Method(f"deep-prompt-{m}", "deep-prompt", MethodOptions(deep_prompt_slots=m)) for m in (10, 100)),
        *(Method(f"prompt-tuning-{m}", "prompt", MethodOptions(virtual_tokens=m)) for m in (20, 100)),
        *(Method(f"prefix-{m}", "ptv2", MethodOptions(virtual_tokens=m)) for m in (20, 100)),
        Method("lora-8", "lora", MethodOptions(lora_rank=8)),
        *(Method(name, name) for name in PROMPT_METHODS),  # each at its paper's defaults
        Method("adapter-64", "adapter", MethodOptions(bottleneck=64)),
        Method("full", "full"),
    )
}


def parse_methods(text: str) -> list[Method]:
    """'all' or a comma-separated list of method names; the floor is always included (ratios need it)."""
    names = list(METHODS) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    return [METHODS["floor"]] + [METHODS[n] for n in dict.fromkeys(names) if n != "floor"]


def attach(method: Method, backbone: Backbone, base: nn.Module) -> nn.Module:
    """Turn a private copy (`base`) of the backbone's model into `method`'s trainable model."""
    if method.method is None:
        return base.requires_grad_(False)
    return apply_method(replace(backbone, model=base), method.method, method.options)
