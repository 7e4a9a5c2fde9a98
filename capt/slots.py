"""Making room for the capsule slot in model inputs, and taking its rows out of model outputs.

A stream is one sequence a layer stack reads: the plain inputs (`input_ids`, `attention_mask`, ...) or, for an
encoder-decoder model, the decoder inputs (`decoder_input_ids`, ...). The slot occupies its first positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import ModelOutput

# Any valid id works: the slot's embedding is overwritten before the first layer reads it.
SLOT_TOKEN_ID = 0

# Where each capsule stream's slot rows show in an output, and which sequence axes the field carries.
STREAM_FIELDS = {
    "own": {
        "last_hidden_state": "hidden",
        "hidden_states": "hidden",
        "attentions": "square",
        "cross_attentions": "queries",
    },
    "encoder-memory": {
        "encoder_last_hidden_state": "hidden",
        "encoder_hidden_states": "hidden",
        "encoder_attentions": "square",
        "cross_attentions": "keys",
    },
    "decoder": {
        "decoder_hidden_states": "hidden",
        "decoder_attentions": "square",
        "cross_attentions": "queries",
    },
}


def drop_none(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def cache_of(kwargs: dict[str, Any]):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def cache_is_empty(cache: Any) -> bool:
    if cache is None:
        return True
    if hasattr(cache, "get_seq_length"):
        return cache.get_seq_length() == 0
    return len(cache) == 0  # legacy tuple caches


def batch_and_length(args: tuple, kwargs: dict) -> tuple[int, int]:
    """Batch size and sequence length of the input a layer stack was called with."""
    for key in ("input_ids", "inputs_embeds", "hidden_states"):
        if isinstance(kwargs.get(key), torch.Tensor):
            value = kwargs[key]
            return (
                (value.shape[0], value.shape[1]) if key != "input_ids" else (value.reshape(-1, value.shape[-1]).shape)
            )
    if args and isinstance(args[0], torch.Tensor):
        return args[0].shape[0], args[0].shape[1]
    raise RuntimeError("CaPT: cannot find the input of the layer stack (input_ids, inputs_embeds or hidden_states)")


def prepend(tensor: torch.Tensor, n: int, value: Any) -> torch.Tensor:
    """Prepend n columns filled with `value` on the sequence (last) axis."""
    front = torch.full((*tensor.shape[:-1], n), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([front, tensor], dim=-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens from 0, whatever the padding (padding gets 0), as `generate` does."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp(min=0) * mask


def insert_slots(inputs: dict[str, Any], prefix: str, n: int) -> None:
    """Make room for n slots at position 0 of one input stream ('' or 'decoder_')."""
    if f"{prefix}input_ids" in inputs:
        inputs[f"{prefix}input_ids"] = prepend(inputs[f"{prefix}input_ids"], n, SLOT_TOKEN_ID)
    if f"{prefix}inputs_embeds" in inputs:
        embeds = inputs[f"{prefix}inputs_embeds"]
        front = embeds.new_zeros((*embeds.shape[:-2], n, embeds.shape[-1]))
        inputs[f"{prefix}inputs_embeds"] = torch.cat([front, embeds], dim=-2)
    if f"{prefix}attention_mask" in inputs:
        inputs[f"{prefix}attention_mask"] = prepend(inputs[f"{prefix}attention_mask"], n, 1)
    if f"{prefix}position_ids" in inputs:
        positions = inputs[f"{prefix}position_ids"]
        front = torch.arange(n, dtype=positions.dtype, device=positions.device).expand(*positions.shape[:-1], n)
        inputs[f"{prefix}position_ids"] = torch.cat([front, positions + n], dim=-1)
    if not prefix and "token_type_ids" in inputs:
        inputs["token_type_ids"] = prepend(inputs["token_type_ids"], n, 0)


def right_aligned_order(tokens: torch.Tensor, n: int) -> torch.Tensor | None:
    """Column order that moves each row's leading padding behind its last column, the n slots staying in front.

    `tokens` marks the real tokens of a (batch, n + length) stream. The order turns a left-padded batch into a
    right-padded one, and changes no distance between the slots and the tokens or among the tokens. None when no
    row starts with padding (nothing to move).
    """
    user = tokens[:, n:]
    leading = (user.long().cumsum(-1) == 0).sum(-1)  # pads before the first real token; the width for an empty row
    if not bool(leading.any()):
        return None
    width = user.shape[-1]
    columns = (torch.arange(width, device=user.device) + leading[:, None]) % width + n
    slots = torch.arange(n, device=user.device).expand(user.shape[0], n)
    return torch.cat([slots, columns], dim=-1)


def reorder_columns(tensor: torch.Tensor, order: torch.Tensor, dim: int) -> torch.Tensor:
    """`tensor` with the columns of sequence axis `dim` taken in each row's `order` (batch, length)."""
    dim = dim % tensor.ndim
    shape = [order.shape[0] if axis == 0 else order.shape[1] if axis == dim else 1 for axis in range(tensor.ndim)]
    size = [order.shape[1] if axis == dim else length for axis, length in enumerate(tensor.shape)]
    return tensor.gather(dim, order.view(shape).expand(size))


# The sequence axes of each kind of output field (see STREAM_FIELDS).
_SEQUENCE_AXES = {"hidden": (1,), "square": (-2, -1), "queries": (-2,), "keys": (-1,)}


def reorder_output(output: Any, order: torch.Tensor, fields: dict[str, str]) -> Any:
    """A layer stack's output with every sequence axis of `fields` (STREAM_FIELDS) taken in `order`."""

    def reorder(tensor: torch.Tensor, kind: str) -> torch.Tensor:
        for dim in _SEQUENCE_AXES[kind]:
            tensor = reorder_columns(tensor, order, dim)
        return tensor

    return _map_fields(output, fields, reorder)


def strip_slots(output: Any, n: int, fields: dict[str, str], length: int) -> Any:
    """Remove the n slot rows from the sequence axes (of size `length`) that still hold them."""
    return _map_fields(output, fields, lambda tensor, kind: _strip_tensor(tensor, n, kind, length))


def _map_fields(output: Any, fields: dict[str, str], change: Callable[[torch.Tensor, str], torch.Tensor]) -> Any:
    """`change(tensor, kind)` applied to each field of `fields` in a model output (a bare tensor or tuple: hidden)."""
    if isinstance(output, torch.Tensor):
        return change(output, "hidden")
    if isinstance(output, ModelOutput):
        for name, kind in fields.items():
            value = output.get(name)
            if isinstance(value, torch.Tensor):
                output[name] = change(value, kind)
            elif isinstance(value, tuple):
                output[name] = tuple(change(t, kind) for t in value)
        return output
    if isinstance(output, tuple):
        return (change(output[0], "hidden"), *output[1:])
    return output


def _strip_tensor(tensor: torch.Tensor, n: int, kind: str, length: int) -> torch.Tensor:
    if kind == "hidden":
        # Contiguous, so the heads that read it (an LM head above all) run one large matmul rather than B small
        # ones on a strided view: 10-15 ms of a Llama step (benchmarks/results/profiling.md).
        return tensor[:, n:].contiguous() if tensor.shape[1] == length else tensor
    if kind == "square":
        return tensor[..., n:, n:] if tensor.shape[-1] == length else tensor
    if kind == "queries":
        return tensor[..., n:, :] if tensor.shape[-2] == length else tensor
    return tensor[..., n:] if tensor.shape[-1] == length else tensor  # keys
