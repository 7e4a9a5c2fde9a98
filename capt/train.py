"""The SuperGLUE recipe: one self-contained training run, top to bottom.

    split (paper protocol) -> backbone -> method -> tokenise (cached) -> train with early stopping on the
    validation score -> restore the best epoch -> score the test split (official val) -> results.json

Runs on Accelerate, so `accelerate launch capt train ...` is data-parallel with no code change.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup
from transformers.optimization import Adafactor

from .backbones import load_backbone
from .data import TASKS, Example, paper_splits
from .formats import TaskFormat, head_outputs, make_format
from .methods import METHODS, MethodOptions, apply_method, count_parameters
from .metrics import task_metrics
from .model import CaptModel
from .reporting import MetricsLog, plot_learning_curves

RESULTS_NAME = "results.json"
RUN_CONFIG_NAME = "run_config.json"
TRAINABLE_NAME = "trainable.safetensors"
# Learning rates that train each method sensibly with AdamW on the MiniLM (override with --lr).
DEFAULT_LR = {
    "capt": 1e-2,
    "deep-prompt": 1e-2,
    "prompt": 3e-2,
    "ptv2": 1e-2,
    "lora": 5e-4,
    "ia3": 5e-3,
    "head": 1e-3,
    "full": 3e-5,
}


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
    cache_dir: str = field(default_factory=lambda: str(Path.home() / ".cache" / "capt" / "features"))

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.lr is None:
            self.lr = DEFAULT_LR[self.method]
        if self.optimizer not in ("adamw", "adafactor"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose adamw or adafactor")
        for name in ("epochs", "batch_size", "eval_batch_size", "grad_accum", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def method_options(self) -> MethodOptions:
        return MethodOptions(self.variant, self.deep_prompt_slots, self.virtual_tokens, self.lora_rank)


def train(config: RunConfig) -> dict[str, Any]:
    """Run one seed of `config`; writes logs, the best trainable weights and results.json to output_dir."""
    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accum, mixed_precision="bf16" if config.bf16 else "no"
    )
    set_seed(config.seed)
    out = Path(config.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_CONFIG_NAME).write_text(json.dumps(asdict(config), indent=2) + "\n")

    splits = load_splits(config)
    model, fmt = build_model(config)
    features = {name: encode_cached(fmt, examples, config) for name, examples in splits.items()}
    trainable, total = count_parameters(model)
    accelerator.print(
        f"{config.task} / {config.method} on {config.model}: {len(splits['train'])} train, "
        f"{len(splits['validation'])} validation, {len(splits['test'])} test examples; "
        f"trainable {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)"
    )

    optimizer = _optimizer(model, config)
    steps_per_epoch = math.ceil(len(features["train"]) / (config.batch_size * config.grad_accum))
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(config.warmup_ratio * steps_per_epoch * config.epochs), steps_per_epoch * config.epochs
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    log = MetricsLog(out) if accelerator.is_main_process else None

    best_score, best_epoch, best_state, epochs_run, step = -1.0, 0, None, 0, 0
    started = time.time()
    rng = random.Random(config.seed)
    for epoch in tqdm(range(1, config.epochs + 1), desc="epochs", disable=not accelerator.is_main_process):
        model.train()
        batches = length_grouped_batches([fmt.length(f) for f in features["train"]], config.batch_size, rng)
        shard = batches[accelerator.process_index :: accelerator.num_processes]
        for indices in tqdm(shard, desc=f"epoch {epoch}", leave=False, disable=not accelerator.is_main_process):
            batch = _to_device(fmt.collate([features["train"][i] for i in indices]), accelerator.device)
            with accelerator.accumulate(model):
                loss = fmt.loss(model, batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"loss is {loss.item()} at epoch {epoch}, step {step + 1} "
                        f"(batch of training examples {indices[:8]}...)"
                    )
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step += 1
            if log:
                log.write(
                    {
                        "kind": "step",
                        "epoch": epoch,
                        "step": step,
                        "loss": loss.item(),
                        "lr": scheduler.get_last_lr()[0],
                    }
                )
        epochs_run = epoch
        validation = evaluate(
            accelerator.unwrap_model(model),
            fmt,
            features["validation"],
            splits["validation"],
            config.eval_batch_size,
            accelerator.device,
        )
        if log:
            log.write(
                {
                    "kind": "epoch",
                    "epoch": epoch,
                    "step": step,
                    "elapsed_s": time.time() - started,
                    **{f"validation_{k}": v for k, v in validation.items()},
                }
            )
        if validation["score"] > best_score:
            best_score, best_epoch = validation["score"], epoch
            best_state = trainable_state(accelerator.unwrap_model(model))
        elif epoch - best_epoch >= config.patience:
            accelerator.print(f"early stop: no better validation score for {config.patience} epochs")
            break

    model = accelerator.unwrap_model(model)
    load_trainable_state(model, best_state)
    test = evaluate(model, fmt, features["test"], splits["test"], config.eval_batch_size, accelerator.device)
    results = {
        "task": config.task,
        "method": config.method,
        "variant": config.variant,
        "model": config.model,
        "seed": config.seed,
        "test": test,
        "score": test["score"],
        "best_validation_score": best_score,
        "best_epoch": best_epoch,
        "epochs_run": epochs_run,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_percent": 100 * trainable / total,
        "wall_time_s": round(time.time() - started, 1),
        "train_examples": len(splits["train"]),
        "test_examples": len(splits["test"]),
    }
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in best_state.items()}, out / TRAINABLE_NAME)
        if isinstance(model, CaptModel):
            model.save_pretrained(out / "adapter")
        (out / RESULTS_NAME).write_text(json.dumps(results, indent=2) + "\n")
        log.close()
        plot_learning_curves(out)
    return results


def load_splits(config: RunConfig) -> dict[str, list[Example]]:
    """The paper's train/validation/test splits of config.task, cut to limit_train / limit_eval if set."""
    splits = paper_splits(config.task, config.data_dir, seed=config.split_seed)
    limits = {"train": config.limit_train, "validation": config.limit_eval, "test": config.limit_eval}
    return {name: examples[: limits[name]] if limits[name] else examples for name, examples in splits.items()}


