"""A run: its settings (`RunConfig`), its folder, and what it learned.

A run folder, as `capt train` writes it:

    run_config.json         the settings (RunConfig), written first
    checkpoint.pt           while the run goes on: weights, optimizer and progress (for --resume)
    metrics.jsonl/.csv      one record per step and per epoch
    trainable.safetensors   the best epoch's trainable parameters, whatever the method
    adapter/                for CaPT and Deep Prompt-Tuning: the same weights as a loadable adapter
    results.json            the test scores, written last: a folder with it is a finished run

`load_run` rebuilds a finished run's model for `capt eval`, `capt predict` and `capt analyze`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .backbones import load_backbone
from .data import TASKS
from .formats import TaskFormat, head_outputs, make_format
from .methods import METHODS, MethodOptions, apply_method

RESULTS_NAME = "results.json"
RUN_CONFIG_NAME = "run_config.json"
TRAINABLE_NAME = "trainable.safetensors"
CHECKPOINT_NAME = "checkpoint.pt"
ADAPTER_DIR = "adapter"
# Learning rates that train each method sensibly with AdamW on the MiniLM (override with --lr). The entries of the
# capt.baselines methods (dept ... adapter) are starting points, not yet tuned.
DEFAULT_LR = {
    "capt": 1e-2,
    "deep-prompt": 1e-2,
    "prompt": 3e-2,
    "ptv2": 1e-2,
    "lora": 5e-4,
    "ia3": 5e-3,
    "dept": 1e-2,
    "lopa": 1e-2,
    "idpg": 1e-3,
    "m-idpg": 1e-3,
    "smop": 3e-2,
    "residual": 1e-2,
    "adapter": 1e-3,
    "head": 1e-3,
    "full": 3e-5,
}


DEFAULT_LR_SECONDARY = 1e-4


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
    # DePT's second learning rate, for its low-rank pair A, B (parameters under `secondary`); None: 1e-4, as in
    # DePT's own setup (the prompt takes --lr).
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
    prompt_length: int | None = None  # dept, lopa, idpg, m-idpg, smop, residual: None = the paper's default
    prompt_rank: int | None = None  # dept, lopa: None = the paper's default
    bottleneck: int | None = None  # idpg, m-idpg, residual, adapter: None = the paper's default
    t5_generate: bool = False  # T5: predict by greedy decoding + exact match instead of label-word likelihoods
    checkpoint_every: int = 50  # batches between crash-safe checkpoints (0: only at epoch ends)
    trust_remote_code: bool = False  # run code shipped with a Hub model (off unless asked)
    cache_dir: str = field(default_factory=lambda: str(Path.home() / ".cache" / "capt" / "features"))

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.lr is None:
            self.lr = DEFAULT_LR[self.method]
        if self.decoder_head not in ("lm", "classifier"):
            raise ValueError(f"unknown decoder_head {self.decoder_head!r}; choose lm or classifier")
        if self.lr_secondary is None:
            self.lr_secondary = DEFAULT_LR_SECONDARY
        if self.optimizer not in ("adamw", "adafactor"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose adamw or adafactor")
        for name in ("epochs", "batch_size", "eval_batch_size", "grad_accum", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

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


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The settings of a run folder written by `capt train`."""
    config_file = Path(run_dir) / RUN_CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder from `capt train`: no {RUN_CONFIG_NAME}")
    return RunConfig(**json.loads(config_file.read_text()))


def build_model(config: RunConfig) -> tuple[nn.Module, TaskFormat]:
    """Backbone + method + the task format for its family."""
    backbone = load_backbone(
        config.model,
        num_labels=head_outputs(config.task),
        seed=config.seed,
        trust_remote_code=config.trust_remote_code,
        decoder_head=config.decoder_head,
    )
    fmt = make_format(
        backbone.family, config.task, backbone.tokenizer, config.max_length, config.t5_generate, config.decoder_head
    )
    return apply_method(backbone, config.method, config.method_options()), fmt


def load_run(run_dir: str | Path) -> tuple[RunConfig, nn.Module, TaskFormat]:
    """Rebuild a finished run's model with its best weights (for `capt eval`, `predict` and `analyze`)."""
    config = read_run_config(run_dir)
    model, fmt = build_model(config)
    load_trainable_state(model, load_file(Path(run_dir) / TRAINABLE_NAME))
    return config, model, fmt


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
