"""Every fine-tuning method the recipes compare, by name: the one registry `capt train`, `compare` and `bench` use.

`capt`, `capt-rms` (CaPT with `CaptConfig.mean_norm="rms"`: each instance token RMS-normalised before the
mean, as the authors' sister code MEPT does) and `deep-prompt` come from this library; `prompt` (Prompt Tuning),
`ptv2` (P-Tuning v2 / prefix tuning), `lora` and `ia3` come from `peft`; `head` trains only the classifier; `full`
trains everything.
The CaPT paper's other baselines come from `capt.baselines`: `dept`, `lopa`, `idpg`, `m-idpg`, `smop`, `residual`
and `vfpt` run on the capsule slot machinery (`CaptConfig.prompt_method`), `adapter` (Houlsby) on module hooks.

The baselines are built as their papers define them:
- Prompt Tuning on T5 prompts the encoder only (Lester et al.; the CaPT paper's baseline). PEFT's seq2seq
  default would also prompt the decoder (`num_transformer_submodules=2`).
- Deep Prompt-Tuning slots start from N(0, 0.02^2): m zero-initialised slots would be interchangeable (an encoder
  gives them no positions), receive identical gradients and stay identical.
- LoRA uses alpha = 2r on PEFT's default target modules.
"""

from __future__ import annotations

import functools
import inspect

import peft
from torch import nn

from ..baselines.adapter import add_adapters, train_layer_norms
from ..baselines.options import AdapterOptions
from ..config import CaptConfig
from ..model import get_capt_model
from ..sites import find_sites, hidden_size
from .backbones import Backbone
from .settings import CAPT_METHODS, METHODS, PEFT_METHODS, PROMPT_METHODS, MethodOptions

_PEFT_TASK_TYPES = {"encoder": "SEQ_CLS", "encoder-decoder": "SEQ_2_SEQ_LM", "decoder": "CAUSAL_LM"}
# A method's definition changes now and then (not its settings: its math or fixed defaults). A run recorded under
# an older revision is another method, so it is never read back as this one. Unlisted methods are at revision 1.
# 2 (2026-12-03): the authors' code adopted (docs/baselines-provenance.md): M-IDPG layerb and IDPG's GELU, DePT's
# alpha / sqrt(r) scaling and Kaiming A, Residual Prompt Tuning's bottleneck 800, adapters train the layer norms,
# SMoP's load-balancing loss. head 2 (2026-12-04): head-only trains its head at lr; it used head_lr, so a
# learning-rate sweep of `head` trained every grid point alike. `capt` is the plain mean (CaptConfig.mean_norm="none")
# at revision 1; the normalised mean is the method `capt-rms` (2026-12-06), so the finished `capt` runs read back.
METHOD_REVISIONS = {"idpg": 2, "m-idpg": 2, "dept": 2, "residual": 2, "adapter": 2, "smop": 2, "head": 2}


def method_revision(method: str) -> int:
    """The revision of `method`'s definition that this version trains (recorded in each run's results).

    Example:
        >>> method_revision("capt"), method_revision("dept")
        (1, 2)
    """
    return METHOD_REVISIONS.get(method, 1)


def apply_method(backbone: Backbone, method: str, options: MethodOptions | None = None) -> nn.Module:
    """Wrap `backbone.model` for `method`; returns the module to train (its trainable parameters set).

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> model = apply_method(load_backbone("tiny-llama"), "capt")
        >>> model.get_nb_trainable_parameters()[0]
        128
    """
    options = options or MethodOptions()
    base = backbone.model
    if method in (*CAPT_METHODS, "deep-prompt", *PROMPT_METHODS):
        return get_capt_model(base, capt_config(method, options))
    if method == "adapter":
        return _with_adapters(base, options)
    if method in PEFT_METHODS:
        if method == "ptv2" and backbone.family == "encoder":
            raise ValueError(
                f"method 'ptv2' (prefix tuning) puts its prefix in the attention's key/value cache, which "
                f"{type(base).__name__} never reads (transformers' encoders drop the cache), so the prefix would "
                "learn nothing: use a decoder (--decoder-head lm or classifier) or another method"
            )
        classifier = _classifier_name(base) is not None  # a decoder with a score head trains as SEQ_CLS too
        config = peft_config(method, "encoder" if classifier else backbone.family, options)
        if method == "ptv2" and classifier:  # a decoder classifier: encoders were refused above
            return _DecoderClassifierPrefixTuning(base, config)
        return peft.get_peft_model(base, config)
    if method == "head":
        head = _classifier_name(base)
        if head is None:
            raise ValueError(
                f"method 'head' trains a classification head, and {type(base).__name__} has none: "
                "use an encoder backbone (e.g. --model minilm)"
            )
        base.requires_grad_(False)
        base.get_submodule(head).requires_grad_(True)
        return base
    if method == "full":
        return base.requires_grad_(True)
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def capt_config(method: str, options: MethodOptions) -> CaptConfig:
    """The CaptConfig of `capt` (one instance-aware capsule per layer), `capt-rms` (the same over RMS-normalised
    tokens), `deep-prompt` (m learned slots) or a prompt baseline of `capt.baselines` (its slot module)."""
    if method in PROMPT_METHODS:
        return CaptConfig(prompt_method=method, prompt_options=options.prompt_options(method))
    if method in CAPT_METHODS:
        return CaptConfig(variant=options.variant, mean_norm="rms" if method == "capt-rms" else "none")
    return CaptConfig(num_slots=options.deep_prompt_slots, instance_aware=False, init="normal")


