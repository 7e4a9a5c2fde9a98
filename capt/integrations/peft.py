"""CaPT as a PEFT method: `peft.get_peft_model(base, capt.CaptConfig())`, `peft.PeftModel.from_pretrained`.

PEFT's prompt-learning path is closed to outside methods (it branches on hard-coded PeftType members), so CaPT
registers as a tuner-style method. `CaptTuner` owns the capsules of each adapter (in its `CapsuleLayer`) and
attaches the same `CapsuleInjector` as `CaptModel`. Its hooks sit on the model itself, so every PeftModel class,
whose forward calls the model and whose generate calls `model.generate`, gets the slot at position 0, the
prefill-only capsule, no label leakage and outputs without the slot. Task heads (`modules_to_save`) use PEFT's
own wrapper, so saved files carry the same keys as `CaptModel.save_pretrained` writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import aenum
import torch
from peft import mapping
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import ModulesToSaveWrapper, PeftType, register_peft_method
from peft.utils.other import set_additional_trainable_modules
from torch import nn

from ..baselines.registry import auxiliary_loss, build_slot_module
from ..capsule import Capsules
from ..config import PEFT_TYPE, CaptConfig
from ..heads import resolve_head_names
from ..injector import CapsuleInjector
from ..sites import task_type_of

PREFIX = "capt_"


class CapsuleLayer(nn.Module, BaseTunerLayer):
    """The capsules of every CaPT adapter, as a PEFT tuner layer, so that PEFT's adapter switching, status report
    and `disable_adapter` handle them. Unlike LoRA's layers it wraps no base layer: the injector's hooks apply it.
    """

    adapter_layer_names = ("capt_capsules",)

    def __init__(self) -> None:
        super().__init__()
        self.capt_capsules = nn.ModuleDict()


class CaptTuner(BaseTuner):
    """What `PeftModel.base_model` is for CaPT adapters; one capsule set per adapter name.

    Example:
        >>> import capt, peft, torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> model = peft.get_peft_model(base, capt.CaptConfig(task_type="CAUSAL_LM"))
        >>> type(model.base_model).__name__, model.get_nb_trainable_parameters()[0]
        ('CaptTuner', 64)
        >>> model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape  # the slot never shows
        torch.Size([1, 3, 64])
    """

    prefix = PREFIX
    tuner_layer_cls = CapsuleLayer  # held by the tuner, not inside the model: other methods' layers stay untouched

    # ------------------------------------------------------------------ what CapsuleInjector needs

    @property
    def capsules(self) -> Capsules:
        """The active adapter's capsules, as `CaptModel.capsules`."""
        return self.capsules_for(self.active_adapter)

    @property
    def capsule_vectors(self) -> nn.Parameter:
        """The active adapter's p_i, as `CaptModel.capsule_vectors`."""
        return self.capsules.vectors

    def capsules_for(self, adapter_name: str) -> Capsules:
        bank = self.capt_layer.capt_capsules
        if adapter_name not in bank:
            raise ValueError(f"no adapter named {adapter_name!r} is loaded; loaded: {list(bank)}")
        return bank[adapter_name]

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The active adapter's auxiliary training loss (SMoP's load balancing), as `CaptModel.auxiliary_loss`; the
        PeftModel answers it too (`peft_model.auxiliary_loss()`), so training recipes find it on either path."""
        return auxiliary_loss(self.capsules)

    # ------------------------------------------------------------------ what PeftModel calls

    def inject_adapter(self, model: nn.Module, adapter_name: str, **kwargs: Any) -> None:
        """Create the adapter's capsules (the first adapter also attaches the hooks and freezes the model)."""
        config = self.peft_config[adapter_name]
        first = "capt_layer" not in self._modules
        if first:
            self.injector = CapsuleInjector(model, config, owner=self)
            self.capt_layer = CapsuleLayer()
            model.requires_grad_(False)
        else:
            self.injector.check_compatible(config, adapter_name)
        # PEFT saves this config as adapter_config.json: stamp it with the model it fits, as CaptModel does, so that
        # loading it into another model is refused on either path.
        config.base_model = config.base_model or self.injector.fingerprint()
        # and with its task type, which PEFT's Auto classes and PeftModel.from_pretrained choose the class by.
        config.task_type = config.task_type or task_type_of(model)
        device = next(model.parameters()).device
        injector = self.injector
        capsules = build_slot_module(config, injector.num_layers, injector.hidden_size, device, injector.norm_eps)
        self.capt_layer.capt_capsules[adapter_name] = capsules.requires_grad_(False)
        is_active = adapter_name in self.active_adapters
        if is_active:
            self.capt_layer.set_adapter(adapter_name, inference_mode=config.inference_mode)
        # The heads CaptModel would train, wrapped by PEFT (its config is left as the user gave it).
        heads = resolve_head_names(model, config.modules_to_save)
        with_heads = dataclasses.replace(config, modules_to_save=heads)
        set_additional_trainable_modules(model, with_heads, self.get_model_config(model), adapter_name, is_active)

    def _create_and_replace(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("CaPT replaces no modules; inject_adapter attaches hooks instead")

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        """Capsules stay float32 whatever the base dtype (master weights), as in CaptModel."""

    def forward(self, *args: Any, **kwargs: Any):
        return self.model(*args, **kwargs)  # through __call__, so that the injector's hooks run

    @contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, adapter_names: Sequence[str] | None = None, **kwargs: Any):
        """PeftModel drops `adapter_names` from forward/generate kwargs after handing it here: keep it for the pass."""
        if adapter_names is None:
            yield
            return
        self.injector.pending_adapter_names = list(adapter_names)
        with_names = partial(_add_adapter_names, list(adapter_names))
        handles = [
            module.register_forward_pre_hook(with_names, with_kwargs=True)
            for module in self.model.modules()
            if isinstance(module, ModulesToSaveWrapper)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.injector.pending_adapter_names = None

    # The base class applies these to the tuner layers inside the model (none for CaPT) and to the wrapped heads.

    def set_adapter(self, adapter_name: str, inference_mode: bool = False) -> None:
        self.capsules_for(adapter_name)  # raises for an unknown name
        super().set_adapter(adapter_name, inference_mode=inference_mode)
        self.capt_layer.set_adapter(adapter_name, inference_mode=inference_mode)

    def set_requires_grad(self, adapter_names: str | Sequence[str], requires_grad: bool = True) -> None:
        super().set_requires_grad(adapter_names, requires_grad)
        self.capt_layer.set_requires_grad(adapter_names, requires_grad)

    def enable_adapter_layers(self) -> None:
        super().enable_adapter_layers()
        self.capt_layer.enable_adapters(True)
        self.injector.enabled = True

    def disable_adapter_layers(self) -> None:
        super().disable_adapter_layers()
        self.capt_layer.enable_adapters(False)
        self.injector.enabled = False

    def delete_adapter(self, adapter_name: str) -> None:
        super().delete_adapter(adapter_name)
        self.capt_layer.delete_adapter(adapter_name)  # and picks another active adapter if needed
        self.active_adapter = self.capt_layer.active_adapter

    def _check_merge_allowed(self) -> None:
        raise ValueError(
            "CaPT capsules are written into the activations, not the weights, so they cannot be merged; "
            "use unload() to get the base model back"
        )

    def unload(self) -> nn.Module:
        self.injector.detach()
        return super().unload()


def _add_adapter_names(adapter_names: list[str], module: nn.Module, args: tuple, kwargs: dict):
    return args, {**kwargs, "adapter_names": adapter_names}


def register() -> None:
    """Make CAPT a PEFT method: a PeftType member, its config and its tuner (idempotent).

    Example:
        >>> import capt, peft  # `import capt` already called this
        >>> peft.mapping.PEFT_TYPE_TO_TUNER_MAPPING["CAPT"].__name__
        'CaptTuner'
    """
    if PEFT_TYPE not in PeftType.__members__:
        aenum.extend_enum(PeftType, PEFT_TYPE, PEFT_TYPE)  # PeftType is a closed enum
    peft_type = PeftType[PEFT_TYPE]
    registered = mapping.PEFT_TYPE_TO_TUNER_MAPPING.get(peft_type)
    if registered is CaptTuner:
        return
    if registered is not None:  # an older copy of this module (importlib.reload): replace it
        for table in (mapping.PEFT_TYPE_TO_CONFIG_MAPPING, mapping.PEFT_TYPE_TO_TUNER_MAPPING):
            del table[peft_type]
        del mapping.PEFT_TYPE_TO_PREFIX_MAPPING[peft_type]
    register_peft_method(name=PEFT_TYPE.lower(), config_cls=CaptConfig, model_cls=CaptTuner, prefix=PREFIX)
