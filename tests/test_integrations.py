"""CaPT where users already work: transformers.Trainer, PEFT's PeftModel and Auto classes, chat-style labels.

Each path runs on a tiny model; Trainer and AutoPeftModelForCausalLM also on the real SmolLM2, reloaded in a fresh
process (the session fixture `smollm2` loads it once).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import peft
import pytest
import torch
from conftest import batch_inputs, build
from safetensors.torch import load_file, save_file
from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

import capt

REPO = Path(__file__).resolve().parents[1]


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _rows(size: int = 8, length: int = 8, prompt: int = 4) -> list[dict[str, torch.Tensor]]:
    """Causal-LM rows whose loss is on the answer only (the prompt's labels are -100)."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(size):
        ids = torch.randint(3, 101, (length,), generator=generator)
        labels = torch.cat([torch.full((prompt,), -100), ids[prompt:]])
        rows.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels})
    return rows


def _args(output_dir: Path, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=0.1,
        save_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**settings, **overrides})


def _run_fresh(script: str) -> str:
    """Run `script` in a new Python process that imports this checkout; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ---------------------------------------------------------------------- transformers.Trainer


def _attach(route: str, base, config: capt.CaptConfig):
    """The two ways to give Trainer a CaPT model: PEFT's get_peft_model, or capt's own CaptModel."""
    return peft.get_peft_model(base, config) if route == "peft" else capt.get_capt_model(base, config)


ROUTES = ["peft", "capt"]


@pytest.mark.parametrize("route", ROUTES)
def test_trainer_saves_checkpoints_and_the_final_model_as_adapters_and_resumes_from_them(route, tmp_path):
    model = _attach(route, build("llama"), capt.CaptConfig(init="normal"))
    trainer = Trainer(model=model, args=_args(tmp_path / "run"), train_dataset=_rows())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "run" / "checkpoint-1", tmp_path / "run" / "checkpoint-2", tmp_path / "final"):
        names = {p.name for p in folder.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
        assert json.loads((folder / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    inputs = batch_inputs("llama")
    expected = _logits(model, inputs)
    reloaded = capt.CaptModel.from_pretrained(build("llama"), tmp_path / "final")
    torch.testing.assert_close(_logits(reloaded, inputs), expected, rtol=0, atol=1e-6)

    # Resuming from the first checkpoint continues from its capsules and ends where the uninterrupted run ended.
    resumed = _attach(route, build("llama"), capt.CaptConfig(init="normal"))
    Trainer(model=resumed, args=_args(tmp_path / "run"), train_dataset=_rows()).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1")
    )
    torch.testing.assert_close(_logits(resumed, inputs), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("route", ROUTES)
def test_load_best_model_at_end_reloads_the_best_checkpoints_adapter(route, tmp_path):
    evaluations = []

    def first_is_best(_):  # the first evaluation scores highest, so the best checkpoint is not the last
        evaluations.append(1)
        return {"rank": -len(evaluations)}

    model = _attach(route, build("llama"), capt.CaptConfig(init="normal"))
    args = _args(
        tmp_path / "run",
        max_steps=3,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="rank",
        greater_is_better=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=_rows(), eval_dataset=_rows(4), compute_metrics=first_is_best
    )
    trainer.train()
    assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-1"
    trainer.save_model(str(tmp_path / "final"))
    final = load_file(tmp_path / "final" / "adapter_model.safetensors")
    best = load_file(tmp_path / "run" / "checkpoint-1" / "adapter_model.safetensors")
    last = load_file(tmp_path / "run" / "checkpoint-3" / "adapter_model.safetensors")
    assert final.keys() == best.keys() and all(torch.equal(final[k], best[k]) for k in final)
    assert not all(torch.equal(final[k], last[k]) for k in final)  # the reload changed the model
    assert any(p.requires_grad for p in model.parameters())  # and left the adapter trainable


def test_a_checkpoint_of_another_method_is_not_loaded_into_an_adapter(tmp_path):
    capt.get_capt_model(build("llama"), capt.CaptConfig(num_slots=2, instance_aware=False)).save_pretrained(tmp_path)
    model = capt.get_capt_model(build("llama"), capt.CaptConfig())
    with pytest.raises(ValueError, match=r"another method than the loaded one \(num_slots: 2 != 1; instance_aware"):
        model.load_adapter(tmp_path, "default")


def test_a_capt_model_is_a_peft_model_to_trainer_and_says_so_in_peft_terms():
    base = build("llama")
    model = capt.get_capt_model(base, capt.CaptConfig())
    assert isinstance(model, peft.PeftModel)
    assert model.get_base_model() is base and model.active_adapters == ["default"]
    assert model.peft_config == {"default": model.capt_config} and not model.peft_config["default"].is_prompt_learning
    with pytest.raises(ValueError, match=r"takes no state_dict .* peft.get_peft_model"):
        model.save_pretrained("unused", state_dict=model.state_dict())
    with pytest.raises(TypeError, match=r"already a CaptModel"):
        capt.get_capt_model(model, capt.CaptConfig())


@pytest.mark.parametrize("route", ["optimizers", "optimizer_cls_and_kwargs"])
def test_param_groups_give_trainer_one_learning_rate_for_the_capsules_and_another_for_the_head(route, tmp_path):
    model = peft.get_peft_model(build("bert-cls"), capt.CaptConfig())
    rows = [{**row, "labels": torch.tensor(i % 3)} for i, row in enumerate(_rows())]
    groups = capt.param_groups(model, lr=0.3, head_lr=1e-3)
    if route == "optimizers":
        optimizer = {"optimizers": (torch.optim.AdamW(groups), None)}
    else:  # Trainer builds the optimizer itself, from the groups given as `params`
        optimizer = {"optimizer_cls_and_kwargs": (torch.optim.AdamW, {"params": groups})}
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=rows, **optimizer)
    trainer.train()
    by_rate = {g["initial_lr"]: {id(p) for p in g["params"]} for g in trainer.optimizer.param_groups}
    heads = {id(p) for n, p in model.named_parameters() if p.requires_grad and ".classifier." in n}
    capsules = {id(p) for n, p in model.named_parameters() if p.requires_grad and "capt_capsules" in n}
    assert by_rate == {0.3: capsules, 1e-3: heads} and heads and capsules


def test_the_library_and_the_recipe_split_parameters_by_one_rule():
    """`capt train` builds its optimizer from capt.param_groups: a head beside capsules takes --head-lr."""
    from capt.recipes.run import RunConfig
    from capt.recipes.train import _optimizer

    model = capt.get_capt_model(build("bert-cls"))
    recipe = _optimizer(model, RunConfig(method="capt", lr=0.3, head_lr=1e-3)).param_groups
    library = capt.param_groups(model, lr=0.3, head_lr=1e-3)
    assert [(g["lr"], [id(p) for p in g["params"]]) for g in recipe] == [
        (g["lr"], [id(p) for p in g["params"]]) for g in library
    ]


# ---------------------------------------------------------------------- task types and PEFT's loaders


@pytest.mark.parametrize(
    ("name", "task_type"),
    [("llama", "CAUSAL_LM"), ("bert-cls", "SEQ_CLS"), ("t5", "SEQ_2_SEQ_LM"), ("bert", "FEATURE_EXTRACTION")],
)
@pytest.mark.parametrize("path", ["core", "peft"])
def test_saved_adapters_carry_the_task_type_of_their_model_class(name, task_type, path, tmp_adapter):
    config = capt.CaptConfig()
    model = capt.get_capt_model(build(name), config) if path == "core" else peft.get_peft_model(build(name), config)
    model.save_pretrained(tmp_adapter)
    assert json.loads((tmp_adapter / "adapter_config.json").read_text())["task_type"] == task_type


def test_a_task_type_the_user_gave_is_kept(tmp_adapter):
    capt.get_capt_model(build("llama"), capt.CaptConfig(task_type="FEATURE_EXTRACTION")).save_pretrained(tmp_adapter)
    assert json.loads((tmp_adapter / "adapter_config.json").read_text())["task_type"] == "FEATURE_EXTRACTION"


def _saved_base_and_adapter(name: str, folder: Path):
    """A tiny base saved to disk (the adapter records its path, as it would a Hub id) and a CaptModel adapter."""
    base = build(name)
    base.save_pretrained(folder / "base")
    base = type(base).from_pretrained(folder / "base").eval()
    model = capt.get_capt_model(base, capt.CaptConfig(init="normal"))
    for param in model.parameters():
        if param.requires_grad:  # a trained head as well as capsules
            param.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    model.save_pretrained(folder / "adapter")
    return model


@pytest.mark.parametrize(
    ("name", "auto_class"),
    [("llama", peft.AutoPeftModelForCausalLM), ("bert-cls", peft.AutoPeftModelForSequenceClassification)],
)
def test_peft_auto_classes_and_peft_model_load_a_capt_adapter(name, auto_class, tmp_path):
    model = _saved_base_and_adapter(name, tmp_path)
    inputs = batch_inputs(name)
    expected = _logits(model, inputs)
    auto = auto_class.from_pretrained(tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(auto, inputs), expected, rtol=0, atol=1e-6)
    base = type(model.base_model).from_pretrained(tmp_path / "base").eval()
    plain = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert type(plain) is type(auto)  # the task type chose the class
    torch.testing.assert_close(_logits(plain, inputs), expected, rtol=0, atol=1e-6)


def test_peft_without_import_capt_stops_on_the_unknown_type(tmp_path):
    """PEFT has no plugin hook (no entry point): its type table knows CAPT only once `import capt` ran (a fresh
    process with `import capt` loads it: the SmolLM2 test below)."""
    _saved_base_and_adapter("llama", tmp_path)
    load = f"from peft import AutoPeftModelForCausalLM as Auto; Auto.from_pretrained({str(tmp_path / 'adapter')!r})"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    failed = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0 and failed.stderr.strip().endswith("KeyError: 'CAPT'")


# ---------------------------------------------------------------------- folders that are not CaPT adapters


def test_another_peft_methods_adapter_is_named_in_one_line(tmp_path):
    peft.get_peft_model(build("llama"), peft.LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp_path)
    for load in (capt.CaptConfig.from_pretrained, lambda p: capt.CaptModel.from_pretrained(build("llama"), p)):
        with pytest.raises(ValueError) as error:
            load(tmp_path)
        assert str(error.value) == (
            f"{tmp_path / 'adapter_config.json'}: this is a LORA adapter (peft_type LORA), not CaPT; "
            "load it with peft.PeftModel.from_pretrained"
        )


def test_folders_that_are_not_adapters_say_what_they_are(tmp_path):
    build("llama").save_pretrained(tmp_path / "full")
    (tmp_path / "empty").mkdir()
    (tmp_path / "trainer").mkdir()  # what Trainer saves for a plain torch module (and did for a capt 0.3 CaptModel)
    save_file({"weight": torch.zeros(2)}, tmp_path / "trainer" / "model.safetensors")
    expected = {
        "full": "it holds a full transformers model (config.json, model_type llama), not an adapter",
        "empty": "it is an empty folder",
        "trainer": "it holds a full state dict (model.safetensors), as transformers.Trainer saves a plain torch module",
        "missing": "the path does not exist",
    }
    for folder, what in expected.items():
        with pytest.raises(
            FileNotFoundError, match=rf"^no adapter_config\.json in .*{folder}: {re.escape(what)}"
        ) as error:
            capt.CaptModel.from_pretrained(build("llama"), tmp_path / folder)
        assert "\n" not in str(error.value)


# ---------------------------------------------------------------------- instance tokens from causal-LM labels


def test_a_multi_turn_row_keeps_later_turns_out_of_the_capsule_mean():
    """Labels on two answers: the second user turn (labelled -100, after the first answer) must not enter the mean,
    or the first answer's logits would depend on a turn that comes after it."""
    model = capt.get_capt_model(build("llama"), capt.CaptConfig(init="normal"))
    prompt, answer, later_turn, second_answer = [5, 6, 7], [8, 9], [10, 11], [12]
    ids = torch.tensor([prompt + answer + later_turn + second_answer])
    other_turn = ids.clone()
    other_turn[0, 5:7] = torch.tensor([40, 41])
    labels = torch.tensor([[-100] * 3 + answer + [-100, -100] + second_answer])
    with torch.no_grad():
        first = model(input_ids=ids, labels=labels).logits[:, :5]
        changed = model(input_ids=other_turn, labels=labels).logits[:, :5]
        # The earlier rule (every -100 token) let the later turn in; spelled out as an explicit instance mask:
        leaky = [model(input_ids=i, instance_mask=labels == -100).logits[:, :5] for i in (ids, other_turn)]
    torch.testing.assert_close(first, changed, rtol=0, atol=1e-6)
    assert not torch.allclose(*leaky, atol=1e-4)


