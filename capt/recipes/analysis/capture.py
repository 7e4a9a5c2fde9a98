"""Attention weights of a forward pass, with the capsule slot rows kept.

`CaptModel` strips the slot from everything it returns, attentions included. The attentions are collected by
each innermost `transformers` model (BertModel, T5Stack, LlamaModel, ...), the module that runs one layer stack,
and hold the slot rows there. A forward hook registered with `prepend=True` on that module reads them before
any CaPT hook (on the same module or an outer one) strips them, so no core change is needed. A T5 encoder keeps
its slot (the decoder attends to it), but CaPT runs it right-aligned and puts the columns back in the caller's
order in its own hook on the stack: a second hook, after CaPT's, reads the attentions again where the slot rows
are still there, so they come in the caller's column order.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ...sites import model_family

# encoder: bidirectional self-attention; decoder: causal self-attention; cross: T5 decoder -> encoder memory.
STREAMS = ("encoder", "decoder", "cross")


def use_eager_attention(model: nn.Module) -> None:
    """Switch the `transformers` model in `model` (a `CaptModel` or the model itself) to eager attention, which
    returns attention weights; SDPA does not.

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> backbone = load_backbone("tiny-llama")
        >>> use_eager_attention(backbone.model)
        >>> backbone.model.config._attn_implementation
        'eager'
    """
    outermost = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    outermost.set_attn_implementation("eager")


@torch.no_grad()
def capture_attention(model: nn.Module, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Run `model(**inputs, output_attentions=True)`; return each stream's attention with any slot rows kept.

    Returns {stream: (layers, batch, heads, queries, keys)} for the streams the model has ("encoder" for BERT,
    "decoder" for Llama/GPT-2, "encoder", "decoder" and "cross" for T5). `model` is a `CaptModel` or a plain
    `transformers` model, set to eager attention (`use_eager_attention`).

    Example:
        >>> import torch, capt
        >>> from capt.recipes.backbones import load_backbone
        >>> base = load_backbone("tiny-llama").model
        >>> use_eager_attention(base)
        >>> model = capt.get_capt_model(base, capt.CaptConfig())
        >>> capture_attention(model, {"input_ids": torch.tensor([[5, 6, 7]])})["decoder"].shape  # slot kept
        torch.Size([2, 1, 4, 4, 4])
    """
    family = model_family(next(m for m in model.modules() if isinstance(m, PreTrainedModel)))
    captured: dict[str, tuple[torch.Tensor, ...]] = {}

    def record(stream: str, module: nn.Module, args: tuple, output: Any) -> None:
        captured[stream] = output.get("attentions")
        if output.get("cross_attentions"):
            captured["cross"] = output["cross_attentions"]

    def record_if_kept(stream: str, module: nn.Module, args: tuple, output: Any) -> None:
        attentions = output.get("attentions")
        if attentions and captured.get(stream) and attentions[0].shape == captured[stream][0].shape:
            record(stream, module, args, output)  # the slot rows are kept: take them in the caller's columns

    handles = []
    for module in _innermost_models(model):
        stream = "decoder" if family == "decoder" or getattr(module.config, "is_decoder", False) else "encoder"
        handles.append(module.register_forward_hook(partial(record, stream), prepend=True))
        handles.append(module.register_forward_hook(partial(record_if_kept, stream)))
    try:
        model(**inputs, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    if not all(captured.values()):
        raise ValueError(
            "the model returned no attention weights: call use_eager_attention(model) first (SDPA and flash "
            "attention do not compute them)"
        )
    return {stream: torch.stack(captured[stream]) for stream in STREAMS if stream in captured}


def _innermost_models(model: nn.Module) -> list[PreTrainedModel]:
    """The `transformers` models inside `model` that contain no other: each runs one layer stack."""
    return [
        m
        for m in model.modules()
        if isinstance(m, PreTrainedModel) and sum(isinstance(sub, PreTrainedModel) for sub in m.modules()) == 1
    ]
