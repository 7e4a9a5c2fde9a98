"""Every supported family wraps, keeps the base model's output format, and counts parameters right."""

import pytest
import torch
from conftest import BUILDERS, DECODER_ONLY, batch_inputs, build, randomize_capsules, tiny_bert_model
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

import capt

EXPECTED_CAPSULE_LAYERS = {
    "bert": 3,
    "bert-cls": 3,
    "roberta-cls": 2,
    "t5": 2,
    "gpt2": 2,
    "llama": 3,
    "qwen2": 2,
    "minilm-cls": 6,
    "distilbert-cls": 2,
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_outputs_have_the_base_models_class_and_shapes(name):
    base = build(name)
    inputs = batch_inputs(name)
    with torch.no_grad():
        expected = base(**inputs, output_hidden_states=True, output_attentions=True)
    model = capt.get_capt_model(base)
    randomize_capsules(model)
    with torch.no_grad():
        got = model(**inputs, output_hidden_states=True, output_attentions=True)

    assert type(got) is type(expected)
    assert list(got.keys()) == list(expected.keys())
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].shape == value.shape, key
        elif isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
            assert [t.shape for t in got[key]] == [t.shape for t in value], key
    # The capsules change the result (they are really there) ...
    main = "logits" if "logits" in expected else "last_hidden_state"
    assert not torch.allclose(got[main], expected[main], atol=1e-4)
    assert model.capsule_vectors.shape[0] == EXPECTED_CAPSULE_LAYERS[name]


@pytest.mark.parametrize("name", DECODER_ONLY + ("t5",))
def test_generate_returns_the_base_format(name):
    base = build(name)
    inputs = batch_inputs(name)
    inputs.pop("labels", None)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = base.generate(**inputs, **kwargs)
    model = capt.get_capt_model(base)
    randomize_capsules(model)
    got = model.generate(**inputs, **kwargs)
    assert got.shape == expected.shape
    if name in DECODER_ONLY:  # the prompt comes back unchanged, without the slot
        assert torch.equal(got[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])
    dict_output = model.generate(**inputs, **kwargs, return_dict_in_generate=True)
    assert torch.equal(dict_output.sequences, got)


def test_bert_pooler_reads_cls_not_the_slot():
    model = capt.get_capt_model(build("bert"))
    randomize_capsules(model, std=3.0)
    inputs = batch_inputs("bert")
    with torch.no_grad():
        out = model(**inputs)
        pooler = model.base_model.pooler
        assert torch.allclose(out.pooler_output, pooler.activation(pooler.dense(out.last_hidden_state[:, 0])))
    assert out.last_hidden_state.shape[1] == inputs["input_ids"].shape[1]


def test_unsupported_model_names_layers_path():
    base = tiny_bert_model()
    base.config.num_hidden_layers = 99  # no ModuleList of that length: discovery must give up
    with pytest.raises(ValueError, match="layers_path"):
        capt.get_capt_model(base)
    model = capt.get_capt_model(base, capt.CaptConfig(layers_path="encoder.layer"))
    assert model.capsule_vectors.shape == (3, 32)
    with pytest.raises(ValueError, match="layers_path='encoder.nope'"):
        capt.get_capt_model(tiny_bert_model(), capt.CaptConfig(layers_path="encoder.nope"))


def test_lm_trainable_count_is_layers_times_hidden():
    model = capt.get_capt_model(build("llama"))
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == 3 * 32
    assert total == sum(p.numel() for p in model.base_model.parameters()) + trainable
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["capsules.vectors"]


def test_classifier_head_is_trained_by_default_and_reported_separately():
    model = capt.get_capt_model(build("bert-cls"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"capsules.vectors", "base_model.classifier.weight", "base_model.classifier.bias"}


def _paper_count(config, cls):
    with torch.device("meta"):
        base = cls(config)
    trainable, total = capt.get_capt_model(base).get_nb_trainable_parameters()
    return trainable, round(100 * trainable / total, 4)


def test_paper_parameter_counts_from_configs_on_the_meta_device():
    t5_base = T5Config(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, vocab_size=32128)
    t5_large = T5Config(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64, vocab_size=32128)
    llama_1b = LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    )
    assert _paper_count(t5_base, T5ForConditionalGeneration) == (9216, 0.0041)
    assert _paper_count(t5_large, T5ForConditionalGeneration) == (24576, 0.0033)
    assert _paper_count(llama_1b, LlamaForCausalLM) == (32768, 0.0027)


def test_qwen_like_config_counts_from_auto_config():
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    assert capt.get_capt_model(base).get_nb_trainable_parameters()[0] == 4 * 64