def peft_config(method: str, family: str, options: MethodOptions):
    """The `peft` config of a PEFT baseline on a backbone family."""
    task_type = _PEFT_TASK_TYPES[family]
    if method == "prompt":
        encoder_only = {"num_transformer_submodules": 1} if family == "encoder-decoder" else {}
        return peft.PromptTuningConfig(task_type=task_type, num_virtual_tokens=options.virtual_tokens, **encoder_only)
    if method == "ptv2":
        return peft.PrefixTuningConfig(task_type=task_type, num_virtual_tokens=options.virtual_tokens)
    if method == "lora":
        return peft.LoraConfig(task_type=task_type, r=options.lora_rank, lora_alpha=2 * options.lora_rank)
    if method == "ia3":
        return peft.IA3Config(task_type=task_type)
    raise ValueError(f"{method!r} is not a PEFT method; PEFT methods: {', '.join(PEFT_METHODS)}")


def extra_positions(method: str, options: MethodOptions) -> int:
    """Sequence positions the method puts in front of the user's tokens (prefix tuning adds keys, not positions)."""
    if method in (*CAPT_METHODS, "deep-prompt", *PROMPT_METHODS):
        return capt_config(method, options).slots_per_layer
    return options.virtual_tokens if method == "prompt" else 0


def _with_adapters(base: nn.Module, options: MethodOptions) -> nn.Module:
    """Houlsby adapters in every layer of every stack (a T5 encoder and decoder); the layer norms and the task head
    train too."""
    base.requires_grad_(False)
    adapter_options = AdapterOptions(**({"bottleneck": options.bottleneck} if options.bottleneck else {}))
    target = "both" if getattr(base.config, "is_encoder_decoder", False) else "auto"
    for site in find_sites(base, CaptConfig(target=target)):
        add_adapters(site.layers, hidden_size(base), adapter_options)
    if adapter_options.train_norms:
        train_layer_norms(base)
    head = _classifier_name(base)
    if head is not None:
        base.get_submodule(head).requires_grad_(True)
    return base


class _DecoderClassifierPrefixTuning(peft.PeftModelForSequenceClassification):
    """PEFT's prefix tuning of a sequence classifier, for decoders (`LlamaForSequenceClassification`, ...) on
    transformers 5.24+, whose forward names the key/value cache `cache`.

    PEFT hands the prefix over only to a forward that declares `past_key_values` and otherwise raises "Model does not
    support past key values"; these forwards still take that keyword (deprecated into `cache`), so the prefix goes
    in under the name the forward declares. Everything else (the prefix's attention mask, the head) is PEFT's.
    """

    @functools.cached_property
    def _cache_keyword(self) -> str:
        """`cache` on transformers 5.24+, `past_key_values` before: looked up once, not at every step."""
        return "cache" if "cache" in inspect.signature(self.base_model.forward).parameters else "past_key_values"

    def _prefix_tuning_forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        batch_size = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        kwargs[self._cache_keyword] = self.get_prompt(batch_size)
        return self.base_model(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)


def _classifier_name(model: nn.Module) -> str | None:
    return next((name for name in ("classifier", "score") if hasattr(model, name)), None)
