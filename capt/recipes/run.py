"""A run: its settings (`RunConfig`), its folder, and what it learned.

A run folder, as `capt train` writes it:

    checkpoint.pt           while the run goes on: settings, weights, optimizer and progress (for --resume)
    metrics.jsonl/.csv      one record per step and per epoch
    trainable.safetensors   the best epoch's trainable parameters, whatever the method
    run_config.json         the settings (RunConfig), written with those weights
    adapter/                for CaPT and Deep Prompt-Tuning: the same weights as a loadable adapter
    results.json            the test scores, written last: a folder with it is a finished run

The finished files are written only at the end, so `--overwrite` leaves the previous run's settings, weights and
results in place (and usable) until the new ones replace them; only the metrics log starts afresh.

`load_run` rebuilds a finished run's model for `capt eval`, `capt predict` and `capt analyze`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import typing
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..config import VARIANTS
from .backbones import load_backbone
from .data import TASKS
from .formats import TaskFormat, head_outputs, make_format
from .methods import CAPT_METHODS, METHODS, MethodOptions, apply_method, extra_positions

RESULTS_NAME = "results.json"
RUN_CONFIG_NAME = "run_config.json"
TRAINABLE_NAME = "trainable.safetensors"
CHECKPOINT_NAME = "checkpoint.pt"
ADAPTER_DIR = "adapter"
LOCK_NAME = ".capt.lock"
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

    task: str = "rte"
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
        if self.lr is None:
            self.lr = DEFAULT_LR[self.method]
        if self.decoder_head not in ("lm", "classifier"):
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
    "task": tuple(TASKS),
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


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The settings of a run folder written by `capt train`.

    Keys this version does not know (a run written by a newer version) are ignored with a warning that names
    them, so `capt eval` and `capt predict` still work; the known keys are checked as for a new run.
    """
    config_file = Path(run_dir) / RUN_CONFIG_NAME
    if not config_file.is_file() and (Path(run_dir) / CHECKPOINT_NAME).is_file():
        raise FileNotFoundError(f"{run_dir} holds a run that has not finished: complete it with `capt train --resume`")
    if not config_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder from `capt train`: no {RUN_CONFIG_NAME}")
    try:
        settings = json.loads(config_file.read_text())
    except ValueError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}); the run folder is damaged") from err
    return run_config_from_dict(settings, config_file)


def run_config_from_dict(settings: object, source: Path) -> RunConfig:
    """RunConfig from stored settings (run_config.json, a checkpoint); errors and unknown keys name `source`.

    Fields missing from `settings` (added after the file was written) take their defaults.
    """
    if not isinstance(settings, dict):
        raise ValueError(f"{source}: expected a JSON object of settings")
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        warnings.warn(f"{source}: ignoring settings this version does not know: {unknown}", stacklevel=3)
    try:
        return RunConfig(**{k: v for k, v in settings.items() if k in known})
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from err


# Settings that cannot change a run's result: where its files live (the data may be reached by another path),
# how often it checkpoints, the scoring batch size, and whether Hub code may run.
NOT_RESULT_SETTINGS = frozenset(
    {"output_dir", "data_dir", "cache_dir", "checkpoint_every", "eval_batch_size", "trust_remote_code"}
)


# Settings that only some methods read: for any other method they cannot change the result (so a new default,
# such as DePT's second learning rate, does not turn every finished CaPT run into "other settings").
METHOD_ONLY_SETTINGS = {
    "lr_secondary": {"dept"},
    "deep_prompt_slots": {"deep-prompt"},
    "virtual_tokens": {"prompt", "ptv2"},
    "lora_rank": {"lora"},
}


