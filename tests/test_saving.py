"""disable_adapter, save/load round trips, and clear errors for adapters that do not fit."""

import json

import pytest
import torch
from conftest import BUILDERS, batch_inputs, bert_config, build, randomize_capsules, tiny_bert_classifier
from transformers import BertForSequenceClassification

import capt


@pytest.mark.parametrize("name", [n for n in BUILDERS if n != "minilm-cls"])
def test_disable_adapter_gives_exactly_the_base_model(name):
    base = build(name)
    inputs = batch_inputs(name)
    with torch.no_grad():
        expected = base(**inputs)
    model = capt.get_capt_model(base)
    randomize_capsules(model)
    for head in (model.base_model.get_submodule(n) for n in ("classifier", "score") if hasattr(base, n)):
        with torch.no_grad():
            for param in head.parameters():
                param.add_(1.0)  # a trained head must not leak into the disabled model
    with torch.no_grad(), model.disable_adapter():
        got = model(**inputs)
    main = "logits" if "logits" in expected else "last_hidden_state"
    assert torch.equal(got[main], expected[main])
    if name in ("llama", "t5"):
        kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        inputs.pop("labels", None)
        with model.disable_adapter():
            assert torch.equal(model.generate(**inputs, **kwargs), base.generate(**inputs, **kwargs))


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("bert-cls", capt.CaptConfig()),
        ("llama", capt.CaptConfig(variant="project", rank=4)),
        ("t5", capt.CaptConfig(variant="extract", target="both")),
        ("gpt2", capt.CaptConfig(num_slots=3, instance_aware=False)),
    ],
)
def test_save_then_load_gives_identical_outputs(name, config, tmp_adapter):
    model = capt.get_capt_model(build(name), config)
    randomize_capsules(model)
    if hasattr(model.base_model, "classifier"):
        with torch.no_grad():
            model.base_model.classifier.weight.add_(0.3)
    inputs = batch_inputs(name)
    with torch.no_grad():
        expected = model(**inputs).logits
    model.save_pretrained(tmp_adapter)
    assert sorted(p.name for p in tmp_adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    saved = json.loads((tmp_adapter / "adapter_config.json").read_text())
    assert saved["peft_type"] == "CAPT" and saved["variant"] == config.variant

    loaded = capt.CaptModel.from_pretrained(build(name), tmp_adapter)
    with torch.no_grad():
        got = loaded(**inputs).logits
    assert torch.equal(got, expected)
    assert loaded.get_nb_trainable_parameters()[0] == 0  # inference by default
    trainable = capt.CaptModel.from_pretrained(build(name), tmp_adapter, is_trainable=True)
    assert trainable.get_nb_trainable_parameters()[0] == model.get_nb_trainable_parameters()[0]


def _other_bert(**changes):
    return BertForSequenceClassification(bert_config(**changes))


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: _other_bert(hidden_size=48), "hidden_size"),
        (lambda: _other_bert(num_hidden_layers=2), "num_capsule_layers"),
        (lambda: BUILDERS["roberta-cls"](), "model_type"),
    ],
)
def test_loading_into_an_incompatible_model_says_what_differs(other, message, tmp_adapter):
    capt.get_capt_model(tiny_bert_classifier()).save_pretrained(tmp_adapter)
    base = other()
    with pytest.raises(ValueError, match=message):
        capt.CaptModel.from_pretrained(base, tmp_adapter)
    # The failed load leaves the base model untouched and reusable.
    capt.get_capt_model(base)


def test_truncated_or_corrupt_weights_raise_a_clear_error(tmp_adapter):
    capt.get_capt_model(build("llama")).save_pretrained(tmp_adapter)
    weights = tmp_adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        capt.CaptModel.from_pretrained(build("llama"), tmp_adapter)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        capt.CaptModel.from_pretrained(build("llama"), tmp_adapter)


def test_only_safetensors_are_read_unless_pickle_is_allowed(tmp_adapter):
    model = capt.get_capt_model(build("llama"))
    randomize_capsules(model)
    model.save_pretrained(tmp_adapter)
    (tmp_adapter / "adapter_model.safetensors").unlink()
    torch.save(model.adapter_state_dict(), tmp_adapter / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors only unless you pass allow_pickle=True"):
        capt.CaptModel.from_pretrained(build("llama"), tmp_adapter)
    loaded = capt.CaptModel.from_pretrained(build("llama"), tmp_adapter, allow_pickle=True)
    assert torch.equal(loaded.capsule_vectors, model.capsule_vectors)


def test_config_file_errors_name_the_file(tmp_adapter):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        capt.CaptModel.from_pretrained(build("llama"), tmp_adapter)
    tmp_adapter.mkdir()
    (tmp_adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json"):
        capt.CaptModel.from_pretrained(build("llama"), tmp_adapter)
    (tmp_adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "CAPT", "colour": "red"}))
    with pytest.raises(ValueError, match="colour"):
        capt.CaptModel.from_pretrained(build("llama"), tmp_adapter)


def test_a_model_takes_one_adapter_until_unloaded():
    base = build("llama")
    model = capt.get_capt_model(base)
    with pytest.raises(ValueError, match="unload"):
        capt.get_capt_model(base)
    assert model.unload() is base
    capt.get_capt_model(base)


def test_an_atomic_write_gives_the_mode_open_would_and_keeps_an_existing_files(tmp_path):
    import os

    from capt.saving import atomic_write_text

    umask = os.umask(0o022)
    os.umask(umask)
    fresh, kept = tmp_path / "results.json", tmp_path / "private.json"
    atomic_write_text(fresh, "{}\n")  # mkstemp alone would leave it 0o600, unreadable to a colleague or a server
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask
    kept.write_text("old\n")
    kept.chmod(0o640)
    atomic_write_text(kept, "new\n")
    assert kept.read_text() == "new\n" and kept.stat().st_mode & 0o777 == 0o640
