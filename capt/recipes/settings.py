"""The settings of a run (`RunConfig`) and the names the CLI offers, without torch: `capt --help` reads them.

`capt.recipes.run` re-exports `RunConfig`; the method registry (`methods.py`) and the backbone loader
(`backbones.py`) import their names from here, so the help text is made from the same tuples that the runs check.

Example:
    >>> RunConfig(task="cb", method="lora").lr
    0.0005
    >>> field_help("variant")
    'capt only: how the instance summary enters the capsule (default: add; one of: add, prepend, extract, project)'
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from ..baselines.options import PROMPT_OPTIONS
from ..variants import VARIANTS
from .gguf import GGUF_BACKBONES
from .tasks import builtin_tasks, get_task

PROMPT_METHODS = tuple(PROMPT_OPTIONS)  # dept, lopa, idpg, m-idpg, smop, residual, vfpt
CAPT_METHODS = ("capt", "capt-rms")  # CaPT and its mean-normalised variant: the methods that take --variant
METHODS = (*CAPT_METHODS, "deep-prompt", "prompt", "ptv2", "lora", "ia3", *PROMPT_METHODS, "adapter", "head", "full")
PEFT_METHODS = ("prompt", "ptv2", "lora", "ia3")
# Random 2-layer models on the MiniLM tokenizer, for tests and quick runs: name -> architecture.
TINY_MODELS = {"tiny-t5": "t5", "tiny-llama": "llama", "tiny-gpt2": "gpt2"}
# The backbones known by name (any other --model is a local folder or a Hub id).
NAMED_MODELS = ("minilm", *GGUF_BACKBONES, *TINY_MODELS)
# How a decoder prompt starts: "tokenizer" adds a BOS only where the tokenizer itself adds one (the default, as
# lm-evaluation-harness and the tokenizer's own chat template do); "always" puts the tokenizer's `bos_token` text in
# front of every prompt, as capt did before 0.3 (the recorded setting of the runs made then).
PROMPT_BOS = ("tokenizer", "always")
DECODER_HEADS = ("lm", "classifier")


@dataclass(frozen=True)
class MethodOptions:
    """The settings of a method, as `apply_method` (methods.py) reads them (`RunConfig.method_options()`)."""

    variant: str = "add"  # capt: add | prepend | extract | project
    deep_prompt_slots: int = 10  # deep-prompt: m task slots per layer
    virtual_tokens: int = 20  # prompt / ptv2: soft-prompt length
    lora_rank: int = 8
    prompt_length: int | None = None  # dept / lopa / idpg / m-idpg / smop / residual / vfpt: None = the paper's default
    prompt_rank: int | None = None  # dept, lopa: rank of the low-rank part; None = the paper's default
    bottleneck: int | None = None  # idpg / m-idpg / residual / adapter: bottleneck width; None = the paper's default

    def prompt_options(self, method: str) -> dict[str, typing.Any]:
        """The options given for prompt method `method`; the ones left None take the paper's defaults."""
        known = PROMPT_OPTIONS[method].__dataclass_fields__
        given = {"length": self.prompt_length, "rank": self.prompt_rank, "bottleneck": self.bottleneck}
        return {key: value for key, value in given.items() if value is not None and key in known}


# Learning rates that train each method sensibly with AdamW on the MiniLM (override with --lr). The entries of the
# capt.baselines methods (dept ... adapter) are starting points, not yet tuned.
DEFAULT_LR = {
    "capt": 1e-2,
    "capt-rms": 1e-2,  # CaPT's
    "deep-prompt": 1e-2,
    "prompt": 3e-2,
    "ptv2": 1e-2,
    "lora": 5e-4,
    "ia3": 5e-3,
    "dept": 1e-2,
    "lopa": 1e-3,  # jabhinav/Prompt-Tuning-Strikes-Back-with-LOPA README: 1e-3 for the prompt-tuning methods
    "idpg": 1e-3,
    "m-idpg": 1e-3,
    "smop": 3e-2,
    "residual": 1e-2,
    "vfpt": 1e-2,  # Deep Prompt-Tuning's
    "adapter": 1e-3,
    "head": 1e-3,
    "full": 3e-5,
}


# DePT's second learning rate (its low-rank pair): the smallest of the authors' grid {5e-4, 5e-3, 3e-1}
# (ZhengxiangShi/DePT README), below the prompt's at every learning rate the study tries.
DEFAULT_LR_SECONDARY = 5e-4


