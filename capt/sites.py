"""Finding where capsules go: the layer stacks of a Hugging Face model.

A *site* is one stack of transformer layers (the encoder of BERT or T5, the decoder of Llama or T5) together
with the module that owns it. The capsule slot is written at the input of every layer of a site; the owner's
output is where the slot is removed again, so that heads never see it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

from .capsule import FALLBACK_NORM_EPS
from .config import CaptConfig


@dataclass
class CapsuleSite:
    """One layer stack that receives capsules."""

    role: str  # "encoder" or "decoder"
    stack: nn.Module  # the module whose forward runs `layers` (BertEncoder, T5Stack, LlamaModel, ...)
    layers: list[nn.Module]
    first_index: int  # row of this site's first layer in the capsule parameters
    strips_output: bool  # False for a T5 encoder: its slot stays in the memory the decoder attends to


def model_family(model: PreTrainedModel) -> str:
    """'encoder', 'encoder-decoder' or 'decoder' (decoder-only, causal)."""
    return config_family(model.config)


def is_causal_lm(model: PreTrainedModel) -> bool:
    """Whether `model` is its architecture's causal LM (LlamaForCausalLM, GPT2LMHeadModel), whose labels are the
    next-token targets, one per token; a decoder classifier (LlamaForTokenClassification) is not."""
    return type(model).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model.config.model_type)


# PEFT's task types, each with the transformers Auto mapping whose class the task's AutoPeftModel loads.
_TASK_TYPE_MAPPINGS = {
    "CAUSAL_LM": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "SEQ_2_SEQ_LM": MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    "SEQ_CLS": MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "TOKEN_CLS": MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "QUESTION_ANS": MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    "FEATURE_EXTRACTION": MODEL_MAPPING_NAMES,
}


def task_type_of(model: PreTrainedModel) -> str | None:
    """PEFT's task type for `model`'s class (LlamaForCausalLM: 'CAUSAL_LM', BertForSequenceClassification:
    'SEQ_CLS', T5ForConditionalGeneration: 'SEQ_2_SEQ_LM', BertModel: 'FEATURE_EXTRACTION'); None for a class no
    Auto mapping names, which `AutoPeftModel...` could not load anyway."""
    name, model_type = type(model).__name__, getattr(model.config, "model_type", None)
    for task_type, mapping in _TASK_TYPE_MAPPINGS.items():
        names = mapping.get(model_type, ())
        if name in ((names,) if isinstance(names, str) else names):
            return task_type
    return None


def config_family(config: PretrainedConfig) -> str:
    """The family of a model from its config alone (before any weights are loaded)."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    model_type = getattr(config, "model_type", None)
    causal_only = (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )
    if causal_only or getattr(config, "is_decoder", False):
        return "decoder"
    return "encoder"


def resolve_target(config: CaptConfig, family: str) -> list[str]:
    """The roles ('encoder'/'decoder') that get capsules, in order."""
    if config.target == "auto":
        return ["decoder"] if family == "decoder" else ["encoder"]
    if family == "encoder-decoder":
        return ["encoder", "decoder"] if config.target == "both" else [config.target]
    natural = "decoder" if family == "decoder" else "encoder"
    if config.target != natural:
        raise ValueError(
            f"CaptConfig.target={config.target!r} does not fit a {family} model; use 'auto' or {natural!r}"
        )
    return [natural]


def find_sites(model: PreTrainedModel, config: CaptConfig) -> list[CapsuleSite]:
    """Locate the layer stacks that get capsules, in the order their rows appear in the parameters."""
    family = model_family(model)
    roles = resolve_target(config, family)
    if config.layers_path is not None and len(roles) > 1:
        raise ValueError("CaptConfig.layers_path names a single stack; it cannot be combined with target='both'")
    sites, first_index = [], 0
    for role in roles:
        path = config.layers_path or _guess_layers_path(model, role, family)
        layers = _module_list_at(model, path)
        stack = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        strips = not (family == "encoder-decoder" and role == "encoder")
        sites.append(CapsuleSite(role, stack, list(layers), first_index, strips))
        first_index += len(layers)
    return sites


def hidden_size(model: PreTrainedModel) -> int:
    config = model.config.get_text_config()
    for name in ("hidden_size", "d_model", "n_embd"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError(f"cannot read the hidden size from {type(config).__name__}")


def rms_norm_eps(model: PreTrainedModel) -> float:
    """The eps of the backbone's own RMSNorm (Llama, Gemma, Qwen, Mistral: `rms_norm_eps`), so that
    `mean_norm="rms"` scales tokens exactly as the model's norms do; `FALLBACK_NORM_EPS` (1e-6) for other models."""
    eps = getattr(model.config.get_text_config(), "rms_norm_eps", None)
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else FALLBACK_NORM_EPS


def _expected_layer_count(model: PreTrainedModel, role: str, family: str) -> int | None:
    config = model.config.get_text_config()
    if family == "encoder-decoder" and role == "decoder":
        return getattr(config, "num_decoder_layers", None) or getattr(config, "num_hidden_layers", None)
    return getattr(config, "num_hidden_layers", None)


def _guess_layers_path(model: PreTrainedModel, role: str, family: str) -> str:
    """The ModuleList of identical blocks whose length is the configured layer count."""
    expected = _expected_layer_count(model, role, family)
    candidates = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) == expected
        and len({type(block) for block in module}) == 1
        and not isinstance(module[0], nn.ModuleList)
    ]
    if family == "encoder-decoder":
        candidates = [name for name in candidates if role in name.split(".")[-2]]
    # The shortest path wins: layer lists nested inside blocks (e.g. T5Block.layer) sit deeper.
    candidates.sort(key=lambda name: name.count("."))
    if not candidates:
        raise ValueError(
            f"could not find the {role} layers of {type(model).__name__} (expected an nn.ModuleList of "
            f"{expected} identical blocks); pass CaptConfig(layers_path='...'), e.g. layers_path='model.layers'"
        )
    return candidates[0]


def _module_list_at(model: nn.Module, path: str) -> nn.ModuleList:
    try:
        module = model.get_submodule(path)
    except AttributeError as err:
        raise ValueError(f"CaptConfig.layers_path={path!r} does not exist in {type(model).__name__}") from err
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        raise ValueError(
            f"CaptConfig.layers_path={path!r} must point at a non-empty nn.ModuleList of layers, "
            f"found {type(module).__name__}"
        )
    return module
