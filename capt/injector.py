"""`CapsuleInjector`: the hooks that make an attached Hugging Face model a CaPT model.

`CaptModel` and the PEFT tuner (`capt.integrations.peft`) each own the capsule parameters of their adapters and
share this machinery. Once attached, the model itself behaves as a CaPT model, whoever calls it (`CaptModel`,
`peft.PeftModel`, `transformers.Trainer` or user code):

1. A forward pre-hook on the model (for a decoder-only sequence classifier: on its trunk, below the head that
   pools the last non-pad input id) puts the slot(s) at position 0 of every input stream that has capsules:
   a placeholder token id (its embedding is never used), attention-mask 1, token-type 0, explicit position ids
   shifted by one. Masks, RoPE positions and KV caches are then built by the model itself, for any architecture.
   It also records which tokens are *instance tokens* (non-padding; for causal LMs those before the first
   target), and which adapter each row uses. A forward hook on the model strips the slot rows from what the
   caller gets back.
2. `model.generate` is shadowed by `CapsuleInjector.generate`, which does the same once, for the prompt.
3. A forward pre-hook on the module owning the layers (BertEncoder, T5Stack, LlamaModel, ...) turns the instance
   mask into mean weights once per pass. It is active only when the pass holds the slot: the first (prefill)
   pass of generation, never a decode step, whose slot already sits in the KV cache. A T5 encoder runs on
   right-aligned rows (each row's leading pads moved behind its tokens; its forward hook puts the columns back):
   T5 has no position ids, and its relative position bias would otherwise put the slot as far from the first
   token as the row has pads.
4. A forward pre-hook on every layer overwrites the slot rows of the layer input with
   `S_i = p_i + Mean(instance tokens [+ slot output of layer i-1])`, out of place, with the capsules of each row's
   adapter. The owner's slot module computes the rows (`module(layer, hidden, weights)`): `Capsules`, or a prompt
   module of `capt.baselines`. Prompt-tuning modules are written at the first layer only
   (`CaptConfig.writes_every_layer` is False) and then flow through the model like tokens; a module with
   `token_offsets` (DePT) also updates the user's tokens at that layer.
5. A forward hook on the module owning the layers removes the slot from its output, so pooler, classifier,
   LM head and loss see exactly the user's tokens. (A T5 encoder keeps it: the decoder cross-attends to it.)
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

from .config import CaptConfig
from .sites import CapsuleSite, find_sites, hidden_size, is_causal_lm, model_family, rms_norm_eps
from .slots import (
    STREAM_FIELDS,
    batch_and_length,
    cache_is_empty,
    cache_of,
    drop_none,
    insert_slots,
    positions_from_mask,
    prepend,
    reorder_columns,
    reorder_output,
    right_aligned_order,
    strip_slots,
)

# Inputs the injector takes from model calls; the model itself never sees them.
CAPT_INPUTS = ("instance_mask", "adapter_names")


class CapsuleOwner(Protocol):
    """What the injector needs from whoever owns the capsule parameters."""

    active_adapter: str

    def capsules_for(self, adapter_name: str) -> nn.Module:
        """The slot module of an adapter: `Capsules` or a `capt.baselines` prompt module."""


@dataclass
class RowGroups:
    """Which rows of a batch use which adapter. A batch on one adapter is a single group, without indexing."""

    names: list[str]
    rows: list[torch.Tensor] | None = None  # row indices per name; None: the one group is the whole batch
    inverse: torch.Tensor | None = None  # puts the concatenated group results back in batch order


def group_rows(row_adapters: Sequence[str], batch: int, device: torch.device) -> RowGroups:
    """Group the rows of a batch by adapter name.

    `row_adapters` names one adapter per example; beams, returned sequences and multiple-choice options repeat
    each example in consecutive rows, so a longer batch repeats each name.
    """
    names = [name for name in row_adapters for _ in range(batch // len(row_adapters))]
    distinct = list(dict.fromkeys(names))
    if len(distinct) == 1:
        return RowGroups(distinct)
    rows = [torch.tensor([i for i, n in enumerate(names) if n == name], device=device) for name in distinct]
    return RowGroups(distinct, rows, torch.argsort(torch.cat(rows)))


def run_by_rows(groups: RowGroups, run: Callable[[str, Any], torch.Tensor]) -> torch.Tensor:
    """`run(name, rows)` for every group, reassembled in batch order (rows is `slice(None)` for one group)."""
    if groups.rows is None:
        return run(groups.names[0], slice(None))
    return torch.cat([run(name, rows) for name, rows in zip(groups.names, groups.rows, strict=True)])[groups.inverse]


@dataclass
class _PassState:
    """What the layer hooks of one site need during one forward pass."""

    active: bool
    first_weights: torch.Tensor | None = None  # mean weights at the first layer: instance tokens only
    rest_weights: torch.Tensor | None = None  # later layers: instance tokens and the slot output
    positions: torch.Tensor | None = None  # token positions from the first real token; -1 for slots and padding
    groups: RowGroups | None = None
    order: torch.Tensor | None = None  # the column order the stack ran in (right-aligned T5 encoder); None: as given


def input_module(model: PreTrainedModel) -> nn.Module:
    """The module whose inputs get the slot: the model itself, or the trunk of a decoder-only sequence classifier.

    A decoder classifier (`LlamaForSequenceClassification`, ...) pools the last non-pad token it finds in the
    `input_ids` it received. Were the slot put there, that index would count the slot while the trunk's output
    (stripped) does not, and the head would read one position too far. Below the head, it sees the user's ids.

    Example:
        >>> from transformers import LlamaForSequenceClassification, LlamaConfig
        >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        ...                      vocab_size=50, pad_token_id=0)
        >>> type(input_module(LlamaForSequenceClassification(config))).__name__
        'LlamaModel'
    """
    pools_input_ids = model_family(model) == "decoder" and type(model).__name__.endswith("ForSequenceClassification")
    return model.base_model if pools_input_ids else model


def absolute_positions(config: Any) -> int | None:
    """Size of a model's absolute position table (BERT, RoBERTa, GPT-2); None for rotary or relative positions.

    Example:
        >>> absolute_positions(transformers.BertConfig())  # doctest: +SKIP
        512
    """
    if config.model_type == "gpt2":
        return config.n_positions
    if config.model_type in ("bert", "roberta", "xlm-roberta") and (
        getattr(config, "position_embedding_type", "absolute") == "absolute"
    ):
        # RoBERTa numbers positions from padding_idx + 1 on
        offset = config.pad_token_id + 1 if config.model_type != "bert" and config.pad_token_id is not None else 0
        return config.max_position_embeddings - offset
    return None


class CapsuleInjector:
    """Attaches the CaPT hooks to `model`; `owner` provides the capsules of each adapter.

    `config` fixes what every adapter of this model must share: the layer stacks that get capsules and the slot
    count. Raises ValueError, before touching the model, if `config.base_model` (the facts saved with an adapter)
    does not match `model`.
    """

    def __init__(self, model: PreTrainedModel, config: CaptConfig, owner: CapsuleOwner):
        if getattr(model, "_capt_attached", False):
            raise ValueError("this model already has a CaPT adapter attached; call .unload() on it first")
        entry = input_module(model)
        self._argument_names = list(inspect.signature(entry.forward).parameters)
        if not {"input_ids", "inputs_embeds"} & set(self._argument_names):  # ViT, Wav2Vec2: no token stream
            raise ValueError(
                f"{type(model).__name__} takes neither input_ids nor inputs_embeds: CaPT needs a text model, "
                "whose input is a sequence of tokens"
            )
        self.model = model
        self.owner = owner
        self.family = model_family(model)
        # Its labels are targets, kept out of the capsule; a classifier's labels are classes its head takes.
        self._labels_are_targets = self.family == "decoder" and is_causal_lm(model)
        self.sites: list[CapsuleSite] = find_sites(model, config)
        self.num_slots = config.slots_per_layer
        # Prompt tuning writes its slots at the input layer only; they then flow through the model as tokens.
        self.every_layer = config.writes_every_layer
        self.num_layers = sum(len(site.layers) for site in self.sites)
        self.hidden_size = hidden_size(model)
        self.norm_eps = rms_norm_eps(model)
        self.position_limit = absolute_positions(model.config)
        self.check_base_model(config)

        self.enabled = True
        # Set around a PEFT call by the tuner, which receives `adapter_names` before PEFT drops it.
        self.pending_adapter_names: list[str] | None = None
        self.row_adapters: list[str] | None = None  # per example, during a pass that names them
        self._generating = False
        self._warned_empty_rows = False
        self._instance_masks: dict[str, torch.Tensor] = {}  # role -> mask for the next prefill pass
        self._token_masks: dict[str, torch.Tensor] = {}  # role -> non-padding user tokens (slots excluded)
        self._stream_lengths: dict[str, int] = {}  # role -> length with slots, to strip the output
        self._states: dict[str, _PassState] = {}
        # Decoder-only LMs are left-padded; encoders keep their own position scheme (RoBERTa counts from pad_id + 1).
        self._derives_positions = self.family == "decoder" and "position_ids" in self._argument_names
        # T5's encoder takes no position ids: its relative position bias follows the columns. Before left pads, the
        # slot would sit farther from the tokens the more pads a row has; the encoder runs right-aligned instead.
        self._right_aligned_roles = {"encoder"} if self.family == "encoder-decoder" else set()

        self._hooks = [
            entry.register_forward_pre_hook(self._before_model, with_kwargs=True),
            entry.register_forward_hook(self._after_model, with_kwargs=True, always_call=True),
        ]
        for site in self.sites:
            self._hooks.append(
                site.stack.register_forward_pre_hook(partial(self._before_stack, site), with_kwargs=True)
            )
            self._hooks.append(site.stack.register_forward_hook(partial(self._after_stack, site), always_call=True))
            for position, layer in enumerate(site.layers):
                hook = partial(self._before_layer, site, position)
                self._hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        if callable(getattr(type(model), "generate", None)):
            model.generate = self.generate  # this instance only; `detach` restores the class's method
        model._capt_attached = True

    # ------------------------------------------------------------------ adapters sharing the model

    def fingerprint(self) -> dict[str, Any]:
        """The facts an adapter depends on; saved with it and checked when it is attached."""
        return {
            "model_type": getattr(self.model.config, "model_type", None),
            "hidden_size": self.hidden_size,
            "num_capsule_layers": [len(site.layers) for site in self.sites],
            "capsule_roles": [site.role for site in self.sites],
        }

    def check_base_model(self, config: CaptConfig) -> None:
        saved = config.base_model or {}
        actual = self.fingerprint()
        differences = [
            f"{key}: adapter has {value!r}, model has {actual.get(key)!r}"
            for key, value in saved.items()
            if actual.get(key) != value
        ]
        if differences:
            raise ValueError("CaPT adapter was made for another model: " + "; ".join(differences))

    def check_compatible(self, config: CaptConfig, adapter_name: str) -> None:
        """Adapters that share a model (a capsule bank) need the same layers and slot count."""
        self.check_base_model(config)
        if config.writes_every_layer != self.every_layer:
            raise ValueError(
                f"adapter {adapter_name!r} writes its slots at {'every' if config.writes_every_layer else 'the input'} "
                "layer, the adapters already on this model do not: adapters that share a model must agree"
            )
        if config.slots_per_layer != self.num_slots:
            raise ValueError(
                f"adapter {adapter_name!r} uses {config.slots_per_layer} slot(s) per layer, the adapters already on "
                f"this model use {self.num_slots}: adapters that share a model must have the same slot count"
            )
        layers = [(site.role, site.stack) for site in find_sites(self.model, config)]
        if layers != [(site.role, site.stack) for site in self.sites]:
            raise ValueError(
                f"adapter {adapter_name!r} puts capsules into other layers than the adapters already on this model "
                "(CaptConfig.target / layers_path): adapters that share a model must use the same layers"
            )

    def detach(self) -> None:
        """Remove every hook; the model is the plain base model again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.model.__dict__.pop("generate", None)
        self.model._capt_attached = False

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        *,  # the model's own generate() takes generation_config second: refuse positional use beyond the ids
        attention_mask: torch.Tensor | None = None,
        instance_mask: torch.Tensor | None = None,
        adapter_names: Sequence[str] | None = None,
        **kwargs: Any,
    ):
        """`generate` of the model with capsules computed once from the prompt (prefill); same output format.

        Decoder-only prompts must be left-padded, as for the base model.
        """
        base_generate = partial(type(self.model).generate, self.model)
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        inputs = drop_none(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if not self.enabled:
            return base_generate(**inputs)
        if input_ids is not None:
            check_token_ids(input_ids, "input_ids")
        if input_ids is not None and attention_mask is None:
            # generate() would infer the mask from pad tokens and could mistake the slot for one.
            pad = inputs.get("pad_token_id", self.model.generation_config.pad_token_id)
            inputs["attention_mask"] = (input_ids != pad).long() if pad is not None else torch.ones_like(input_ids)
        n = self.num_slots
        roles = {site.role for site in self.sites}
        if self.family == "encoder-decoder" and "decoder" in roles and "decoder_input_ids" not in inputs:
            batch = (input_ids if input_ids is not None else inputs["inputs_embeds"]).shape[0]
            start = self.model.generation_config.decoder_start_token_id
            inputs["decoder_input_ids"] = torch.full((batch, 1), start, dtype=torch.long, device=self.model.device)
        if "max_length" in inputs:
            inputs["max_length"] += n
        # generate() derives positions from the attention mask itself, at every step: leave them to it.
        self._prepare_prefill(inputs, instance_mask, adapter_names or self.pending_adapter_names, positions=False)
        self._generating = True
        try:
            output = base_generate(**inputs)
        finally:
            self._generating = False
            self._end_pass()
        strip_prompt = "decoder" in roles and (self.family == "encoder-decoder" or "input_ids" in inputs)
        if not strip_prompt:
            return output
        if isinstance(output, torch.Tensor):
            return output[:, n:]
        output.sequences = output.sequences[:, n:]
        return output

    # ------------------------------------------------------------------ inputs

    def _role_for(self, key: str) -> str | None:
        """Which capsule site an input stream feeds: 'decoder_*' keys feed a T5 decoder."""
        roles = {site.role for site in self.sites}
        if key.startswith("decoder_"):
            return "decoder" if "decoder" in roles and self.family == "encoder-decoder" else None
        role = "decoder" if self.family == "decoder" else "encoder"
        return role if role in roles else None

    def _output_fields(self, role: str) -> dict[str, str]:
        if self.family != "encoder-decoder":
            return STREAM_FIELDS["own"]
        return STREAM_FIELDS["encoder-memory" if role == "encoder" else "decoder"]

    def _prepare_prefill(
        self,
        inputs: dict[str, Any],
        instance_mask: torch.Tensor | None,
        adapter_names: Sequence[str] | None,
        positions: bool = True,
    ) -> None:
        """Put the slot columns in front of every stream that has capsules; record instance masks and row adapters."""
        self._end_pass()
        if self._role_for("input_ids") is not None:
            refuse_packed_rows(inputs)
            mask = self._stream_instance_mask(inputs, "", instance_mask)
            if self.position_limit is not None and mask.shape[-1] + self.num_slots > self.position_limit:
                raise ValueError(
                    f"an input of {mask.shape[-1]} tokens plus {self.num_slots} capsule slot(s) needs more than the "
                    f"model's {self.position_limit} positions: truncate inputs to "
                    f"{self.position_limit - self.num_slots} tokens"
                )
            if self._labels_are_targets and "labels" in inputs:
                if inputs["labels"].shape != mask.shape:
                    raise ValueError(
                        f"labels has shape {tuple(inputs['labels'].shape)}, input_ids has {tuple(mask.shape)}: a "
                        "causal LM takes one label per token (-100 where none)"
                    )
                if instance_mask is None:  # an explicit instance_mask overrides what the labels say
                    attended = mask
                    mask = mask & before_first_target(inputs["labels"])
                    self._check_instance_tokens(mask, attended)
            if positions and self._derives_positions and "position_ids" not in inputs and "attention_mask" in inputs:
                # Positions count from the first real token, so that the slot (position 0) is as far from every
                # token whatever the padding; generate() derives its positions from the mask the same way.
                inputs["position_ids"] = positions_from_mask(inputs["attention_mask"])
            role = self._role_for("input_ids")
            self._instance_masks[role] = prepend(mask, self.num_slots, False)
            self._token_masks[role] = prepend(self._stream_instance_mask(inputs, "", None), self.num_slots, False)
            insert_slots(inputs, "", self.num_slots)
        if self._role_for("decoder_input_ids") is not None:
            if "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
                inputs["decoder_input_ids"] = self.model.prepare_decoder_input_ids_from_labels(labels=inputs["labels"])
            # Every decoder token is a target or generated: none is an instance token.
            mask = torch.zeros_like(self._stream_instance_mask(inputs, "decoder_", None))
            self._instance_masks["decoder"] = prepend(mask, self.num_slots, False)
            self._token_masks["decoder"] = prepend(
                self._stream_instance_mask(inputs, "decoder_", None), self.num_slots, False
            )
            insert_slots(inputs, "decoder_", self.num_slots)
        self._stream_lengths = {role: mask.shape[-1] for role, mask in self._instance_masks.items()}
        if adapter_names is not None:
            batch = next(iter(self._instance_masks.values())).shape[0]
            self.row_adapters = self._checked_row_adapters(adapter_names, batch)

    def _check_instance_tokens(self, mask: torch.Tensor, attended: torch.Tensor) -> None:
        """Refuse a labelled causal-LM batch whose rows all lack instance tokens; warn (once) when some do."""
        empty = ~mask.any(-1) & attended.any(-1)
        if not bool(empty.any()):
            return
        fix = (
            "labels = input_ids leaves no prompt for the capsule's mean: set the prompt's labels to -100 (loss on "
            "the answer only), or pass instance_mask (1 = instance token; transformers.Trainer drops that column from "
            "a PeftModel's batches unless TrainingArguments(remove_unused_columns=False))"
        )
        if bool(empty.all()):
            raise ValueError(f"no row of this causal-LM batch has a token before its first target; {fix}")
        if not self._warned_empty_rows:
            self._warned_empty_rows = True
            rows = empty.nonzero().flatten().tolist()
            warnings.warn(
                f"CaPT: rows {rows} of a causal-LM batch have no token before their first target, so their capsule "
                f"sees no instance (this warning is shown once); {fix}",
                UserWarning,
                stacklevel=2,
            )

    def _checked_row_adapters(self, adapter_names: Sequence[str], batch: int) -> list[str]:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if len(names) != batch:
            raise ValueError(f"adapter_names has {len(names)} entries for a batch of {batch}: give one per example")
        for name in dict.fromkeys(names):
            self.owner.capsules_for(name)  # raises for an adapter that is not loaded
        return names

    @staticmethod
    def _stream_instance_mask(inputs: dict[str, Any], prefix: str, override: torch.Tensor | None) -> torch.Tensor:
        ids, embeds = inputs.get(f"{prefix}input_ids"), inputs.get(f"{prefix}inputs_embeds")
        if ids is None and embeds is None:
            raise ValueError(f"pass {prefix}input_ids or {prefix}inputs_embeds")
        if ids is not None:
            check_token_ids(ids, f"{prefix}input_ids")
        shape = ids.shape if ids is not None else embeds.shape[:-1]
        if 0 in shape:  # the capsule's mean and the slot insertion need a token of an example
            raise ValueError(f"{prefix}input_ids has shape {tuple(shape)}: give at least one example of one token")
        device = (ids if ids is not None else embeds).device
        mask = inputs.get(f"{prefix}attention_mask")
        if mask is not None and mask.shape != shape:  # BERT would broadcast a wrong-shaped mask without a word
            raise ValueError(
                f"{prefix}attention_mask has shape {tuple(mask.shape)}, {prefix}input_ids has {tuple(shape)}: "
                "give one mask entry per token"
            )
        mask = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask.bool()
        if override is not None:
            if override.shape != mask.shape:
                raise ValueError(f"instance_mask has shape {tuple(override.shape)}, the input has {tuple(mask.shape)}")
            mask = mask & override.bool()
        return mask

    def _end_pass(self) -> None:
        self._states.clear()
        self._instance_masks.clear()
        self._token_masks.clear()
        self._stream_lengths = {}
        self.row_adapters = None

    # ------------------------------------------------------------------ hooks

    def _before_model(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._generating:
            return None  # generate() prepared its inputs itself: its passes go to the model untouched
        inputs = drop_none(**dict(zip(self._argument_names, args, strict=False)), **kwargs)
        instance_mask, adapter_names = (inputs.pop(key, None) for key in CAPT_INPUTS)
        if self.enabled:
            if cache_is_empty(cache_of(inputs)):
                self._prepare_prefill(inputs, instance_mask, adapter_names or self.pending_adapter_names)
            else:
                # Incremental decoding: the slot is already in the cache; only the masks need its column, and
                # heads trained per adapter (`modules_to_save`) need each row's adapter again.
                for key in ("attention_mask", "decoder_attention_mask"):
                    if key in inputs and self._role_for(key) is not None:
                        inputs[key] = prepend(inputs[key], self.num_slots, 1)
                names = adapter_names or self.pending_adapter_names
                if names is not None:
                    self.row_adapters = self._checked_row_adapters(names, _step_batch_size(inputs))
        return (), inputs

    def _after_model(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._generating:
            return output  # every step of generate() reads the prompt's instance masks
        lengths = self._stream_lengths
        self._end_pass()
        # Hidden states and attentions may be collected above the stack, so strip what is still there.
        for role, length in lengths.items():
            output = strip_slots(output, self.num_slots, self._output_fields(role), length)
        return output

    def _before_stack(
        self, site: CapsuleSite, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        mask = self._instance_masks.get(site.role)
        if not (self.enabled and mask is not None and cache_is_empty(cache_of(kwargs))):
            self._states[site.role] = _PassState(active=False)
            return None
        batch, length = batch_and_length(args, kwargs)
        mask = _fit_rows(mask, batch, length)
        tokens = _fit_rows(self._token_masks[site.role], batch, length)
        order = right_aligned_order(tokens, self.num_slots) if site.role in self._right_aligned_roles else None
        if order is not None:
            mask, tokens = reorder_columns(mask, order, 1), reorder_columns(tokens, order, 1)
            names = inspect.signature(module.forward).parameters
            kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
            args = ()
            for key in ("input_ids", "attention_mask", "inputs_embeds"):
                if kwargs.get(key) is not None:
                    kwargs[key] = reorder_columns(kwargs[key], order, 1)
        first = mask.float()
        rest = first.clone()
        rest[:, : self.num_slots] = 1.0
        self._states[site.role] = _PassState(
            active=True,
            first_weights=first / first.sum(-1, keepdim=True).clamp(min=1.0),
            rest_weights=rest / rest.sum(-1, keepdim=True),
            positions=torch.where(tokens, tokens.long().cumsum(-1) - 1, -1),
            groups=group_rows(self.row_adapters or [self.owner.active_adapter], batch, mask.device),
            order=order,
        )
        return args, kwargs

    def _before_layer(self, site: CapsuleSite, position: int, module: nn.Module, args: tuple, kwargs: dict):
        state = self._states.get(site.role)
        if not self.enabled or state is None or not state.active:
            return None
        layer = site.first_index + position
        if not self.every_layer and layer > 0:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        weights = state.first_weights if position == 0 else state.rest_weights
        if weights.shape != hidden.shape[:2]:
            raise RuntimeError(
                f"CaPT: layer input has shape {tuple(hidden.shape[:2])} but the instance mask "
                f"has {tuple(weights.shape)}; call the model with its whole input, not layer by layer"
            )
        n = self.num_slots

        def layer_input(name: str, rows: Any) -> torch.Tensor:
            module = self.owner.capsules_for(name)
            slots = module(layer, hidden[rows], weights[rows])
            tokens = hidden[rows, n:]
            if layer == 0 and hasattr(module, "token_offsets"):  # DePT: an update of the input token embeddings
                tokens = tokens + module.token_offsets(state.positions[rows, n:]).to(tokens.dtype)
            return torch.cat([slots, tokens], dim=1)

        hidden = run_by_rows(state.groups, layer_input)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _after_stack(self, site: CapsuleSite, module: nn.Module, args: tuple, output: Any) -> Any:
        # The pass over this stack is over (or failed): a layer called on its own later must find no slot to write.
        state = self._states.pop(site.role, None)
        if state is None or not state.active:
            return output
        if state.order is not None:  # back to the caller's columns, which the decoder's cross-attention mask follows
            output = reorder_output(output, state.order.argsort(-1), STREAM_FIELDS["own"])
        if not site.strips_output:
            return output
        return strip_slots(output, self.num_slots, STREAM_FIELDS["own"], state.first_weights.shape[-1])


def before_first_target(labels: torch.Tensor) -> torch.Tensor:
    """The positions before each row's first target (label != -100): a causal LM's instance tokens.

    For one answer after a prompt, these are exactly the tokens labelled -100. For multi-turn chat labels (the loss
    on every assistant turn) the user turns after the first answer stay out too: they come after an answer, and
    through the mean at position 0 every token, the first answer's included, would see them.
    """
    return (labels != -100).long().cumsum(-1) == 0


def _step_batch_size(inputs: dict[str, Any]) -> int:
    """The number of rows of a decode step's input (its ids or embeddings, of the decoder for T5)."""
    for key in ("input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds"):
        if isinstance(inputs.get(key), torch.Tensor):
            return inputs[key].shape[0]
    raise ValueError("pass input_ids or inputs_embeds (decoder_input_ids for an encoder-decoder)")


# The sequence boundaries that padding-free batches (TRL's packing and `padding_free`, DataCollatorWithFlattening)
# hand to flash attention's variable-length kernels.
PACKED_SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def refuse_packed_rows(inputs: dict[str, Any]) -> None:
    """A ValueError if a row holds several sequences: its `position_ids` restart (or flash attention's sequence
    boundaries are passed). One capsule mean per row would then mix the instances of different examples.

    Example:
        >>> refuse_packed_rows({"position_ids": torch.tensor([[0, 1, 2, 0, 1]])})
        Traceback (most recent call last):
        ...
        ValueError: row 0 holds several sequences (position_ids restart at token 3): ...
    """
    positions = inputs.get("position_ids")
    restarts = None
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[1] > 1:
        real = inputs.get("attention_mask")
        real = torch.ones_like(positions, dtype=torch.bool) if real is None else real.bool()
        restarts = (positions[:, 1:] <= positions[:, :-1]) & real[:, 1:] & real[:, :-1]
    if restarts is not None and restarts.any():
        row, token = (int(i) for i in restarts.nonzero()[0])
        where = f"row {row} holds several sequences (position_ids restart at token {token + 1})"
    elif any(inputs.get(key) is not None for key in PACKED_SEQUENCE_KEYS):
        where = f"the batch holds several sequences per row ({', '.join(PACKED_SEQUENCE_KEYS)} given)"
    else:
        return
    raise ValueError(
        f"{where}: packed or padding-free batches would mix several examples in one capsule mean. Give one example "
        "per row, padded (TRL: SFTConfig(packing=False, padding_free=False))"
    )


def check_token_ids(ids: Any, name: str) -> None:
    """A ValueError unless `ids` is an integer tensor of shape (batch, [choices,] length)."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor of token ids, got {type(ids).__name__}")
    if ids.dim() < 2 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"{name} must be integer token ids of shape (batch, length), got {ids.dtype} of shape {tuple(ids.shape)}"
        )


def _fit_rows(mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """A per-example mask of the prefill input, shaped like the stack's (batch, length) input."""
    mask = mask.reshape(-1, mask.shape[-1])  # multiple-choice inputs arrive flattened
    if batch != mask.shape[0]:
        mask = mask.repeat_interleave(batch // mask.shape[0], dim=0)  # beams / num_return_sequences
    if length > mask.shape[1]:
        # Uncached generation re-reads tokens generated after the prompt: never instance tokens.
        mask = torch.nn.functional.pad(mask, (0, length - mask.shape[1]), value=False)
    return mask
