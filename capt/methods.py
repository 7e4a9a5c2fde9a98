"""Every fine-tuning method the pipeline compares, behind one function.

`capt` and `deep-prompt` come from this library; `prompt` (Prompt Tuning), `ptv2` (P-Tuning v2 / prefix
tuning), `lora` and `ia3` come from `peft`; `head` trains only the classifier; `full` trains everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .backbones import Backbone
from .config import CaptConfig
from .model import get_capt_model

METHODS = ("capt", "deep-prompt", "prompt", "ptv2", "lora", "ia3", "head", "full")
_PEFT_TASK_TYPES = {"encoder": "SEQ_CLS", "encoder-decoder": "SEQ_2_SEQ_LM", "decoder": "CAUSAL_LM"}


@dataclass
class MethodOptions:
    variant: str = "add"  # capt: add | prepend | extract | project
    deep_prompt_slots: int = 10  # deep-prompt: m task slots per layer
    virtual_tokens: int = 20  # prompt / ptv2: soft-prompt length
    lora_rank: int = 8


def apply_method(backbone: Backbone, method: str, options: MethodOptions | None = None) -> nn.Module:
    """Wrap `backbone.model` for `method`; returns the module to train (its trainable parameters set).

    Example:
        >>> from capt.backbones import load_backbone
        >>> model = apply_method(load_backbone("tiny-llama"), "capt")
        >>> model.get_nb_trainable_parameters()[0]
        128
    """
    options = options or MethodOptions()
    base = backbone.model
    if method == "capt":
        return get_capt_model(base, CaptConfig(variant=options.variant))
    if method == "deep-prompt":
        # Random init: m zero-initialised slots would be interchangeable (an encoder gives them no positions),
        # receive identical gradients and stay identical.
        config = CaptConfig(num_slots=options.deep_prompt_slots, instance_aware=False, init="normal")
        return get_capt_model(base, config)
    if method in ("prompt", "ptv2", "lora", "ia3"):
        return _peft_model(backbone, method, options)
    if method == "head":
        head = _classifier_name(base)
        if head is None:
            raise ValueError(
                f"method 'head' trains a classification head, and {type(base).__name__} has none: "
                "use an encoder backbone (e.g. --model minilm)"
            )
        base.requires_grad_(False)
        base.get_submodule(head).requires_grad_(True)
        return base
    if method == "full":
        return base.requires_grad_(True)
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def _classifier_name(model: nn.Module) -> str | None:
    return next((name for name in ("classifier", "score") if hasattr(model, name)), None)


def _peft_model(backbone: Backbone, method: str, options: MethodOptions) -> nn.Module:
    import peft

    task_type = _PEFT_TASK_TYPES[backbone.family]
    if method == "prompt":
        config = peft.PromptTuningConfig(task_type=task_type, num_virtual_tokens=options.virtual_tokens)
    elif method == "ptv2":
        config = peft.PrefixTuningConfig(task_type=task_type, num_virtual_tokens=options.virtual_tokens)
    elif method == "lora":
        config = peft.LoraConfig(task_type=task_type, r=options.lora_rank, lora_alpha=2 * options.lora_rank)
    else:
        config = peft.IA3Config(task_type=task_type)
    return peft.get_peft_model(backbone.model, config)
