"""TRL's SFTTrainer with `peft_config=capt.CaptConfig(...)`: trains and saves a CaPT adapter whose instance is the
prompt (the loss on the answer), reloads in a fresh process to the same logits, and refuses packed batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

trl = pytest.importorskip("trl")

import capt  # noqa: E402
from capt.recipes.backbones import load_backbone  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# A chat template for the tiny model's tokenizer (MiniLM's has none), with TRL's `{% generation %}` markers around
# each answer: the tokens `assistant_only_loss` trains on. Nothing follows the last answer, so a row's prompt is
# exactly what `generate` reads after `add_generation_prompt`.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "[SEP]{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# The fresh process: the base model again, the saved adapter through PEFT, logits of the same inputs.
RELOAD = """
import sys, torch, peft
import capt
from capt.recipes.backbones import load_backbone
base = load_backbone(sys.argv[1]).model.eval()
model = peft.PeftModel.from_pretrained(base, sys.argv[2]).eval()
with torch.no_grad():
    torch.save(model(**torch.load(sys.argv[3])).logits, sys.argv[4])
"""


def _chats(count: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"what comes after {i}?"}, {"role": "assistant", "content": f"{i + 1} does"}]
        for i in range(count)
    ]


def _dataset(shape: str, count: int = 8) -> datasets.Dataset:
    """`messages` rows, or the same chats as conversational prompt/completion rows (the answer is the completion)."""
    if shape == "messages":
        return datasets.Dataset.from_list([{"messages": chat} for chat in _chats(count)])
    return datasets.Dataset.from_list([{"prompt": chat[:-1], "completion": chat[-1:]} for chat in _chats(count)])


def _tiny():
    backbone = load_backbone("tiny-llama")
    backbone.tokenizer.eos_token = "[SEP]"  # the tiny model's EOS id (MiniLM's tokenizer names none)
    backbone.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return backbone


def _trainer(backbone, dataset, tmp_path: Path, route: str = "peft", **settings) -> trl.SFTTrainer:
    """An SFTTrainer given CaPT as TRL's `peft_config`, or (route "capt") given a CaptModel."""
    args = dict(
        output_dir=str(tmp_path / "sft"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=0.3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        gradient_checkpointing=False,  # Trainer would switch it on for the shared SmolLM2 fixture for good
        bf16=False,  # TRL's default autocasts even on CPU; the fresh process compares in float32
        assistant_only_loss="messages" in dataset.column_names,
    )
    config = capt.CaptConfig(task_type="CAUSAL_LM")
    return trl.SFTTrainer(
        model=capt.get_capt_model(backbone.model, config) if route == "capt" else backbone.model,
        args=trl.SFTConfig(**{**args, **settings}),
        train_dataset=dataset,
        processing_class=backbone.tokenizer,
        peft_config=None if route == "capt" else config,
    )


def _reloaded_logits(backbone_name: str, adapter: Path, inputs: dict, tmp_path: Path) -> torch.Tensor:
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = [backbone_name, str(adapter), str(tmp_path / "inputs.pt"), str(tmp_path / "logits.pt")]
    subprocess.run([sys.executable, "-c", RELOAD, *argv], check=True, env=env, cwd=tmp_path, timeout=300)
    return torch.load(tmp_path / "logits.pt")


def _logits_tolerance(logits: torch.Tensor) -> float:
    """How far two float32 computations of the same logits may differ. GEMM blocking changes with the sequence length,
    the thread count and the CPU: SmolLM2's logits (up to about 43) moved by 9e-5 on an Intel Xeon, and by under
    1e-5 on an AMD EPYC; so 5e-6 of the largest logit, and never under 1e-5."""
    return max(1e-5, 5e-6 * logits.abs().max().item())


def _prompt_is_the_instance(model, batch: dict) -> None:
    """In the training forward, the prompt's logits equal those of the prompt alone (the answer left out of the
    capsule mean, as at `generate` time); with every token an instance token they would not. TRL trains through
    its fused LM head (`fused_lm_head=True`: log-probabilities without logits); its loss is the same."""
    row = {k: v[:1] for k, v in batch.items()}
    prompt_length = int((row["labels"][0] != -100).int().argmax())
    with torch.no_grad():
        trained = model(**row)
        alone = model(input_ids=row["input_ids"][:, :prompt_length]).logits[0]
        whole = model(input_ids=row["input_ids"], attention_mask=row["attention_mask"]).logits
        fused_loss = model(**row, fused_lm_head=True).loss
    tolerance = _logits_tolerance(alone)
    torch.testing.assert_close(trained.logits[0, :prompt_length], alone, atol=tolerance, rtol=1e-5)
    assert (whole[0, :prompt_length] - alone).abs().max() > 1e-3 + 10 * tolerance  # what a leaked answer does
    torch.testing.assert_close(fused_loss, trained.loss, atol=1e-5, rtol=1e-5)
    whole_loss = torch.nn.functional.cross_entropy(whole[0, :-1], row["labels"][0, 1:], ignore_index=-100)
    assert abs(whole_loss - fused_loss) > 1e-4


def _check_trains_saves_and_reloads(backbone, name: str, trainer: trl.SFTTrainer, tmp_path: Path) -> None:
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (saved["peft_type"], saved["task_type"]) == ("CAPT", "CAUSAL_LM")
    model = trainer.model.eval()
    assert model.capsule_vectors.abs().max() > 0  # trained away from the zero init

    batch = next(iter(trainer.get_train_dataloader()))
    _prompt_is_the_instance(model, batch)
    batch = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        in_memory = model(**batch).logits
    reloaded = _reloaded_logits(name, tmp_path / "adapter", batch, tmp_path)
    torch.testing.assert_close(reloaded, in_memory, atol=_logits_tolerance(in_memory), rtol=1e-5)


@pytest.mark.parametrize(
    ("shape", "route"), [("messages", "peft"), ("prompt-completion", "peft"), ("messages", "capt")]
)
def test_sft_trains_a_capt_adapter_on_the_answer_that_reloads_in_a_fresh_process(shape, route, tmp_path):
    backbone = _tiny()
    trainer = _trainer(backbone, _dataset(shape), tmp_path, route)
    _check_trains_saves_and_reloads(backbone, "tiny-llama", trainer, tmp_path)


@pytest.mark.parametrize(
    "settings", [{"packing": True}, {"padding_free": True, "max_length": None}], ids=["packing", "padding-free"]
)
def test_packed_and_padding_free_batches_are_refused(settings, tmp_path):
    trainer = _trainer(_tiny(), _dataset("messages"), tmp_path, **settings)
    with pytest.raises(ValueError, match=r"several sequences .* SFTConfig\(packing=False, padding_free=False\)"):
        trainer.train()


def test_sft_on_smollm2_chat_data(smollm2, tmp_path):
    """SmolLM2's chat template has no `{% generation %}` markers (TRL cannot patch it for `assistant_only_loss`):
    its `messages` rows train as prompt/completion rows, the last answer the completion."""
    chats = datasets.Dataset.from_list([{"messages": chat} for chat in _chats(4)])
    rows = chats.map(
        lambda r: {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]}, remove_columns="messages"
    )
    trainer = _trainer(smollm2, rows, tmp_path, max_steps=2, per_device_train_batch_size=2, learning_rate=0.01)
    try:
        _check_trains_saves_and_reloads(smollm2, "smollm2", trainer, tmp_path)
    finally:
        trainer.model.unload()  # the session's SmolLM2 goes back without hooks
