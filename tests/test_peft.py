"""CaPT as a PEFT method: get_peft_model, save/load in either API, generation, Trainer, and stacking with LoRA."""

import inspect
import json
import subprocess
import sys

import peft
import pytest
import torch
from conftest import batch_inputs, build, randomize_capsules
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

import capt
from capt.heads import resolve_head_names
from capt.integrations.peft import CaptTuner, register

TASK_TYPES = {"bert-cls": "SEQ_CLS", "distilbert-cls": "SEQ_CLS", "t5": "SEQ_2_SEQ_LM", "llama": "CAUSAL_LM"}
GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)


def _labelled(name: str) -> dict[str, torch.Tensor]:
    inputs = batch_inputs(name)
    if name.endswith("-cls"):
        inputs["labels"] = torch.tensor([0, 2])
    elif name == "llama":
        inputs["labels"] = inputs["input_ids"].masked_fill(torch.arange(6) < 3, -100)
    return inputs


def _train_a_few_steps(model, inputs, steps: int = 3) -> None:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(**inputs).loss.backward()
        optimizer.step()
    model.eval()


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_registration_is_idempotent():
    register()
    register()
    assert peft.utils.PeftType.CAPT in list(peft.utils.PeftType)
    assert peft.mapping.PEFT_TYPE_TO_TUNER_MAPPING["CAPT"] is CaptTuner
    assert peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING["CAPT"] is capt.CaptConfig
    assert isinstance(capt.CaptConfig(), peft.PeftConfig)