def build_model(config: RunConfig) -> tuple[nn.Module, TaskFormat]:
    """Backbone + method + the task format for its family."""
    backbone = load_backbone(config.model, num_labels=head_outputs(config.task), seed=config.seed)
    fmt = make_format(backbone.family, config.task, backbone.tokenizer, config.max_length)
    return apply_method(backbone, config.method, config.method_options()), fmt


@torch.no_grad()
def evaluate(
    model: nn.Module,
    fmt: TaskFormat,
    features: list[dict],
    examples: list[Example],
    batch_size: int,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Predict every example (in length order, for less padding) and compute the task's metrics."""
    model.eval()
    order = sorted(range(len(features)), key=lambda i: fmt.length(features[i]))
    predictions: dict[int, int] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = _to_device(fmt.collate([features[i] for i in chunk]), device)
        predictions.update(zip(chunk, fmt.predict(model, batch), strict=True))
    preds = [predictions[i] for i in range(len(examples))]
    if fmt.task == "record":
        return task_metrics(
            "record",
            [ex.candidates[p] for ex, p in zip(examples, preds, strict=True)],
            [list(ex.answers) for ex in examples],
        )
    return task_metrics(fmt.task, preds, [ex.label for ex in examples], groups=[ex.group for ex in examples])


def length_grouped_batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar length: sort within shuffled pools of 50 batches, then shuffle batches."""
    indices = list(range(len(lengths)))
    rng.shuffle(indices)
    pool = 50 * batch_size
    batches = []
    for start in range(0, len(indices), pool):
        chunk = sorted(indices[start : start + pool], key=lengths.__getitem__)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def encode_cached(fmt: TaskFormat, examples: list[Example], config: RunConfig) -> list[dict]:
    """Tokenise once per (task, split content, tokenizer, family, max length); later runs read the cache."""
    key = json.dumps(
        [
            type(fmt).__name__,
            fmt.task,
            fmt.max_length,
            fmt.tokenizer.name_or_path,
            len(fmt.tokenizer),
            [str(ex.idx) for ex in examples],
        ]
    )
    path = Path(config.cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    if path.is_file():
        return torch.load(path)
    features = [fmt.encode(ex) for ex in examples]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{id(features)}.tmp")
    torch.save(features, tmp)
    tmp.replace(path)
    return features


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


def load_run(run_dir: str | Path) -> tuple[RunConfig, nn.Module, TaskFormat]:
    """Rebuild a finished run's model with its best weights (for `capt eval`)."""
    run_dir = Path(run_dir)
    config_file = run_dir / RUN_CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: no {RUN_CONFIG_NAME}")
    config = RunConfig(**json.loads(config_file.read_text()))
    model, fmt = build_model(config)
    load_trainable_state(model, load_file(run_dir / TRAINABLE_NAME))
    return config, model, fmt


def _optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    heads = [p for n, p in model.named_parameters() if p.requires_grad and _is_head(n)]
    others = [p for n, p in model.named_parameters() if p.requires_grad and not _is_head(n)]
    groups = [{"params": others, "lr": config.lr}]
    if heads and config.method != "full":
        groups.append({"params": heads, "lr": config.head_lr})
    else:
        groups[0]["params"] = others + heads
    if config.optimizer == "adafactor":
        return Adafactor(
            groups, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(groups, weight_decay=config.weight_decay)


def _is_head(name: str) -> bool:
    return any(part in ("classifier", "score") for part in name.split("."))


def _to_device(value: Any, device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value
