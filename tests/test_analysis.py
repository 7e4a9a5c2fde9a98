"""`capt analyze`: attention captured with the slot kept, token roles, anchor numbers, instance tokens, reports."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import batch_inputs, build, randomize_capsules

import capt
from capt.recipes.analysis import anchor_metrics, capture_attention, example_maps, instance_tokens, role_matrix
from capt.recipes.analysis.anchors import structural_share
from capt.recipes.analysis.attention import Subject, bare_subject
from capt.recipes.analysis.capture import use_eager_attention
from capt.recipes.backbones import load_backbone
from capt.recipes.cli import main
from capt.recipes.data import Example
from capt.recipes.formats import make_format
from capt.recipes.methods import MethodOptions, apply_method

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
EXAMPLE = Example("rte", 0, {"premise": "A cat sat on the mat.", "hypothesis": "A cat sat."}, 0)


@pytest.mark.parametrize("name", ["bert-cls", "t5", "llama"])
def test_attention_rows_sum_to_one_with_the_slot_kept(name):
    base = build(name)
    use_eager_attention(base)
    model = capt.get_capt_model(base, capt.CaptConfig())
    inputs = batch_inputs(name, batch=1)
    streams = capture_attention(model, inputs)
    assert set(streams) == (
        {"encoder", "decoder", "cross"} if name == "t5" else {"decoder" if name == "llama" else "encoder"}
    )
    tokens = inputs["input_ids"].shape[1]
    for stream, weights in streams.items():
        assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5), stream
        if stream != "decoder" or name == "llama":  # the slot sits in front of the input (T5: encoder memory)
            assert weights.shape[-1] == tokens + 1, stream
    if name == "llama":  # causal: nothing attends ahead, so the slot attends only to itself
        assert torch.equal(streams["decoder"][..., 0, 0], torch.ones_like(streams["decoder"][..., 0, 0]))


@pytest.mark.parametrize("target", ["encoder", "both"])
def test_captured_t5_attentions_of_a_left_padded_row_are_the_row_alone_in_the_callers_columns(target):
    # CaPT runs the T5 encoder right-aligned; the capture must still come in the caller's columns.
    base = build("t5")
    use_eager_attention(base)
    model = capt.get_capt_model(base, capt.CaptConfig(target=target))
    randomize_capsules(model)
    row = torch.tensor([5, 6, 7, 8])
    pads = 3
    padded = {
        "input_ids": torch.cat([torch.zeros(pads, dtype=torch.long), row])[None],
        "attention_mask": torch.tensor([[0] * pads + [1] * len(row)]),
        "decoder_input_ids": torch.tensor([[0, 9, 10]]),
    }
    batch = capture_attention(model, padded)
    alone = capture_attention(model, {"input_ids": row[None], "decoder_input_ids": padded["decoder_input_ids"]})
    kept = torch.tensor([0, *range(1 + pads, 1 + pads + len(row))])  # the slot, then the row's real columns
    encoder = batch["encoder"][..., kept[:, None], kept]
    torch.testing.assert_close(encoder, alone["encoder"], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["cross"][..., kept], alone["cross"], atol=1e-5, rtol=0)
    assert torch.all(batch["encoder"][..., 1 : 1 + pads] == 0)  # nothing attends to the caller's pad columns


def test_capture_asks_for_eager_attention():
    base = build("bert-cls")
    base.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="use_eager_attention"):
        capture_attention(capt.get_capt_model(base, capt.CaptConfig()), batch_inputs("bert", batch=1))


def test_slots_and_structural_tokens_are_labelled_at_their_positions():
    backbone = load_backbone("minilm", num_labels=2)
    use_eager_attention(backbone.model)
    fmt = make_format("encoder", "rte", backbone.tokenizer, 64)
    model = apply_method(backbone, "deep-prompt", MethodOptions(deep_prompt_slots=2))
    adapted = example_maps(Subject("deep-prompt", model, fmt, ["[P1]", "[P2]"]), EXAMPLE)["encoder"]
    base = example_maps(Subject("base", model, fmt, [], adapter_disabled=True), EXAMPLE)["encoder"]

    assert adapted.key_tokens[:3] == ["[P1]", "[P2]", "[CLS]"] and base.key_tokens[0] == "[CLS]"
    assert adapted.key_tokens[2:] == base.key_tokens
    assert adapted.attention.shape[1:] == (len(base.key_tokens) + 2,) * 2
    separators = [i for i, token in enumerate(base.key_tokens) if token in ("[CLS]", "[SEP]")]
    assert [i for i, role in enumerate(base.key_roles) if role == "structural"] == separators
    assert adapted.key_roles[:2] == ["slot", "slot"] and adapted.key_roles[2:] == base.key_roles


def test_template_words_of_t5_are_structural():
    maps = example_maps(bare_subject("tiny-t5", "rte", 64), EXAMPLE)
    structural = [
        t for t, r in zip(maps["encoder"].key_tokens, maps["encoder"].key_roles, strict=True) if r == "structural"
    ]
    assert structural == ["[CLS]", "rte", "hypothesis", ":", "premise", ":", "[SEP]"]
    assert maps["cross"].cross and maps["cross"].key_tokens == maps["encoder"].key_tokens


def test_attention_needs_a_run_or_a_model(tmp_path, capsys):
    assert main(["analyze", "attention", "--output-dir", str(tmp_path)]) == 1
    assert "--run" in capsys.readouterr().err


def _constructed_attention() -> torch.Tensor:
    """2 layers over [slot, [CLS], word, word]; rows sum to 1."""
    layer1 = [[0.7, 0.1, 0.1, 0.1], [0.5, 0.3, 0.1, 0.1], [0.4, 0.2, 0.2, 0.2], [0.6, 0.2, 0.1, 0.1]]
    layer2 = [[0.1, 0.6, 0.2, 0.1], [0.2, 0.2, 0.3, 0.3], [0.2, 0.4, 0.2, 0.2], [0.0, 0.5, 0.5, 0.0]]
    return torch.tensor([layer1, layer2])


def test_metrics_match_hand_computed_values():
    attention = _constructed_attention()
    metrics = anchor_metrics(attention, ["slot", "structural", "input", "input"])
    expected = {
        "to_anchor": [(0.5 + 0.4 + 0.6) / 3, (0.2 + 0.2 + 0.0) / 3],
        "to_first_token": [(0.3 + 0.2 + 0.2) / 3, (0.2 + 0.4 + 0.5) / 3],
        "to_structural": [(0.3 + 0.2 + 0.2) / 3, (0.2 + 0.4 + 0.5) / 3],
        "anchor_to_anchor": [0.7, 0.1],
        "anchor_to_structural": [0.1, 0.6],
        "anchor_to_input": [0.2, 0.3],
    }
    for name, values in expected.items():
        assert metrics[name].tolist() == pytest.approx(values), name
    # The same map without a slot (the base model): the first token is the anchor.
    base = anchor_metrics(
        attention[:, 1:, 1:] / attention[:, 1:, 1:].sum(-1, keepdim=True), ["structural", "input", "input"]
    )
    assert base["to_anchor"].tolist() == pytest.approx([(0.2 / 0.6 + 0.2 / 0.4) / 2, (0.4 / 0.8 + 0.5 / 1.0) / 2])
    assert base["anchor_to_anchor"].tolist() == pytest.approx([0.3 / 0.5, 0.2 / 0.8])
    # Cross-attention: decoder queries hold no anchor, so the anchor rows are undefined.
    cross = anchor_metrics(attention[:, 1:], ["slot", "structural", "input", "input"], ["structural", "input", "input"])
    assert cross["to_anchor"].tolist() == pytest.approx(expected["to_anchor"])
    assert all(math.isnan(v) for v in cross["anchor_to_anchor"].tolist())
    assert structural_share(["slot", "structural", "input", "input"]) == pytest.approx(1 / 3)
    matrix = role_matrix(attention, ["slot", "structural", "input", "input"])
    assert torch.allclose(matrix[0], torch.tensor([[0.7, 0.1, 0.2], [0.5, 0.3, 0.2], [0.5, 0.2, 0.3]]))


def test_instance_tokens_change_the_model_only_inside_the_block():
    base = build("bert-cls")
    model = capt.get_capt_model(base, capt.CaptConfig(num_slots=3, instance_aware=False, init="normal"))
    inputs = batch_inputs("bert", batch=2)
    plain = model(**inputs).logits
    with instance_tokens(model, 0):
        assert torch.equal(model(**inputs).logits, plain)
    with instance_tokens(model, 2):
        assert not torch.allclose(model(**inputs).logits, plain)
    assert torch.equal(model(**inputs).logits, plain)
    assert model.num_slots == 3


@pytest.fixture(scope="module")
def t5_deep_prompt_run(tmp_path_factory):
    """A Deep Prompt-Tuning run of the tiny T5 (every attention stream), trained for one quick epoch."""
    root = tmp_path_factory.mktemp("analysis")
    run = root / "deep-prompt"
    argv = ["train", "--model", "tiny-t5", "--task", "rte", "--method", "deep-prompt", "--deep-prompt-slots", "2"]
    quick = ["--epochs", "1", "--lr", "0.05", "--limit-train", "16", "--limit-eval", "8", "--batch-size", "8"]
    assert (
        main([*argv, *quick, "--data-dir", str(DATA), "--cache-dir", str(root / "cache"), "--output-dir", str(run)])
        == 0
    )
    return run


def test_instance_token_study_at_k0_reproduces_the_plain_evaluation_exactly(t5_deep_prompt_run, tmp_path):
    out = tmp_path / "instance"
    assert (
        main(["analyze", "instance-token", "--run", str(t5_deep_prompt_run), "--ks", "0,1,2", "--output-dir", str(out)])
        == 0
    )
    numbers = json.loads((out / "instance_tokens.json").read_text())
    trained = json.loads((t5_deep_prompt_run / "results.json").read_text())
    assert numbers["scores"]["0"] == numbers["plain_evaluation"]
    assert numbers["scores"]["0"]["score"] == trained["score"]["mean"]
    assert list(numbers["scores"]) == ["0", "1", "2"]
    assert (out / "instance_tokens.png").stat().st_size > 1000
    assert "reproduces it exactly: yes" in (out / "report.md").read_text()


def test_attention_report_writes_images_and_numbers(t5_deep_prompt_run, tmp_path):
    out = tmp_path / "attention"
    argv = ["analyze", "attention", "--run", str(t5_deep_prompt_run), "--examples", "2", "--max-tokens", "16"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    numbers = json.loads((out / "attention.json").read_text())
    assert list(numbers["subjects"]) == ["deep-prompt", "base"]
    assert len(numbers["example_ids"]) == 2
    for name, subject in numbers["subjects"].items():
        assert set(subject["streams"]) == {"encoder", "decoder", "cross"}, name
        encoder = subject["streams"]["encoder"]
        assert len(encoder["per_layer"]["to_anchor"]) == 2 and 0.0 <= encoder["mean"]["to_anchor"] <= 1.0
    report = (out / "report.md").read_text()
    images = sorted(out.glob("*.png"))
    assert len(images) == 3 * (2 + 2 * 2)  # per stream: two summaries, two maps per model
    for image in images:
        assert image.stat().st_size > 1000 and f"]({image.name})" in report