@pytest.mark.parametrize("name", ["bert-cls", "distilbert-cls", "t5", "llama"])
def test_train_save_and_load_through_peft_give_identical_logits(name, tmp_adapter):
    inputs = _labelled(name)
    model = peft.get_peft_model(build(name), capt.CaptConfig(task_type=TASK_TYPES[name]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("capt_capsules.default" in n or "modules_to_save.default" in n for n in trainable)
    _train_a_few_steps(model, inputs)
    assert model.capsule_vectors.abs().sum() > 0  # the capsules were trained
    expected = _logits(model, inputs)
    assert expected.shape == build(name)(**inputs).logits.shape  # the slot never shows

    model.save_pretrained(tmp_adapter)
    assert json.loads((tmp_adapter / "adapter_config.json").read_text())["peft_type"] == "CAPT"
    assert (tmp_adapter / "adapter_model.safetensors").is_file()
    loaded = peft.PeftModel.from_pretrained(build(name), tmp_adapter)
    assert isinstance(loaded.base_model, CaptTuner)
    assert torch.equal(_logits(loaded, inputs), expected)
    assert loaded.get_nb_trainable_parameters()[0] == 0
    assert torch.equal(_logits(capt.CaptModel.from_pretrained(build(name), tmp_adapter), inputs), expected)


@pytest.mark.parametrize("name", ["bert-cls", "distilbert-cls", "llama"])
def test_an_adapter_saved_by_either_api_loads_in_the_other(name, tmp_path):
    inputs = _labelled(name)
    core = capt.get_capt_model(build(name))
    randomize_capsules(core)
    _train_a_few_steps(core, inputs, steps=1)  # the classifier head moves too
    expected = _logits(core, inputs)
    core.save_pretrained(tmp_path / "core")
    via_peft = peft.PeftModel.from_pretrained(build(name), tmp_path / "core")
    assert torch.equal(_logits(via_peft, inputs), expected)

    via_peft.save_pretrained(tmp_path / "peft")
    assert torch.equal(_logits(capt.CaptModel.from_pretrained(build(name), tmp_path / "peft"), inputs), expected)


def test_every_fresh_head_layer_trains_at_the_head_rate_and_absent_usual_names_are_skipped():
    """DistilBERT's randomly initialised `pre_classifier` trains with its `classifier`, in either API, at --head-lr.
    PEFT 0.22 names `pre_classifier` for every classifier: a BERT classifier, which has none, skips it."""
    core = capt.get_capt_model(build("distilbert-cls"))
    via_peft = peft.get_peft_model(build("distilbert-cls"), capt.CaptConfig(task_type="SEQ_CLS"))
    for model in (core, via_peft):
        groups = capt.param_groups(model, lr=0.3, head_lr=1e-3)
        head_group = {id(p) for g in groups if g["lr"] == 1e-3 for p in g["params"]}
        for layer in ("pre_classifier", "classifier"):
            trained = [p for n, p in model.named_parameters() if f".{layer}." in n and p.requires_grad]
            assert len(trained) == 2 and {id(p) for p in trained} <= head_group, (type(model).__name__, layer)
    peft_022_names = ["classifier", "score", "pre_classifier"]
    assert resolve_head_names(build("bert-cls"), peft_022_names) == ["classifier"]
    bert = peft.get_peft_model(build("bert-cls"), capt.CaptConfig(task_type="SEQ_CLS", modules_to_save=peft_022_names))
    assert {n.split(".")[2] for n, p in bert.named_parameters() if "modules_to_save" in n and p.requires_grad} == {
        "classifier"
    }
    with pytest.raises(ValueError, match="names 'pooler.dense', which"):
        resolve_head_names(build("distilbert-cls"), ["classifier", "pooler.dense"])


def test_every_module_trained_whole_takes_the_head_rate_whatever_its_name():
    """A module the user adds to `modules_to_save` (`pooler.dense`) trains whole, like the head, so it takes
    --head-lr in either API, for the active adapter and a stored one. Before, only the usual head names did, and the
    pooler trained at the capsules' rate."""
    config = {"modules_to_save": ["classifier", "pooler.dense"]}
    core = capt.get_capt_model(build("bert-cls"), capt.CaptConfig(**config))
    core.add_adapter("other", capt.CaptConfig(**config))
    via_peft = peft.get_peft_model(build("bert-cls"), capt.CaptConfig(task_type="SEQ_CLS", **config))
    for model in (core, via_peft):
        trainable = {n: id(p) for n, p in model.named_parameters() if p.requires_grad}
        whole = {i for n, i in trainable.items() if "pooler" in n or "classifier" in n}
        by_rate = {g["lr"]: {id(p) for p in g["params"]} for g in capt.param_groups(model, lr=0.3, head_lr=1e-3)}
        assert by_rate == {1e-3: whole, 0.3: set(trainable.values()) - whole}, type(model).__name__
        assert len(whole) == (8 if model is core else 4)  # weight and bias of two modules, per adapter


@pytest.mark.parametrize(("name", "task_type"), [("llama", "CAUSAL_LM"), ("llama", None), ("t5", None)])
def test_peft_generation_with_cache_equals_the_core(name, task_type):
    core = capt.get_capt_model(build(name))
    randomize_capsules(core)
    model = peft.get_peft_model(build(name), capt.CaptConfig(task_type=task_type))
    model.base_model.capsules.load_state_dict(core.capsules.state_dict())
    prompt = {k: v for k, v in batch_inputs(name).items() if k != "labels"}
    expected = core.generate(**prompt, **GREEDY)
    assert torch.equal(model.generate(**prompt, use_cache=True, **GREEDY), expected)
    assert torch.equal(model.generate(**prompt, use_cache=False, **GREEDY), expected)
    with model.disable_adapter():
        plain = build(name).generate(**prompt, **GREEDY)
        assert torch.equal(model.generate(**prompt, **GREEDY), plain)


def test_peft_keeps_causal_targets_out_of_the_capsule():
    model = peft.get_peft_model(build("llama"), capt.CaptConfig(task_type="CAUSAL_LM"))
    randomize_capsules(model.base_model)
    labels = torch.tensor([[-100, -100, -100, -100, 30, 31]])
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        first = model(input_ids=torch.cat([prompt, labels[:, 4:]], 1), labels=labels).logits
        other = model(input_ids=torch.cat([prompt, torch.tensor([[60, 61]])], 1), labels=labels).logits
    assert torch.allclose(first[:, :4], other[:, :4], atol=1e-6)


def test_smop_through_peft_gives_the_training_recipe_its_balancing_loss():
    from capt.recipes.backbones import load_backbone
    from capt.recipes.data import Example
    from capt.recipes.formats import make_format
    from capt.recipes.train import training_loss

    backbone = load_backbone("tiny-llama")
    options = {"num_prompts": 3, "length": 2, "noise_std": 0.0}  # no router noise: the two losses match
    config = capt.CaptConfig(task_type="CAUSAL_LM", prompt_method="smop", prompt_options=options)
    model = peft.get_peft_model(backbone.model, config).train()
    fmt = make_format(backbone.family, "rte", backbone.tokenizer, 64)
    examples = [Example("rte", i, {"premise": f"a b {i}", "hypothesis": "c d"}, i % 2) for i in range(4)]
    batch = fmt.collate([fmt.encode(ex) for ex in examples])
    total, auxiliary = training_loss(fmt, model, batch)
    assert auxiliary is not None and auxiliary.item() > 0
    torch.testing.assert_close(total, fmt.loss(model, batch) + auxiliary)
    model.eval()
    assert model.auxiliary_loss() is None  # evaluation adds no balancing loss


def test_merging_is_refused_with_a_clear_error_and_unload_restores_the_base():
    base = build("llama")
    inputs = batch_inputs("llama")
    expected = _logits(base, inputs)
    model = peft.get_peft_model(base, capt.CaptConfig())
    with pytest.raises(ValueError, match="cannot be merged"):
        model.merge_and_unload()
    assert torch.equal(_logits(model.unload(), inputs), expected)
    capt.get_capt_model(base)  # free for a new adapter


def _dataset(size: int = 8) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(size):
        ids = torch.randint(3, 101, (6,), generator=generator)
        labels = torch.cat([torch.full((3,), -100), ids[3:]])  # a 3-token prompt, the loss on the rest
        rows.append({"input_ids": ids, "attention_mask": torch.ones(6, dtype=torch.long), "labels": labels})
    return rows


def _capsules_in(checkpoint) -> torch.Tensor:
    files = {p.name: p for p in checkpoint.iterdir()}
    if "adapter_model.safetensors" in files:
        return load_file(files["adapter_model.safetensors"])["base_model.capt_layer.capt_capsules.vectors"]
    return load_file(files["model.safetensors"])["capsules.vectors"]


@pytest.mark.parametrize(("wrapper", "name"), [("peft", "llama"), ("core", "llama"), ("core", "t5")])
def test_trainer_load_best_model_at_end_restores_the_best_capsules(wrapper, name, tmp_path):
    """No extra dataset columns: the instance mask comes from attention_mask and labels. (T5 has tied weights.)"""
    config = capt.CaptConfig(task_type="CAUSAL_LM")
    model = peft.get_peft_model(build(name), config) if wrapper == "peft" else capt.get_capt_model(build(name))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=0.3,
        eval_strategy="steps",
        eval_steps=1,
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # the loss falls, so the best checkpoint is the first, not the last
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    data = _dataset()
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    best = tmp_path / "checkpoint-1"
    assert trainer.state.best_model_checkpoint == str(best)
    last = _capsules_in(tmp_path / "checkpoint-3")
    assert not torch.equal(_capsules_in(best), last)
    assert torch.equal(model.capsule_vectors.detach().cpu(), _capsules_in(best))


def test_tied_weights_are_saved_once_and_loaded_back():
    model = capt.get_capt_model(build("t5"))
    state = model.state_dict()
    assert "base_model.shared.weight" in state and "base_model.lm_head.weight" not in state
    model.load_state_dict(state, strict=True)


def test_trainer_keeps_the_base_models_input_columns():
    """Trainer drops dataset columns that forward's signature does not name; BERT needs token_type_ids."""
    names = inspect.signature(capt.get_capt_model(build("bert-cls")).forward).parameters
    assert {"input_ids", "token_type_ids", "labels", "instance_mask", "adapter_names"} <= set(names)


def test_capt_stacks_with_lora(tmp_path):
    inputs = _labelled("llama")
    base = build("llama")
    capsules = capt.get_capt_model(base)
    lora = peft.get_peft_model(base, peft.LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trainable = [n for n, p in capsules.named_parameters() if p.requires_grad]
    assert "capsules.vectors" in trainable and any("lora_A" in n for n in trainable)
    _train_a_few_steps(capsules, inputs)
    expected = _logits(capsules, inputs)
    capsules.save_pretrained(tmp_path / "capt")
    lora.save_pretrained(tmp_path / "lora")

    fresh = build("llama")
    peft.PeftModel.from_pretrained(fresh, tmp_path / "lora")
    both = capt.CaptModel.from_pretrained(fresh, tmp_path / "capt")
    assert torch.equal(_logits(both, inputs), expected)
    with both.disable_adapter():  # LoRA alone
        assert not torch.equal(_logits(both, inputs), expected)


def test_the_core_works_without_peft(tmp_path):
    script = f"""
import sys, torch
sys.modules["peft"] = None  # import peft now fails
import capt
from transformers import LlamaConfig, LlamaForCausalLM
def base():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))
assert not hasattr(capt.CaptConfig(), "task_type")
model = capt.get_capt_model(base(), capt.CaptConfig(init="normal"))
model.save_pretrained({str(tmp_path)!r})
again = capt.CaptModel.from_pretrained(base(), {str(tmp_path)!r})
ids = torch.tensor([[5, 6, 7]])
assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
