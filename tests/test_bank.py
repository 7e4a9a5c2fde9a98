"""Capsule banks: several task adapters on one frozen model, and batches that mix tasks row by row."""

import peft
import pytest
import torch
from conftest import batch_inputs, build, randomize_capsules

import capt
from capt.bank import load_bank

GREEDY = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
ROWS = ["a", "b", "a"]  # the task of each example in the mixed batches below


def _saved_adapters(name: str, tmp_path) -> dict[str, object]:
    """Two trained-looking adapters (capsules and, for classifiers, heads), saved by name."""
    paths = {}
    for seed, task in enumerate(("a", "b"), start=1):
        model = capt.get_capt_model(build(name))
        randomize_capsules(model, seed=seed)
        for head in (model.base_model.get_submodule(n) for n in ("classifier",) if hasattr(model.base_model, n)):
            with torch.no_grad():
                for param in head.parameters():
                    param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
        model.save_pretrained(tmp_path / task)
        paths[task] = tmp_path / task
    return paths


def _mixed_inputs(name: str) -> dict[str, torch.Tensor]:
    inputs = batch_inputs(name, batch=len(ROWS))
    inputs.pop("labels", None)
    if name == "t5":
        inputs["decoder_input_ids"] = torch.zeros(len(ROWS), 2, dtype=torch.long)
    return inputs


def _row(inputs: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {k: v[i : i + 1] for k, v in inputs.items()}


@pytest.mark.parametrize("name", ["bert-cls", "t5", "llama"])
def test_a_mixed_batch_gives_each_row_what_its_adapter_gives_alone(name, tmp_path):
    bank = load_bank(build(name), _saved_adapters(name, tmp_path))
    inputs = _mixed_inputs(name)
    with torch.no_grad():
        mixed = bank(**inputs, adapter_names=ROWS).logits
        for i, task in enumerate(ROWS):
            bank.set_adapter(task)
            alone = bank(**_row(inputs, i)).logits
            assert torch.allclose(mixed[i], alone[0], atol=1e-5), (i, task)
        assert not torch.allclose(mixed[0], bank(**_row(inputs, 0), adapter_names=["b"]).logits[0], atol=1e-4)


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_mixed_generation_gives_each_row_what_its_adapter_generates_alone(name, tmp_path):
    bank = load_bank(build(name), _saved_adapters(name, tmp_path))
    prompts = _mixed_inputs(name)
    prompts.pop("decoder_input_ids", None)
    scored = dict(GREEDY, output_scores=True, return_dict_in_generate=True)
    mixed = bank.generate(**prompts, adapter_names=ROWS, **scored)
    for i, task in enumerate(ROWS):
        bank.set_adapter(task)
        alone = bank.generate(**_row(prompts, i), **scored)
        assert torch.equal(mixed.sequences[i], alone.sequences[0]), (i, task)
        assert all(torch.allclose(m[i], a[0], atol=1e-4) for m, a in zip(mixed.scores, alone.scores, strict=True)), (
            i,
            task,
        )
    other = bank.generate(**_row(prompts, 0), adapter_names=["b"], **scored)
    assert not torch.allclose(mixed.scores[0][0], other.scores[0][0], atol=1e-3)
    beams = bank.generate(**prompts, adapter_names=ROWS, num_beams=2, num_return_sequences=2, **GREEDY)
    assert beams.shape[0] == 2 * len(ROWS)


def test_a_decode_step_gives_each_row_its_own_adapters_head(tmp_path):
    """A step on a KV cache (what `capt serve` runs) names the rows' adapters again: per-adapter heads answer."""
    paths = {}
    for seed, task in enumerate(("a", "b"), start=1):
        model = capt.get_capt_model(build("llama"), capt.CaptConfig(modules_to_save=["lm_head"]))
        randomize_capsules(model, seed=seed)
        with torch.no_grad():
            model.base_model.lm_head.weight.normal_(generator=torch.Generator().manual_seed(seed))
        model.save_pretrained(tmp_path / task)
        paths[task] = tmp_path / task
    bank = load_bank(build("llama"), paths)
    prompts = batch_inputs("llama", batch=len(ROWS))
    step = {"input_ids": torch.tensor([[5], [6], [7]]), "attention_mask": torch.ones(len(ROWS), 7, dtype=torch.long)}

    def second_logits(rows: list[int], names: list[str] | None) -> torch.Tensor:
        """The logits of the first decode step after the prompts of `rows` (`names`: each row's adapter)."""
        prompt, token = ({k: v[rows] for k, v in inputs.items()} for inputs in (prompts, step))
        cache = bank(**prompt, adapter_names=names, use_cache=True).past_key_values
        return bank(**token, cache=cache, adapter_names=names).logits[:, -1]

    with torch.no_grad():
        mixed = second_logits([0, 1, 2], ROWS)
        for i, task in enumerate(ROWS):
            bank.set_adapter(task)  # alone, its head is the installed one
            assert torch.allclose(mixed[i], second_logits([i], None)[0], atol=1e-5), (i, task)
        bank.set_adapter("b")
        assert not torch.allclose(mixed[1], second_logits([1], ["a"])[0], atol=1e-3)


def test_the_bank_api(tmp_path):
    paths = _saved_adapters("bert-cls", tmp_path)
    bank = capt.CaptModel.from_pretrained(build("bert-cls"), paths["a"], adapter_name="a")
    bank.load_adapter(paths["b"], adapter_name="b")
    assert list(bank.adapter_configs) == ["a", "b"] and bank.active_adapter == "a"
    a_vectors = bank.capsule_vectors.clone()
    bank.set_adapter("b")
    assert not torch.equal(bank.capsule_vectors, a_vectors)
    assert torch.equal(bank.adapter_state_dict("a")["capsules.vectors"], a_vectors)
    assert bank.get_nb_trainable_parameters()[0] == 0  # loaded for inference
    with pytest.raises(ValueError, match="no adapter named 'c'"):
        bank(**batch_inputs("bert-cls"), adapter_names=["a", "c"])
    with pytest.raises(ValueError, match="one per example"):
        bank(**batch_inputs("bert-cls"), adapter_names=["a"])
    # Loading into a loaded name replaces its weights (as PEFT does; Trainer reloads checkpoints so).
    b_state = bank.adapter_state_dict("b")
    bank.load_adapter(paths["b"], adapter_name="a")
    a_state = bank.adapter_state_dict("a")
    assert a_state.keys() == b_state.keys() and all(torch.equal(a_state[k], b_state[k]) for k in a_state)
    with pytest.raises(ValueError, match="already loaded"):
        bank.add_adapter("a", capt.CaptConfig())
    bank.delete_adapter("a")
    assert list(bank.adapter_configs) == ["b"]


def test_each_task_costs_its_capsules_and_its_head():
    model = capt.get_capt_model(build("bert-cls"))
    before = sum(p.numel() for p in model.parameters())
    model.add_adapter("other", capt.CaptConfig())
    head = sum(p.numel() for p in model.base_model.classifier.parameters())
    assert sum(p.numel() for p in model.parameters()) - before == 3 * 32 + head


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (capt.CaptConfig(variant="prepend"), "slot count"),
        (capt.CaptConfig(num_slots=2, instance_aware=False), "slot count"),
        (capt.CaptConfig(target="both"), "other layers"),
        (capt.CaptConfig(modules_to_save=[]), "modules_to_save"),
    ],
)
def test_adapters_that_cannot_share_a_model_raise_a_clear_error(other, message):
    name = "bert-cls" if other.modules_to_save == [] else "t5"
    model = capt.get_capt_model(build(name))
    with pytest.raises(ValueError, match=message):
        model.add_adapter("other", other)
    assert list(model.adapter_configs) == ["default"]


