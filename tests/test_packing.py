"""Packed and padding-free batches (several examples in one row) are refused: one capsule mean per row would mix
their instances. Padded batches with explicit positions, left or right, still run."""

from __future__ import annotations

import pytest
import torch
from conftest import build
from transformers import DataCollatorWithFlattening

import capt
from capt.injector import refuse_packed_rows


@pytest.fixture
def model():
    return capt.get_capt_model(build("llama"), capt.CaptConfig())


def test_a_row_whose_positions_restart_is_refused(model):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with pytest.raises(ValueError, match=r"row 0 holds several sequences \(position_ids restart at token 3\)"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]]), labels=ids)


def test_transformers_flattening_collator_is_refused(model):
    """DataCollatorWithFlattening: the padding-free batches of Trainer users (and TRL's), with flash attention's
    sequence boundaries."""
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples, return_tensors="pt")
    with pytest.raises(ValueError, match="several sequences"):
        model(**batch)
    del batch["position_ids"]
    with pytest.raises(ValueError, match=r"several sequences per row \(cu_seq_lens_q"):
        model(**batch)


def test_padded_rows_with_explicit_positions_still_run(model):
    """Left padding with generate's positions (pads at 1, the first real token at 0) and right padding (pads at 0)
    restart only across pads, which the check leaves out."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = model(input_ids=ids, attention_mask=left).logits
    positions = torch.tensor([[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]])
    torch.testing.assert_close(model(input_ids=ids, attention_mask=left, position_ids=positions).logits, expected)
    right = torch.tensor([[1, 1, 1, 0, 0]])
    model(input_ids=ids[:1], attention_mask=right, position_ids=torch.tensor([[0, 1, 2, 0, 0]]))
    refuse_packed_rows({"position_ids": torch.tensor([[7]])})  # a decode step: one position per row
