"""`CaptConfig`: everything that defines a CaPT adapter, saved as `adapter_config.json`.

When a supported `peft` is installed, `CaptConfig` is a `peft.PeftConfig`, so the same object configures
`capt.get_capt_model` and `peft.get_peft_model`, and one file format serves both APIs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .baselines.options import PROMPT_OPTIONS, make_options, options_dict
from .import_utils import config_base
from .variants import VARIANTS

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"  # read only on request (allow_pickle=True)
PEFT_TYPE = "CAPT"
# Keys PEFT writes into adapter_config.json; without peft installed they are read and ignored.
PEFT_BOOKKEEPING_KEYS = (
    "peft_type",
    "task_type",
    "peft_version",
    "auto_mapping",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
)

INITS = ("zeros", "normal")
TARGETS = ("auto", "encoder", "decoder", "both")
MEAN_NORMS = ("none", "rms")


@dataclass
class CaptConfig(config_base()):
    """Configuration of a Capsule Prompt-Tuning adapter.

    Layer count and hidden size are read from the model when the adapter is attached, so the default
    config fits any supported backbone.

    Example:
        >>> import capt
        >>> cfg = capt.CaptConfig(variant="add", init="zeros")
        >>> cfg.num_slots, cfg.instance_aware
        (1, True)
        >>> deep_prompt = capt.CaptConfig(num_slots=10, instance_aware=False)  # Deep Prompt-Tuning
        >>> import peft  # the same config drives PEFT's API
        >>> isinstance(cfg, peft.PeftConfig), cfg.peft_type
        (True, 'CAPT')
    """

    variant: str = field(
        default="add",
        metadata={
            "help": "How the instance summary enters the capsule: 'add' (S = p + Mean, the paper's default), "
            "'prepend' (p and Mean as two separate slots), 'extract' (summary = masked mean of a depthwise "
            "1-D convolution over the hidden states), 'project' (summary = low-rank d->r->d projection of Mean)."
        },
    )
    init: str = field(
        default="zeros",
        metadata={
            "help": "Initial capsule vectors: 'zeros' makes the untrained capsule exactly the training-free "
            "instance token (paper Finding II); 'normal' draws from N(0, init_std^2)."
        },
    )
    init_std: float = field(default=0.02, metadata={"help": "Standard deviation for init='normal'."})
    target: str = field(
        default="auto",
        metadata={
            "help": "Which layer stack gets capsules: 'auto' = encoder for encoder and encoder-decoder models, "
            "decoder for decoder-only models; 'both' only applies to encoder-decoder models."
        },
    )
    num_slots: int = field(
        default=1,
        metadata={"help": "Learned slots per layer. num_slots=m with instance_aware=False is Deep Prompt-Tuning."},
    )
    instance_aware: bool = field(
        default=True,
        metadata={"help": "Add the instance summary (mean of the instance's representations) to the slots."},
    )
    mean_norm: str = field(
        default="none",
        metadata={
            "help": "How each instance token enters the instance summary: 'none' (the raw hidden state, the paper's "
            "equation), 'rms' (divided by its root mean square first, x / sqrt(mean(x^2) + eps) with the backbone's "
            "RMSNorm eps, as the authors' sister code MEPT does), so no single massive activation dominates the mean."
        },
    )
    rank: int = field(default=8, metadata={"help": "Rank r of the d->r->d projection for variant='project'."})
    kernel_size: int = field(default=3, metadata={"help": "Convolution width for variant='extract' (odd)."})
    share_instance_module: bool = field(
        default=True,
        metadata={
            "help": "For 'extract'/'project': one convolution/projection shared by all capsule layers (True) "
            "or one per layer (False)."
        },
    )
    layers_path: str | None = field(
        default=None,
        metadata={
            "help": "Dotted path to the nn.ModuleList of transformer layers (e.g. 'model.layers'), for models "
            "whose layers are not found automatically. Applies to a single stack."
        },
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={
            "help": "Names of base submodules trained and saved with the capsules (e.g. ['classifier']). "
            "None: the freshly initialised task head of a classification model ('classifier' or 'score', and "
            "DistilBERT's 'pre_classifier')."
        },
    )
    prompt_method: str | None = field(
        default=None,
        metadata={
            "help": "A prompt-tuning baseline computing the slots instead of the capsules: "
            + ", ".join(PROMPT_OPTIONS)
            + " (see capt.baselines). None: CaPT / Deep Prompt-Tuning as set by the fields above."
        },
    )
    prompt_options: dict[str, Any] | None = field(
        default=None,
        metadata={"help": "Options of prompt_method (capt.baselines.options); missing ones take the paper's defaults."},
    )
    base_model: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "Facts about the model the adapter was saved from (model type, hidden size, capsule layers); "
            "written by save_pretrained and checked when the adapter is attached. Leave it None."
        },
    )

    def __post_init__(self) -> None:
        if hasattr(super(), "__post_init__"):
            super().__post_init__()  # PeftConfig's checks and version stamp
        self.peft_type = PEFT_TYPE
        _check_choice("variant", self.variant, VARIANTS)
        _check_choice("init", self.init, INITS)
        _check_choice("target", self.target, TARGETS)
        _check_choice("mean_norm", self.mean_norm, MEAN_NORMS)
        for name in ("num_slots", "rank", "kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CaptConfig.{name} must be a positive integer, got {value!r}")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"CaptConfig.kernel_size must be odd (keeps the sequence length), got {self.kernel_size}")
        std = self.init_std
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std) or std <= 0:
            raise ValueError(f"CaptConfig.init_std must be a finite number > 0, got {std!r}")
        for name in ("instance_aware", "share_instance_module"):  # a string such as "no" would read as true
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CaptConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.layers_path is not None and (not isinstance(self.layers_path, str) or not self.layers_path):
            raise ValueError(
                f"CaptConfig.layers_path must be a dotted path such as 'model.layers' or None, got {self.layers_path!r}"
            )
        names = self.modules_to_save
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(
                f"CaptConfig.modules_to_save must be a list of module names such as ['classifier'], got {names!r}"
            )
        if not self.instance_aware and self.variant != "add":
            raise ValueError(
                f"CaptConfig.variant={self.variant!r} needs instance_aware=True; "
                "without the instance summary only 'add' (Deep Prompt-Tuning) is meaningful"
            )
        if self.mean_norm != "none" and (not self.instance_aware or self.prompt_method is not None):
            raise ValueError(
                f"CaptConfig.mean_norm={self.mean_norm!r} normalises the instance summary, which only CaPT computes: "
                "it needs instance_aware=True and no prompt_method"
            )
        if self.modules_to_save is not None:
            self.modules_to_save = list(self.modules_to_save)
        if self.prompt_method is not None:
            # Stored complete, so a saved adapter keeps its settings even if a default changes later.
            self.prompt_options = options_dict(make_options(self.prompt_method, self.prompt_options))
            if self.target == "both" and not self.writes_every_layer:
                raise ValueError(
                    f"CaptConfig.prompt_method={self.prompt_method!r} prompts the input layer only; "
                    "target='both' would leave the decoder's slots unwritten: use 'auto' or 'encoder'"
                )
        elif self.prompt_options is not None:
            raise ValueError("CaptConfig.prompt_options needs a prompt_method")

    @property
    def slots_per_layer(self) -> int:
        """Positions the capsule (or the prompt of `prompt_method`) occupies at the front of the sequence."""
        if self.prompt_method is not None:
            return make_options(self.prompt_method, self.prompt_options).num_tokens
        return self.num_slots + (1 if self.variant == "prepend" else 0)

    @property
    def writes_every_layer(self) -> bool:
        """True: the slots are overwritten at every layer (CaPT, Deep Prompt-Tuning, M-IDPG); False: written at the
        input layer only, then they flow through the model as ordinary tokens (prompt tuning)."""
        if self.prompt_method is None:
            return True
        return make_options(self.prompt_method, self.prompt_options).every_layer

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peft_type": PEFT_TYPE}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> CaptConfig:
        """A CaptConfig from stored fields (an adapter_config.json); every error names `source`."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a JSON object of CaptConfig fields, got {type(data).__name__}")
        peft_type = data.get("peft_type", PEFT_TYPE)
        if peft_type != PEFT_TYPE:  # checked first: another method's fields are not worth listing
            raise ValueError(
                f"{source}: this is a {peft_type} adapter (peft_type {peft_type}), not CaPT; "
                "load it with peft.PeftModel.from_pretrained"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - set(PEFT_BOOKKEEPING_KEYS))
        if unknown:
            raise ValueError(f"{source}: unknown CaptConfig fields {unknown}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from err

    @classmethod
    def from_pretrained(cls, path: str | Path, subfolder: str | None = None, **hub_kwargs: Any) -> CaptConfig:
        """Read `adapter_config.json` from an adapter folder.

        PEFT calls this with its download options (`subfolder`, `revision`, `token`, ...); a folder that is not
        on disk is then fetched through PEFT from the Hugging Face Hub.
        """
        directory = Path(path, subfolder or "")
        config_file = directory / CONFIG_NAME
        looks_like_hub_id = not (Path(path).is_absolute() or Path(path).exists())
        if not config_file.is_file() and looks_like_hub_id and config_base() is not object:
            return super().from_pretrained(str(path), subfolder=subfolder, **hub_kwargs)
        if not config_file.is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}: {_what_is_there(directory)}")
        try:
            data = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_file} is not valid JSON: {err}") from err
        return cls.from_dict(data, source=str(config_file))


def _what_is_there(path: Path) -> str:
    """What a path without an adapter_config.json is, for the one-line error that refuses it."""
    if not path.exists():
        return "the path does not exist"
    if not path.is_dir():
        return "it is a file; give the adapter's folder"
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return "it is an empty folder"
    if "config.json" in names:
        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type", "unknown")
        except (json.JSONDecodeError, AttributeError, OSError):
            model_type = "unreadable"
        return f"it holds a full transformers model (config.json, model_type {model_type}), not an adapter"
    if "model.safetensors" in names:
        # What transformers.Trainer writes for a model it cannot save as an adapter (a plain nn.Module, and the
        # CaptModel of capt 0.3, which was not yet a PeftModel to Trainer).
        return (
            "it holds a full state dict (model.safetensors), as transformers.Trainer saves a plain torch module, not "
            "an adapter; Trainer saves a CaptModel or a PEFT model as its adapter (capt >= 0.4, docs/integrations.md)"
        )
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f"it holds {shown}, not a CaPT adapter"


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"CaptConfig.{name} must be one of {list(choices)}, got {value!r}")