def test_peft_mixes_tasks_in_one_batch_too(tmp_path):
    paths = _saved_adapters("bert-cls", tmp_path)
    model = peft.PeftModel.from_pretrained(build("bert-cls"), paths["a"], adapter_name="a")
    model.load_adapter(paths["b"], adapter_name="b")
    inputs = _mixed_inputs("bert-cls")
    reference = load_bank(build("bert-cls"), paths)
    with torch.no_grad():
        expected = reference(**inputs, adapter_names=ROWS).logits
        assert torch.allclose(model(**inputs, adapter_names=ROWS).logits, expected, atol=1e-5)
        model.set_adapter("b")
        assert torch.allclose(model(**_row(inputs, 1)).logits[0], expected[1], atol=1e-5)
    status = model.get_model_status()
    assert status.available_adapters == ["a", "b"] and status.active_adapters == ["b"]
    model.delete_adapter("a")
    assert list(model.peft_config) == ["b"] and model.active_adapter == "b"


def test_a_failed_bank_load_leaves_the_base_model_clean_for_a_retry(tmp_path):
    """A bad later adapter used to leave the first one's hooks behind: the retry said 'already attached'."""
    paths = _saved_adapters("llama", tmp_path)
    base = build("llama")
    with pytest.raises(Exception, match="missing"):
        load_bank(base, {"a": paths["a"], "b": tmp_path / "missing"})
    bank = load_bank(base, {"a": paths["a"], "b": paths["b"]})  # the retry attaches
    assert list(bank.adapter_configs) == ["a", "b"]
    with pytest.raises(TypeError, match="adapters must map names to adapter folders"):
        load_bank(build("llama"), [paths["a"]])
