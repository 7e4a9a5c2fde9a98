"""Attention-anchor numbers from one attention map (paper Findings I and III).

The *anchor* is what the capsule is meant to be: the slot position(s) of an adapter, or, for a model without
slots, the first token ([CLS], <s>, the decoder start token), which the slot displaces from position 0. Every
number is a mean over query tokens of the attention mass they put on a group of key tokens, per layer.
The groups are disjoint: when the first token is the anchor, it is not counted as structural as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tokens import SLOT, STRUCTURAL

GROUPS = ("anchor", "structural", "input")
METRICS = {
    "to_anchor": "(a) attention mass the other tokens give to the anchor (the anchor effect)",
    "to_first_token": "attention mass the other tokens give to the first token after the slots ([CLS], <s>)",
    "to_structural": "attention mass the other tokens give to structural tokens (the anchor excluded)",
    "anchor_to_anchor": "(c) share of the anchor's attention that stays among the anchor positions (Finding I)",
    "anchor_to_structural": "(b) share of the anchor's attention on structural tokens (the anchor excluded)",
    "anchor_to_input": "(b) share of the anchor's attention on the other input tokens",
}


def groups(roles: Sequence[str], anchor: bool = True) -> dict[str, torch.Tensor]:
    """Boolean masks of the anchor, structural and input positions of one sequence axis (disjoint).

    With `anchor=False` (the query axis of cross-attention, which holds no slot) the anchor group is empty.

    Example:
        >>> {k: v.tolist() for k, v in groups(["slot", "structural", "input"]).items()}
        {'anchor': [True, False, False], 'structural': [False, True, False], 'input': [False, False, True]}
        >>> groups(["structural", "input", "structural"])["anchor"].tolist()  # no slot: the first token
        [True, False, False]
    """
    slot = torch.tensor([role == SLOT for role in roles])
    first = torch.arange(len(roles)) == 0
    anchor_mask = (slot if slot.any() else first) & anchor
    structural = torch.tensor([role == STRUCTURAL for role in roles]) & ~anchor_mask
    return {"anchor": anchor_mask, "structural": structural, "input": ~(anchor_mask | structural | slot)}


def mass(attention: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per layer, the mean over the selected query rows of the attention summed over the selected key columns.

    `attention` is (layers, queries, keys), rows summing to 1; NaN where no query is selected.

    Example:
        >>> att = torch.tensor([[[1.0, 0.0], [0.25, 0.75]]])
        >>> mass(att, torch.tensor([False, True]), torch.tensor([True, False]))
        tensor([0.2500])
    """
    if not queries.any():
        return attention.new_full(attention.shape[:1], float("nan"))
    return attention[:, queries][:, :, keys].sum(-1).mean(-1)


def anchor_metrics(
    attention: torch.Tensor, key_roles: Sequence[str], query_roles: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """The `METRICS` of one (layers, queries, keys) map, each a per-layer tensor (NaN where undefined).

    Self-attention: `query_roles` None (the same axis). Cross-attention: the decoder's roles; every decoder
    token then counts as an "other" token and the anchor-row numbers are NaN.

    Example:
        >>> att = torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.2, 0.2], [0.4, 0.1, 0.5]]])  # 1 layer, 3 tokens
        >>> m = anchor_metrics(att, ["slot", "structural", "input"])
        >>> round(m["to_anchor"].item(), 3), round(m["anchor_to_structural"].item(), 3)
        (0.5, 0.3)
    """
    keys = groups(key_roles)
    queries = groups(query_roles if query_roles is not None else key_roles, anchor=query_roles is None)
    others = queries["structural"] | queries["input"]
    first_token = torch.zeros(len(key_roles), dtype=torch.bool)
    first_token[sum(role == SLOT for role in key_roles)] = True
    return {
        "to_anchor": mass(attention, others, keys["anchor"]),
        "to_first_token": mass(attention, others, first_token),
        "to_structural": mass(attention, others, keys["structural"]),
        "anchor_to_anchor": mass(attention, queries["anchor"], keys["anchor"]),
        "anchor_to_structural": mass(attention, queries["anchor"], keys["structural"]),
        "anchor_to_input": mass(attention, queries["anchor"], keys["input"]),
    }


def structural_share(key_roles: Sequence[str]) -> float:
    """Structural tokens among the keys besides the anchor: the share `anchor_to_structural` would have if the
    anchor attended uniformly.

    Example:
        >>> structural_share(["slot", "structural", "input", "input", "structural"])
        0.5
    """
    keys = groups(key_roles)
    return keys["structural"].sum().item() / (keys["structural"] | keys["input"]).sum().item()


def role_matrix(
    attention: torch.Tensor, key_roles: Sequence[str], query_roles: Sequence[str] | None = None
) -> torch.Tensor:
    """(layers, 3, 3): row group -> column group attention mass over `GROUPS` (rows: queries, NaN if empty).

    Example:
        >>> att = torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.2, 0.2], [0.4, 0.1, 0.5]]])
        >>> role_matrix(att, ["slot", "structural", "input"])[0, 0]  # the anchor row
        tensor([0.5000, 0.3000, 0.2000])
    """
    keys = groups(key_roles)
    queries = groups(query_roles if query_roles is not None else key_roles, anchor=query_roles is None)
    rows = [torch.stack([mass(attention, queries[q], keys[k]) for k in GROUPS], -1) for q in GROUPS]
    return torch.stack(rows, -2)
