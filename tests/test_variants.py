"""The paper's Figure 5 variants and Deep Prompt-Tuning share the machinery and the output format."""

import pytest
import torch
from conftest import batch_inputs, build, randomize_capsules

import capt


def test_prepend_uses_two_slots_and_keeps_base_shapes():
    base = build("llama")
    inputs = batch_inputs("llama")
    with torch.no_grad():
        expected = base(**inputs).logits
    model = capt.get_capt_model(base, capt.CaptConfig(variant="prepend"))
    randomize_capsules(model)
    assert model.num_slots == 2
    assert model.get_nb_trainable_parameters()[0] == 3 * 32
    seen = []
    model.base_model.model.layers[1].register_forward_pre_hook(
        lambda m, a, k: seen.append((a[0] if a else k["hidden_states"]).clone()), with_kwargs=True
    )
    with torch.no_grad():
        got = model(**inputs).logits
    assert got.shape == expected.shape
    slot_in = seen[0]
    assert slot_in.shape[1] == inputs["input_ids"].shape[1] + 2
    assert torch.allclose(slot_in[:, 0], model.capsule_vectors[1].expand(2, -1))  # the learned slot, alone
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 9)


@pytest.mark.parametrize(("variant", "extra"), [("extract", 32 * 3 + 32), ("project", 2 * 32 * 8)])
def test_extract_and_project_add_counted_trainable_modules(variant, extra):
    model = capt.get_capt_model(build("llama"), capt.CaptConfig(variant=variant))
    assert model.get_nb_trainable_parameters()[0] == 3 * 32 + extra
    per_layer = capt.get_capt_model(build("llama"), capt.CaptConfig(variant=variant, share_instance_module=False))
    assert per_layer.get_nb_trainable_parameters()[0] == 3 * 32 + 3 * extra


def test_untrained_extract_equals_add():
    """The convolution starts as the identity, so the summary is the plain mean."""
    inputs = batch_inputs("bert-cls")
    outputs = []
    for variant in ("add", "extract"):
        model = capt.get_capt_model(build("bert-cls"), capt.CaptConfig(variant=variant))
        randomize_capsules(model)  # also perturbs the conv: restore the identity
        if variant == "extract":
            conv = model.capsules.instance_modules[0].conv
            with torch.no_grad():
                conv.weight.zero_()
                conv.weight[:, 0, 1] = 1
                conv.bias.zero_()
        with torch.no_grad():
            outputs.append(model(**inputs).logits)
    assert torch.allclose(*outputs, atol=1e-5)


@pytest.mark.parametrize("variant", ["extract", "project"])
def test_variant_modules_receive_gradients(variant):
    model = capt.get_capt_model(build("bert-cls"), capt.CaptConfig(variant=variant))
    randomize_capsules(model)
    model.train()
    inputs = batch_inputs("bert-cls")
    model(**inputs, labels=torch.tensor([0, 1])).loss.backward()
    for name, param in model.capsules.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_deep_prompt_tuning_is_m_task_slots_without_the_instance_mean():
    model = capt.get_capt_model(build("llama"), capt.CaptConfig(num_slots=4, instance_aware=False))
    randomize_capsules(model)
    assert model.capsule_vectors.shape == (3, 4, 32)
    seen = []
    model.base_model.model.layers[2].register_forward_pre_hook(
        lambda m, a, k: seen.append((a[0] if a else k["hidden_states"]).clone()), with_kwargs=True
    )
    inputs = batch_inputs("llama")
    with torch.no_grad():
        out = model(**inputs).logits
    assert out.shape == (2, 6, 101)
    assert torch.allclose(seen[0][:, :4], model.capsule_vectors[2].expand(2, -1, -1))


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="variant"):
        capt.CaptConfig(variant="multiply")
    with pytest.raises(ValueError, match="num_slots"):
        capt.CaptConfig(num_slots=0)
    with pytest.raises(ValueError, match="target"):
        capt.get_capt_model(build("llama"), capt.CaptConfig(target="encoder"))
    with pytest.raises(ValueError, match="modules_to_save"):
        capt.get_capt_model(build("bert-cls"), capt.CaptConfig(modules_to_save=["nope"]))
