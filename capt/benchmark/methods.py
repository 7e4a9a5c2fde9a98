"""The methods compared: CaPT and Deep Prompt-Tuning from this package, the PEFT baselines from `peft` itself.

`floor` is not a method but the lower bound of every input-side method: the frozen base model, forward and
backward on the same N+1 tokens, with gradients only to the input embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import LoraConfig, PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model
from torch import nn

from ..config import CaptConfig
from ..model import get_capt_model
from .backbones import Backbone

PEFT_TASKS = {"classification": TaskType.SEQ_CLS, "causal": TaskType.CAUSAL_LM, "seq2seq": TaskType.SEQ_2_SEQ_LM}


@dataclass(frozen=True)
class Method:
    name: str
    family: str  # floor, capt, deep-prompt, prompt-tuning, prefix, lora, full
    size: int = 0  # slots, virtual tokens or LoRA rank
    variant: str = "add"

    @property
    def extra_positions(self) -> int:
        """Sequence positions the method puts in front of the user's tokens."""
        if self.family == "floor":
            return 1
        if self.family == "capt":
            return CaptConfig(variant=self.variant).slots_per_layer
        return self.size if self.family in ("deep-prompt", "prompt-tuning") else 0

    @property
    def prompt_style(self) -> bool:
        """A peer that `capt` must beat on time and memory."""
        return self.family in ("deep-prompt", "prompt-tuning", "prefix")


METHODS = {
    m.name: m
    for m in (
        Method("floor", "floor"),
        *(Method(f"capt-{v}", "capt", 1, v) for v in ("add", "prepend", "extract", "project")),
        Method("deep-prompt-10", "deep-prompt", 10),
        Method("deep-prompt-100", "deep-prompt", 100),
        Method("prompt-tuning-20", "prompt-tuning", 20),
        Method("prompt-tuning-100", "prompt-tuning", 100),
        Method("prefix-20", "prefix", 20),
        Method("prefix-100", "prefix", 100),
        Method("lora-8", "lora", 8),
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
    """Turn a private copy of the backbone into `method`'s trainable model."""
    if method.family == "floor":
        return base.requires_grad_(False)
    if method.family == "full":
        return base.requires_grad_(True)
    if method.family == "capt":
        return get_capt_model(base, CaptConfig(variant=method.variant))
    if method.family == "deep-prompt":
        return get_capt_model(base, CaptConfig(num_slots=method.size, instance_aware=False))
    task = PEFT_TASKS[backbone.task]
    if method.family == "prompt-tuning":
        # Encoder-side prompts only (Lester et al., the paper's baseline); PEFT's seq2seq default also
        # prompts the decoder.
        extra = {"num_transformer_submodules": 1} if backbone.task == "seq2seq" else {}
        config = PromptTuningConfig(task_type=task, num_virtual_tokens=method.size, **extra)
    elif method.family == "prefix":
        config = PrefixTuningConfig(task_type=task, num_virtual_tokens=method.size)
    else:
        config = LoraConfig(task_type=task, r=method.size)
    return get_peft_model(base, config)


def floor_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floor's batch: one more token in front (where the capsule sits), not a target."""
    ids = batch["input_ids"]
    inputs = {
        **batch,
        "input_ids": torch.cat([ids[:, :1], ids], dim=1),
        "attention_mask": torch.cat([batch["attention_mask"][:, :1], batch["attention_mask"]], dim=1),
    }
    labels = batch["labels"]
    if labels.shape == ids.shape:  # causal LM: the extra position is context
        inputs["labels"] = torch.cat([torch.full_like(labels[:, :1], -100), labels], dim=1)
    return inputs
