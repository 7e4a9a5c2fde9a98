"""The synthetic batches `capt bench` feeds every method, and the floor's version of them.

Token ids are random: timing and memory do not depend on what the tokens say. A batch is full, without padding:
the worst case for every method, and the same for all.
"""

from __future__ import annotations

import torch

from ..backbones import Backbone

# Tokens scored by the loss of the generative backbones: a short SuperGLUE-style answer ("not_entailment").
ANSWER_TOKENS = 4
# Random ids start above the usual special ids (pad, bos, eos).
FIRST_ID = 3


def synthetic_batch(backbone: Backbone, batch_size: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Random ids of `length` tokens with the labels the backbone's family trains on."""
    generator = torch.Generator().manual_seed(seed)
    vocab = backbone.model.config.vocab_size
    ids = torch.randint(FIRST_ID, vocab, (batch_size, length), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if backbone.family == "encoder":
        inputs["labels"] = torch.randint(0, backbone.model.config.num_labels, (batch_size,), generator=generator)
    elif backbone.family == "decoder":
        labels = ids.clone()
        labels[:, :-ANSWER_TOKENS] = -100  # prompt tokens are context, the answer is scored
        inputs["labels"] = labels
    else:
        inputs["labels"] = torch.randint(FIRST_ID, vocab, (batch_size, ANSWER_TOKENS), generator=generator)
    return inputs


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
