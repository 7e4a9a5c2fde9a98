"""The capsule math against an independent, layer-by-layer reference; masking; padding; no label leakage."""

import pytest
import torch
from conftest import TINY, build, randomize_capsules
from transformers import LlamaForTokenClassification

import capt
from capt.recipes.backbones import random_config


def _reference_capsule(p, hidden, instance, first):
    """S_1 = p_1 + Mean(E);  S_i = p_i + Mean([S'_{i-1}; H_{i-1}]) over instance tokens (slot at row 0)."""
    weights = instance.float()
    if not first:
        weights = torch.cat([torch.ones_like(weights[:, :1]), weights[:, 1:]], dim=1)
    mean = (hidden * weights[..., None]).sum(1) / weights.sum(1, keepdim=True)
    return p + mean


def test_bert_classifier_matches_a_layer_by_layer_reference():
    base = build("bert-cls")
    model = capt.get_capt_model(base)
    randomize_capsules(model)
    head = model.base_model.classifier  # the trained copy; perturb it so the original would not pass
    with torch.no_grad():
        head.weight.add_(0.5)
    ids = torch.tensor([[2, 10, 11, 12, 13, 3], [2, 20, 21, 22, 23, 3]])
    # A non-trivial instance mask: the mean must skip the excluded tokens.
    instance = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 0, 1]])
    with torch.no_grad():
        got = model(input_ids=ids, instance_mask=instance).logits

    with torch.no_grad(), model.disable_adapter():  # the reference runs the bare layers
        slot_instance = torch.cat([torch.zeros(2, 1, dtype=torch.long), instance], dim=1)
        hidden = base.bert.embeddings(input_ids=torch.cat([torch.zeros(2, 1, dtype=torch.long), ids], dim=1))
        for i, layer in enumerate(base.bert.encoder.layer):
            capsule = _reference_capsule(model.capsule_vectors[i], hidden, slot_instance, first=i == 0)
            hidden = layer(torch.cat([capsule[:, None], hidden[:, 1:]], dim=1))
        expected = head(base.bert.pooler(hidden[:, 1:]))
    assert torch.allclose(got, expected, atol=1e-5)


def test_llama_matches_a_layer_by_layer_reference():
    base = build("llama")
    model = capt.get_capt_model(base)
    randomize_capsules(model)
    ids = torch.tensor([[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]])
    instance = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0]])
    with torch.no_grad():
        got = model(input_ids=ids, instance_mask=instance).logits

    with torch.no_grad(), model.disable_adapter():  # the reference runs the bare layers
        length = ids.shape[1] + 1
        slot_instance = torch.cat([torch.zeros(2, 1, dtype=torch.long), instance], dim=1)
        hidden = base.model.embed_tokens(torch.cat([torch.zeros(2, 1, dtype=torch.long), ids], dim=1))
        positions = torch.arange(length)[None]
        rope = base.model.rotary_emb(hidden, positions)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        for i, layer in enumerate(base.model.layers):
            capsule = _reference_capsule(model.capsule_vectors[i], hidden, slot_instance, first=i == 0)
            hidden = layer(
                torch.cat([capsule[:, None], hidden[:, 1:]], dim=1),
                attention_mask=causal,
                position_embeddings=rope,
                position_ids=positions,
            )
        expected = base.lm_head(base.model.norm(hidden)[:, 1:])
    assert torch.allclose(got, expected, atol=1e-5)


def test_zero_capsules_are_the_training_free_instance_token():
    """With p = 0 the slot is exactly the masked mean; changing p changes the output."""
    model = capt.get_capt_model(build("llama"))
    ids = torch.tensor([[5, 6, 7, 8]])
    written = []
    handle = model.base_model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: written.append((a[0] if a else k["hidden_states"])[:, 0].clone()), with_kwargs=True
    )
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    embeddings = model.base_model.model.embed_tokens(ids)
    assert torch.allclose(written[0], embeddings.mean(1), atol=1e-6)


def test_causal_lm_targets_never_reach_earlier_positions():
    model = capt.get_capt_model(build("llama"))
    randomize_capsules(model)
    prompt = torch.tensor([[5, 6, 7, 8]])
    labels = torch.tensor([[-100, -100, -100, -100, 30, 31]])
    with torch.no_grad():
        first = model(input_ids=torch.cat([prompt, torch.tensor([[30, 31]])], 1), labels=labels).logits
        changed = model(
            input_ids=torch.cat([prompt, torch.tensor([[60, 61]])], 1),
            labels=labels.clone().masked_scatter(labels != -100, torch.tensor([60, 61])),
        ).logits
        # Had the targets entered the mean (as an all-token instance mask does), the prompt logits would move.
        leaky_a = model(
            input_ids=torch.cat([prompt, torch.tensor([[30, 31]])], 1),
            instance_mask=torch.ones(1, 6, dtype=torch.long),
        ).logits
        leaky_b = model(
            input_ids=torch.cat([prompt, torch.tensor([[60, 61]])], 1),
            instance_mask=torch.ones(1, 6, dtype=torch.long),
        ).logits
    assert torch.allclose(first[:, :4], changed[:, :4], atol=1e-6)
    assert not torch.allclose(leaky_a[:, :4], leaky_b[:, :4], atol=1e-4)


def test_causal_lm_loss_is_the_base_loss_on_the_users_tokens():
    model = capt.get_capt_model(build("llama"))
    randomize_capsules(model)
    ids = torch.tensor([[5, 6, 7, 8, 30, 31]])
    labels = torch.tensor([[-100, -100, -100, -100, 30, 31]])
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    logits = out.logits[0, 3:5]
    expected = torch.nn.functional.cross_entropy(logits, labels[0, 4:6])
    assert torch.allclose(out.loss, expected, atol=1e-6)


def test_a_decoder_token_classifier_computes_the_same_capsule_with_and_without_labels():
    # Its labels are per-token classes, not targets: all of its tokens are the instance whether labels are given.
    torch.manual_seed(0)
    base = LlamaForTokenClassification(random_config("llama", layers=2, pad_token_id=0, num_labels=3, **TINY))
    model = capt.get_capt_model(base.eval())
    randomize_capsules(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        trained = model(input_ids=ids, labels=torch.tensor([[0, 1, 2, 1]]))
        served = model(input_ids=ids)
    assert trained.loss is not None
    assert torch.allclose(trained.logits, served.logits, atol=1e-6)


@pytest.mark.parametrize("name", ["bert-cls", "roberta-cls", "t5", "llama", "gpt2"])
def test_an_example_is_the_same_alone_and_in_a_right_padded_batch(name):
    model = capt.get_capt_model(build(name))
    randomize_capsules(model)
    short = torch.tensor([[4, 5, 6]])
    long = torch.tensor([[7, 8, 9, 10, 11, 12]])
    pad = model.base_model.config.pad_token_id or 0
    batch = torch.cat([torch.cat([short, torch.full((1, 3), pad)], 1), long])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    extra = {"labels": torch.tensor([[3, 4]])} if name == "t5" else {}
    extra_batch = {"labels": torch.tensor([[3, 4], [3, 4]])} if name == "t5" else {}
    with torch.no_grad():
        alone = model(input_ids=short, **extra).logits
        padded = model(input_ids=batch, attention_mask=mask, **extra_batch).logits
    if name in ("llama", "gpt2"):
        assert torch.allclose(alone[0], padded[0, :3], atol=1e-5)
    else:
        assert torch.allclose(alone[0], padded[0], atol=1e-5)
