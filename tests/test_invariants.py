"""Property tests of the core's equalities over random batch shapes, padding patterns and dtypes."""

import pytest
import torch
from conftest import build, randomize_capsules
from hypothesis import given, settings
from hypothesis import strategies as st

import capt

MODELS = {}


def _model(name):
    """One wrapped model per family for the whole module (building is the slow part)."""
    if name not in MODELS:
        MODELS[name] = capt.get_capt_model(build(name))
        randomize_capsules(MODELS[name])
    return MODELS[name]


lengths = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=4)


def _right_padded(lengths_, seed):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths_)
    ids = torch.randint(3, 100, (len(lengths_), width), generator=generator)
    mask = (torch.arange(width)[None] < torch.tensor(lengths_)[:, None]).long()
    return ids * mask, mask


@settings(max_examples=12, deadline=None)
@given(lengths=lengths, seed=st.integers(0, 1000), name=st.sampled_from(["bert-cls", "t5", "llama"]))
def test_every_row_of_a_padded_batch_equals_the_row_alone(lengths, seed, name):
    model = _model(name)
    ids, mask = _right_padded(lengths, seed)
    extra = {"decoder_input_ids": torch.zeros(len(lengths), 2, dtype=torch.long)} if name == "t5" else {}
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, **extra).logits
        for row, length in enumerate(lengths):
            single = {k: v[row : row + 1] for k, v in extra.items()}
            alone = model(input_ids=ids[row : row + 1, :length], **single).logits[0]
            got = batch[row, :length] if name == "llama" else batch[row]
            assert torch.allclose(got, alone, atol=1e-4)