def test_whole_sequence_labels_warn_once_and_are_refused_when_no_row_has_a_prompt():
    model = capt.get_capt_model(build("llama"))
    ids = batch_inputs("llama")["input_ids"]
    masked = ids.clone()
    masked[:, :3] = -100
    with pytest.raises(ValueError, match=r"no row of this causal-LM batch .* set the prompt's labels to -100"):
        model(input_ids=ids, labels=ids)
    one_bad = torch.stack([ids[0], masked[1]])
    with pytest.warns(UserWarning, match=r"rows \[0\] of a causal-LM batch have no token before their first target"):
        model(input_ids=ids, labels=one_bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next such batch is quiet
        model(input_ids=ids, labels=one_bad)
        # An explicit instance_mask is the other fix: it says which tokens are the instance, whatever the labels.
        prompt_only = torch.zeros_like(ids)
        prompt_only[:, :3] = 1
        with_mask = model(input_ids=ids, labels=ids, instance_mask=prompt_only).logits
    torch.testing.assert_close(with_mask, model(input_ids=ids, labels=masked).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("route", ROUTES)
def test_an_instance_mask_column_reaches_the_model_in_trainer_when_trainer_keeps_the_column(route, tmp_path):
    """Trainer keeps only the columns the base model's forward names, for a PeftModel: the refusal says so."""
    rows = [{**row, "labels": row["input_ids"], "instance_mask": (row["labels"] == -100).long()} for row in _rows()]
    model = _attach(route, build("llama"), capt.CaptConfig())
    with pytest.raises(ValueError, match=r"remove_unused_columns=False"):
        Trainer(model=model, args=_args(tmp_path / "dropped"), train_dataset=rows).train()
    kept = _args(tmp_path / "kept", remove_unused_columns=False)
    assert Trainer(model=model, args=kept, train_dataset=rows).train().training_loss > 0


# ---------------------------------------------------------------------- the real SmolLM2, reloaded in a new process


@pytest.mark.parametrize("route", ROUTES)
def test_smollm2_trained_by_trainer_reloads_in_a_fresh_process_with_peft_auto_class(route, smollm2, tmp_path):
    tokenizer = smollm2.tokenizer
    model = _attach(route, smollm2.model, capt.CaptConfig(init="normal"))
    try:
        encoded = tokenizer(["Question: is the sky blue? Answer: yes", "Question: is fire cold? Answer: no"])
        rows = []
        for ids in encoded["input_ids"]:
            labels = [-100] * (len(ids) - 1) + ids[-1:]  # the loss on the answer word only
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
        tokenizer.padding_side = "right"
        args = _args(tmp_path / "run", max_steps=2, learning_rate=0.05, per_device_train_batch_size=2)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=DataCollatorForSeq2Seq(tokenizer))
        trainer.train()
        trainer.save_model(str(tmp_path / "final"))
        adapter_bytes = (tmp_path / "final" / "adapter_model.safetensors").stat().st_size
        assert adapter_bytes < 100_000 and not (tmp_path / "final" / "model.safetensors").exists()
        trained = load_file(tmp_path / "final" / "adapter_model.safetensors")
        assert [tuple(t.shape) for t in trained.values()] == [(30, 576)]  # the capsules alone
        inputs = tokenizer(["The capital of France is"], return_tensors="pt")
        model.eval()
        expected = _logits(model, inputs)
    finally:
        model.unload()
    script = f"""
import capt, torch
from peft import AutoPeftModelForCausalLM
model = AutoPeftModelForCausalLM.from_pretrained({str(tmp_path / "final")!r}).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor({inputs["input_ids"].tolist()})).logits
torch.save(logits, {str(tmp_path / "logits.pt")!r})
print(type(model).__name__)
"""
    assert _run_fresh(script).strip() == "PeftModelForCausalLM"
    # float32 noise only: another process may sum SmolLM2's matmuls in another order (2e-4 seen on a loaded machine);
    # a lost or misplaced capsule moves these logits by whole units.
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=1e-3)


# ---------------------------------------------------------------------- the documentation runs as written


def _python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a Markdown page, except those marked `<!-- not run: ... -->`."""
    blocks, lines = [], page.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "```python" and not (i and lines[i - 1].startswith("<!-- not run")):
            end = lines.index("```", i + 1)
            blocks.append("\n".join(lines[i + 1 : end]))
    return blocks


@pytest.mark.parametrize("block", _python_blocks(REPO / "docs" / "integrations.md"))
def test_the_integrations_page_runs_as_written(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/integrations.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert out and "False" not in out  # the blocks print their checks