@dataclass
class RunConfig:
    """One training run. Every field is a `capt train` flag and a YAML key (see configs/)."""

    task: str = "rte"  # a built-in task, a registered user task, or a task YAML file (read and registered)
    method: str = "capt"
    variant: str = "add"
    model: str = "minilm"
    data_dir: str | None = None
    output_dir: str = "runs/latest"
    epochs: int = 10
    patience: int = 3
    lr: float | None = None  # None: the method's default (DEFAULT_LR)
    head_lr: float = 1e-3  # task heads of encoder classifiers, trained alongside input-side methods
    # DePT's second learning rate, for its low-rank pair A, B (parameters under `secondary`); None: 5e-4, the
    # smallest of the authors' grid (the prompt takes --lr).
    lr_secondary: float | None = None
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # adamw | adafactor
    warmup_ratio: float = 0.06
    batch_size: int = 16
    eval_batch_size: int = 32
    grad_accum: int = 1
    max_length: int = 256
    bf16: bool = False
    seed: int = 0
    split_seed: int = 0  # the 90/10 split stays fixed across training seeds
    limit_train: int | None = None  # use the first N training examples (quick runs)
    limit_eval: int | None = None  # use the first N validation/test examples (quick runs)
    deep_prompt_slots: int = 10
    virtual_tokens: int = 20
    lora_rank: int = 8
    decoder_head: str = "lm"  # decoder-only: lm (label-word likelihoods) | classifier (score head on the last token)
    # Decoder prompts: "tokenizer" adds a BOS only where the tokenizer does; "always" puts the BOS text first, as
    # runs before capt 0.3 did (a run_config.json without this key reads back as "always").
    prompt_bos: str = "tokenizer"
    prompt_length: int | None = None  # dept, lopa, idpg, m-idpg, smop, residual, vfpt: None = the paper's default
    prompt_rank: int | None = None  # dept, lopa: None = the paper's default
    bottleneck: int | None = None  # idpg, m-idpg, residual, adapter: None = the paper's default
    t5_generate: bool = False  # T5: predict by greedy decoding + exact match instead of label-word likelihoods
    checkpoint_every: int = 50  # batches between crash-safe checkpoints (0: only at epoch ends)
    trust_remote_code: bool = False  # run code shipped with a Hub model (off unless asked)
    cache_dir: str = field(default_factory=lambda: str(Path.home() / ".cache" / "capt" / "features"))

    def __post_init__(self) -> None:
        for spec in fields(self):
            setattr(self, spec.name, _checked(spec.name, getattr(self, spec.name)))
        try:
            self.task = get_task(self.task).name  # a task file is read (and registered) here, then named
        except ValueError as err:
            raise ValueError(f"{_where('task')}: {err}") from err
        if self.lr is None:
            self.lr = DEFAULT_LR[self.method]
        if self.decoder_head not in DECODER_HEADS:
            raise ValueError(f"{_where('decoder_head')}: {self.decoder_head!r} is not lm or classifier")
        if self.lr_secondary is None:
            self.lr_secondary = DEFAULT_LR_SECONDARY
        if self.variant != "add" and self.method not in CAPT_METHODS:
            raise ValueError(
                f"{_where('variant')}: {self.variant!r} applies to --method capt or capt-rms only, "
                f"not {self.method!r}; drop --variant"
            )

    def method_options(self) -> MethodOptions:
        return MethodOptions(
            self.variant,
            self.deep_prompt_slots,
            self.virtual_tokens,
            self.lora_rank,
            self.prompt_length,
            self.prompt_rank,
            self.bottleneck,
        )


# The allowed values of every RunConfig field, checked in __post_init__ (so flags, YAML and run_config.json
# all meet the same rules). A tuple: the choices; a pair of numbers (low, high): an inclusive range, None = open.
FIELD_RULES: dict[str, tuple] = {
    "prompt_bos": PROMPT_BOS,
    "decoder_head": DECODER_HEADS,
    "method": tuple(METHODS),
    "variant": VARIANTS,
    "optimizer": ("adamw", "adafactor"),
    "epochs": (1, None),
    "patience": (1, None),
    "lr": (0.0, None),
    "head_lr": (0.0, None),
    "weight_decay": (0.0, None),
    "warmup_ratio": (0.0, 1.0),
    "batch_size": (1, None),
    "eval_batch_size": (1, None),
    "grad_accum": (1, None),
    "max_length": (8, None),  # room for a template's special tokens and the label words
    "seed": (0, 2**32 - 1),  # numpy's seed range
    "split_seed": (0, 2**32 - 1),
    "limit_train": (1, None),
    "limit_eval": (1, None),
    "deep_prompt_slots": (1, None),
    "virtual_tokens": (1, None),
    "lora_rank": (1, None),
    "checkpoint_every": (0, None),
    "lr_secondary": (0.0, None),
    "prompt_length": (1, None),
    "prompt_rank": (1, None),
    "bottleneck": (1, None),
}
POSITIVE = {"head_lr"}  # > 0, not just >= 0 (lr 0 is allowed: a run that trains nothing, a sanity check)


def _where(name: str) -> str:
    return f"--{name.replace('_', '-')} (YAML key {name})"


def field_kind(name: str) -> tuple[type, bool]:
    """(bool | int | float | str, whether None is allowed) of a RunConfig field, from its type hint.

    Example:
        >>> field_kind("limit_train")
        (<class 'int'>, True)
    """
    hint = typing.get_type_hints(RunConfig)[name]
    args = typing.get_args(hint) or (hint,)
    return next(a for a in args if a is not type(None)), type(None) in args