@settings(max_examples=12, deadline=None)
@given(
    lengths=lengths,
    seed=st.integers(0, 1000),
    name=st.sampled_from(["bert", "gpt2", "qwen2"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_outputs_have_the_base_shapes_for_any_batch(lengths, seed, name, dtype):
    model = _model(name)
    ids, mask = _right_padded(lengths, seed)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is torch.bfloat16):
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        with model.disable_adapter():
            expected = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    main = "logits" if "logits" in expected else "last_hidden_state"
    assert got[main].shape == expected[main].shape
    assert [h.shape for h in got.hidden_states] == [h.shape for h in expected.hidden_states]


@settings(max_examples=8, deadline=None)
@given(lengths=lengths, seed=st.integers(0, 1000), new_tokens=st.integers(1, 5))
def test_cached_and_uncached_generation_agree_for_left_padded_batches(lengths, seed, new_tokens):
    model = _model("llama")
    ids, mask = _right_padded(lengths, seed)
    # Left-pad: move each row's padding to the front.
    ids = torch.stack([torch.roll(row, int((m == 0).sum())) for row, m in zip(ids, mask, strict=True)])
    mask = torch.stack([torch.roll(m, int((m == 0).sum())) for m in mask])
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    cached = model.generate(input_ids=ids, use_cache=True, **kwargs)
    uncached = model.generate(input_ids=ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, : ids.shape[1]], ids)  # the prompt comes back as given, no slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capsules_are_written_in_the_hidden_dtype(dtype):
    model = capt.get_capt_model(build("llama").to(dtype))
    seen = []
    model.base_model.model.layers[1].register_forward_pre_hook(
        lambda m, a, k: seen.append((a[0] if a else k["hidden_states"]).dtype), with_kwargs=True
    )
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert seen == [dtype]


def _t5_logits_left_and_right_padded(model, seed=0, pads=3):
    """Logits of one 7-token example with `pads` pad columns on the left and on the right, and alone."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (1, 7), generator=generator)
    decoder = torch.randint(3, 100, (1, 3), generator=generator)
    zeros, ones = torch.zeros(1, pads, dtype=torch.long), torch.ones_like(ids)
    layouts = {
        "alone": (ids, ones),
        "left": (torch.cat([zeros, ids], 1), torch.cat([zeros, ones], 1)),
        "right": (torch.cat([ids, zeros], 1), torch.cat([ones, zeros], 1)),
    }
    with torch.no_grad():
        return {
            side: model(input_ids=x, attention_mask=mask, decoder_input_ids=decoder).logits
            for side, (x, mask) in layouts.items()
        }


def test_bare_t5_does_not_depend_on_left_padding():
    """T5's relative position bias depends only on column differences, which left pads do not change."""
    logits = _t5_logits_left_and_right_padded(build("t5").eval())
    torch.testing.assert_close(logits["left"], logits["alone"], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits["right"], logits["alone"], atol=1e-5, rtol=0)


def test_capt_t5_does_not_depend_on_left_padding():
    """The encoder runs right-aligned, so the slot is as near the first token as with no padding at all."""
    logits = _t5_logits_left_and_right_padded(_model("t5").eval())
    torch.testing.assert_close(logits["right"], logits["alone"], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits["left"], logits["alone"], atol=1e-5, rtol=0)


def _t5_padded(lengths_, side, seed=0):
    """Rows of the given lengths, padded on `side`; with the rows alone."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 100, (length,), generator=generator) for length in lengths_]
    width = max(lengths_)
    pad = [torch.zeros(width - len(row), dtype=torch.long) for row in rows]
    ids = torch.stack([torch.cat([p, r] if side == "left" else [r, p]) for r, p in zip(rows, pad, strict=True)])
    mask = torch.stack(
        [
            torch.cat([p, torch.ones_like(r)] if side == "left" else [torch.ones_like(r), p])
            for r, p in zip(rows, pad, strict=True)
        ]
    )
    return ids, mask, rows


@pytest.mark.parametrize("target", ["encoder", "both"])
def test_capt_t5_left_padded_batch_returns_each_row_alone_in_the_callers_columns(target):
    """Logits, the encoder memory, its hidden states and attentions come back where the caller's columns are."""
    base = build("t5")
    base.set_attn_implementation("eager")  # sdpa returns no attention weights
    model = capt.get_capt_model(base, capt.CaptConfig(target=target))
    randomize_capsules(model)
    ids, mask, rows = _t5_padded([7, 4, 2], "left")
    decoder = torch.randint(3, 100, (3, 3), generator=torch.Generator().manual_seed(1))
    extra = dict(output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, **extra)
        for i, row in enumerate(rows):
            alone = model(input_ids=row[None], decoder_input_ids=decoder[i : i + 1], **extra)
            real = slice(ids.shape[1] - len(row), None)  # this row's columns in the batch
            torch.testing.assert_close(batch.logits[i], alone.logits[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(
                batch.encoder_last_hidden_state[i, real], alone.encoder_last_hidden_state[0], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                batch.encoder_hidden_states[-1][i, real], alone.encoder_hidden_states[-1][0], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                batch.encoder_attentions[0][i, :, real, real], alone.encoder_attentions[0][0], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                batch.cross_attentions[0][i, ..., real], alone.cross_attentions[0][0], atol=1e-5, rtol=0
            )


def test_capt_t5_generates_the_same_from_left_and_right_padded_prompts():
    model = _model("t5")
    kwargs = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    out = {}
    for side in ("left", "right"):
        ids, mask, rows = _t5_padded([6, 3, 1], side)
        out[side] = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    alone = model.generate(input_ids=rows[1][None], **kwargs)
    assert torch.equal(out["left"].sequences, out["right"].sequences)
    assert torch.equal(out["left"].sequences[1], alone.sequences[0])
    for left, right, single in zip(out["left"].scores, out["right"].scores, alone.scores, strict=True):
        torch.testing.assert_close(left, right, atol=1e-5, rtol=0)
        torch.testing.assert_close(left[1], single[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["bert-cls", "llama", "t5"])
def test_an_attention_mask_of_another_shape_is_refused(name):
    """BERT broadcasts a (2, 5) mask over (2, 6) ids without a word; under CaPT it is a clear error instead."""
    ids = torch.randint(3, 100, (2, 6))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    if name == "t5":
        inputs["decoder_input_ids"] = torch.randint(3, 100, (2, 2))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\), input_ids has \(2, 6\)"):
        _model(name)(**inputs)