def setting_differences(
    config: RunConfig, stored: RunConfig, ignore: frozenset[str] = NOT_RESULT_SETTINGS
) -> dict[str, tuple[object, object]]:
    """{field: (stored value, requested value)} for every field in which the two differ, leaving out `ignore` and
    the settings the requested method does not read (METHOD_ONLY_SETTINGS).

    Example:
        >>> setting_differences(RunConfig(lr=0.5), RunConfig())
        {'lr': (0.01, 0.5)}
        >>> setting_differences(RunConfig(lr_secondary=0.1), RunConfig())  # capt never reads it
        {}
    """
    unread = {name for name, methods in METHOD_ONLY_SETTINGS.items() if config.method not in methods}
    wanted, kept = asdict(config), asdict(stored)
    return {
        name: (kept[name], value)
        for name, value in wanted.items()
        if name not in ignore | unread and kept[name] != value
    }


def describe_differences(differences: dict[str, tuple[object, object]]) -> str:
    """`lr 0.01 -> 0.5; epochs 10 -> 3`: stored -> requested, for one-line errors."""
    return "; ".join(f"{name} {kept!r} -> {wanted!r}" for name, (kept, wanted) in differences.items())


def build_model(config: RunConfig) -> tuple[nn.Module, TaskFormat]:
    """Backbone + method + the task format for its family."""
    backbone = load_backbone(
        config.model,
        num_labels=head_outputs(config.task),
        seed=config.seed,
        trust_remote_code=config.trust_remote_code,
        decoder_head=config.decoder_head,
    )
    max_length = config.max_length
    if backbone.max_positions is not None:  # an absolute position table must also hold the method's slots
        if max_length > backbone.max_positions:
            raise ValueError(
                f"--max-length {max_length} is beyond the {backbone.max_positions} positions of {config.model}"
            )
        max_length = min(max_length, backbone.max_positions - extra_positions(config.method, config.method_options()))
    fmt = make_format(
        backbone.family, config.task, backbone.tokenizer, max_length, config.t5_generate, config.decoder_head
    )
    return apply_method(backbone, config.method, config.method_options()), fmt


def load_run(run_dir: str | Path) -> tuple[RunConfig, nn.Module, TaskFormat]:
    """Rebuild a finished run's model with its best weights (for `capt eval`, `predict` and `analyze`)."""
    config = read_run_config(run_dir)
    model, fmt = build_model(config)
    load_trainable_state(model, read_trainable(Path(run_dir) / TRAINABLE_NAME))
    return config, model, fmt


def read_trainable(path: Path) -> dict[str, torch.Tensor]:
    """The weights file of a run, or a ValueError saying it is missing, torn or holds NaN/inf."""
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent}: the run did not finish (train it with --resume)")
    try:
        state = load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is truncated or corrupt ({err}); retrain with --overwrite") from err
    bad = [name for name, tensor in state.items() if not torch.isfinite(tensor).all()]
    if bad:
        raise ValueError(f"{path} holds NaN or inf weights in {bad[:3]}; retrain with --overwrite")
    return state


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of every trainable parameter (what a run learns, whatever the method)."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(state) - set(params))
    if missing:
        raise ValueError(f"saved weights do not fit this model: unknown parameters {missing[:5]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


class RunLockedError(OSError):
    """Another process is writing into the run folder."""


@contextlib.contextmanager
def run_lock(run_dir: str | Path):
    """Hold the run folder's lock (fcntl, freed by the OS even after kill -9) while a run writes into it.

    A second writer gets a RunLockedError naming the holder's pid and host. Under torchrun/accelerate only rank 0
    takes it: the other ranks write nothing.

    Example:
        >>> with run_lock("runs/cb"):  # doctest: +SKIP
        ...     train(config)
    """
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RunLockedError(
                f"{run_dir} is in use by {holder}; wait for it to finish or choose another --output-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_results(path: Path) -> dict:
    """A results.json as the summary over seeds. A run killed between its seed's results and the summary (one
    seed: the same file) left a seed's results: it is summarised here and the file completed."""
    from .reporting import aggregate_seeds

    try:
        results = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is damaged ({err}); rerun that run with --overwrite") from err
    if "runs" not in results:
        results = aggregate_seeds([results])
        from ..saving import atomic_write_text

        atomic_write_text(path, json.dumps(results, indent=2) + "\n")
    return results