def _checked(name: str, value: object) -> object:
    """`value` as the field's type, or a ValueError naming the flag, the value and what is allowed."""
    kind, optional = field_kind(name)
    if value is None and optional:
        return None
    rule = FIELD_RULES.get(name)
    if kind is float and isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        raise ValueError(f"{_where(name)}: got {value!r}; expected {wanted}{' or null' if optional else ''}")
    if rule is None:
        if kind is str and not value:
            raise ValueError(f"{_where(name)}: must not be empty")
        return value
    if isinstance(rule[0], str):
        if value not in rule:
            raise ValueError(f"{_where(name)}: unknown {name} {value!r}; {name} must be one of {', '.join(rule)}")
        return value
    low, high = rule
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{_where(name)}: got {value}; expected a finite number")
    if value < low or (name in POSITIVE and value <= low) or (high is not None and value > high):
        allowed = f"> {low}" if name in POSITIVE else f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{_where(name)}: {name} must be {allowed}, got {value}")
    return value


# What each RunConfig field means, for `capt train --help` (the default and the choices are added by field_help).
FIELD_HELP = {
    "task": "a built-in task, a task YAML file (docs/your-data.md), or a task registered by --train-file",
    "method": "the fine-tuning method",
    "variant": "capt and capt-rms only: how the instance summary enters the capsule",
    "model": "the backbone: a packaged name, a local folder or a Hugging Face Hub id",
    "data_dir": "SuperGLUE folder (default: $CAPT_DATA_DIR, else the Hugging Face Hub)",
    "output_dir": "the run folder (weights, metrics, results.json)",
    "epochs": "training epochs",
    "patience": "stop after this many epochs without a better validation score",
    "lr": "learning rate (default: the method's: " + ", ".join(f"{m} {lr:g}" for m, lr in DEFAULT_LR.items()) + ")",
    "head_lr": "learning rate of an encoder classifier's task head, trained alongside input-side methods",
    "lr_secondary": f"dept only: learning rate of its low-rank pair A, B (default: {DEFAULT_LR_SECONDARY:g})",
    "weight_decay": "AdamW weight decay",
    "optimizer": "the optimizer",
    "warmup_ratio": "share of the training steps with a linear learning-rate warm-up",
    "batch_size": "training examples per step (per device)",
    "eval_batch_size": "examples per scoring batch",
    "grad_accum": "batches accumulated into one optimizer step",
    "max_length": "tokens per input; longer inputs are truncated",
    "bf16": "train in bfloat16 autocast",
    "seed": "training seed (with --seeds N: the first of N)",
    "split_seed": "seed of the 90/10 train/validation split, fixed across training seeds",
    "limit_train": "use the first N training examples (MultiRC, ReCoRD: the whole passages among them, at least one; "
    "default: all)",
    "limit_eval": "use the first N validation and test examples (MultiRC, ReCoRD: whole passages, as --limit-train; "
    "default: all)",
    "deep_prompt_slots": "deep-prompt only: task slots per layer",
    "virtual_tokens": "prompt and ptv2 only: soft-prompt length",
    "lora_rank": "lora only: the rank r (alpha = 2r)",
    "decoder_head": "decoder-only models: lm scores the label words, classifier adds a score head on the last token",
    "prompt_bos": "decoder prompts: tokenizer adds a BOS where the tokenizer does, always puts it first (runs "
    "before capt 0.3)",
    "prompt_length": "dept, lopa, idpg, m-idpg, smop, residual, vfpt: prompt length (default: the paper's)",
    "prompt_rank": "dept, lopa: rank of the low-rank part (default: the paper's)",
    "bottleneck": "idpg, m-idpg, residual, adapter: bottleneck width (default: the paper's)",
    "t5_generate": "T5: predict by greedy decoding and exact match instead of label-word likelihoods",
    "checkpoint_every": "batches between crash-safe checkpoints (0: only at epoch ends)",
    "trust_remote_code": "run code shipped with a Hub model",
    "cache_dir": "folder of the tokenised-feature cache",
}


def field_choices(name: str) -> tuple[str, ...]:
    """The names a RunConfig field takes: the closed sets of FIELD_RULES, and the known names of the open ones
    (`task` also takes files, `model` folders); () for a number, a path or a flag."""
    if name == "task":
        return tuple(builtin_tasks())
    if name == "model":
        return NAMED_MODELS
    rule = FIELD_RULES.get(name, ())
    return rule if rule and isinstance(rule[0], str) else ()


def field_help(name: str) -> str:
    """The `--help` line of a RunConfig field: what it means, its default and its choices."""
    spec = next(f for f in fields(RunConfig) if f.name == name)
    default = spec.default_factory() if spec.default is MISSING else spec.default
    text = FIELD_HELP[name]
    notes = []
    if default is not None:
        shown = {True: "on", False: "off"}.get(default, default) if isinstance(default, bool) else default
        if isinstance(shown, str) and shown.startswith(str(Path.home())):  # the cache folder, as the user writes it
            shown = "~" + shown.removeprefix(str(Path.home()))
        notes.append(f"default: {shown}")
    choices = field_choices(name)
    if choices:
        notes.append(f"{'known' if name in ('task', 'model') else 'one of'}: {', '.join(choices)}")
    return f"{text} ({'; '.join(notes)})" if notes else text
