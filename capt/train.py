"""The SuperGLUE recipe: one self-contained training run, top to bottom.

    split (paper protocol) -> backbone -> method -> tokenise (cached) -> train with early stopping on the
    validation score -> restore the best epoch -> score the test split (official val) -> results.json

Runs on Accelerate, so `accelerate launch capt train ...` is data-parallel with no code change.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
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
from .methods import METHODS, MethodOptions, apply_method
from .metrics import task_metrics
from .model import CaptModel, count_parameters
from .reporting import MetricsLog, plot_learning_curves

RESULTS_NAME = "results.json"
RUN_CONFIG_NAME = "run_config.json"
TRAINABLE_NAME = "trainable.safetensors"
CHECKPOINT_NAME = "checkpoint.pt"
FEATURES_VERSION = 2  # bump when TaskFormat.encode changes, so cached tokenisations are rebuilt
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
        if self.optimizer not in ("adamw", "adafactor"):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose adamw or adafactor")
        for name in ("epochs", "batch_size", "eval_batch_size", "grad_accum", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def method_options(self) -> MethodOptions:
        return MethodOptions(self.variant, self.deep_prompt_slots, self.virtual_tokens, self.lora_rank)


@dataclass
class Progress:
    """Where a run stands: everything besides weights and optimizer that a resumed run must restore."""

    epoch: int = 1  # the epoch to run next
    batch: int = 0  # the next batch of that epoch
    step: int = 0  # batches done so far
    best_score: float = -1.0
    best_epoch: int = 0
    epochs_run: int = 0
    elapsed_s: float = 0.0
    stopped: bool = False  # early stopping has ended the run


def train(config: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run one seed of `config`; writes logs, checkpoints, the best trainable weights and results.json.

    With `resume`, continues from `output_dir/checkpoint.pt` (written atomically every `checkpoint_every`
    batches and at each epoch end); on CPU with the same seed the result equals an uninterrupted run.
    """
    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision="bf16" if config.bf16 else "no",
        # Without an accelerator, `cpu=True` is what makes a torchrun/accelerate launch use gloo data parallelism.
        cpu=not torch.accelerator.is_available(),
    )
    set_seed(config.seed)
    out = Path(config.output_dir)
    checkpoint_file = out / CHECKPOINT_NAME
    if resume and not checkpoint_file.is_file():
        raise FileNotFoundError(f"cannot resume: no {CHECKPOINT_NAME} in {out}")
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(out / RUN_CONFIG_NAME, json.dumps(asdict(config), indent=2) + "\n")

    splits = load_splits(config)
    model, fmt = build_model(config)
    features = {name: encode_cached(fmt, examples, config) for name, examples in splits.items()}
    lengths = [fmt.length(f) for f in features["train"]]
    trainable, total = count_parameters(model)
    accelerator.print(
        f"{config.task} / {config.method} on {config.model}: {len(splits['train'])} train, "
        f"{len(splits['validation'])} validation, {len(splits['test'])} test examples; "
        f"trainable {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)"
    )

    optimizer = _optimizer(model, config)
    batches_per_epoch = len(epoch_batches(lengths, config, 1, accelerator.num_processes))
    updates = math.ceil(batches_per_epoch / config.grad_accum) * config.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config.warmup_ratio * updates), updates)
    # The scheduler stays unprepared: Accelerate would step it once per process, but `updates` already counts
    # global batches.
    model, optimizer = accelerator.prepare(model, optimizer)

    progress, best_state = Progress(), None
    if resume:
        progress, best_state = _load_checkpoint(checkpoint_file, accelerator.unwrap_model(model), optimizer, scheduler)
        accelerator.print(f"resuming at epoch {progress.epoch}, batch {progress.batch} (step {progress.step})")
    log = MetricsLog(out, keep_until_step=progress.step if resume else None) if accelerator.is_main_process else None

    def save_checkpoint() -> None:
        if accelerator.is_main_process:
            _save_checkpoint(
                checkpoint_file, progress, accelerator.unwrap_model(model), optimizer, scheduler, best_state
            )
        accelerator.wait_for_everyone()

    started = time.time() - progress.elapsed_s
    for epoch in range(progress.epoch, config.epochs + 1):
        if progress.stopped:
            break
        model.train()
        batches = epoch_batches(lengths, config, epoch, accelerator.num_processes)
        for position in tqdm(
            range(progress.batch, len(batches)),
            desc=f"epoch {epoch}",
            leave=False,
            disable=not accelerator.is_main_process,
        ):
            indices = batches[position][accelerator.process_index :: accelerator.num_processes]
            batch = _to_device(fmt.collate([features["train"][i] for i in indices]), accelerator.device)
            with accelerator.accumulate(model):
                loss = fmt.loss(model, batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"loss is {loss.item()} at epoch {epoch}, step {progress.step + 1} (training examples "
                        f"{indices[:8]}{'...' if len(indices) > 8 else ''}); the last good checkpoint is kept"
                    )
                accelerator.backward(loss)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            progress.step, progress.batch = progress.step + 1, position + 1
            if log:
                log.write(
                    {
                        "kind": "step",
                        "epoch": epoch,
                        "step": progress.step,
                        "loss": loss.item(),
                        "lr": scheduler.get_last_lr()[0],
                    }
                )
            if config.checkpoint_every and progress.step % config.checkpoint_every == 0 and accelerator.sync_gradients:
                progress.elapsed_s = time.time() - started
                save_checkpoint()

        validation = evaluate(
            accelerator.unwrap_model(model),
            fmt,
            features["validation"],
            splits["validation"],
            config.eval_batch_size,
            accelerator.device,
        )
        progress.epochs_run, progress.epoch, progress.batch = epoch, epoch + 1, 0
        progress.elapsed_s = time.time() - started
        if log:
            log.write(
                {
                    "kind": "epoch",
                    "epoch": epoch,
                    "step": progress.step,
                    "elapsed_s": progress.elapsed_s,
                    **{f"validation_{k}": v for k, v in validation.items()},
                }
            )
        if validation["score"] > progress.best_score:
            progress.best_score, progress.best_epoch = validation["score"], epoch
            best_state = trainable_state(accelerator.unwrap_model(model))
        elif epoch - progress.best_epoch >= config.patience:
            accelerator.print(f"early stop: no better validation score for {config.patience} epochs")
            progress.stopped = True
        save_checkpoint()

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
        "best_validation_score": progress.best_score,
        "best_epoch": progress.best_epoch,
        "epochs_run": progress.epochs_run,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_percent": 100 * trainable / total,
        "wall_time_s": round(time.time() - started, 1),
        "train_examples": len(splits["train"]),
        "test_examples": len(splits["test"]),
        "processes": accelerator.num_processes,
    }
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in best_state.items()}, out / TRAINABLE_NAME)
        if isinstance(model, CaptModel):
            model.save_pretrained(out / "adapter")
        _atomic_write_text(out / RESULTS_NAME, json.dumps(results, indent=2) + "\n")
        checkpoint_file.unlink(missing_ok=True)  # the run is complete: nothing left to resume
        log.close()
        plot_learning_curves(out)
    return results


def epoch_batches(lengths: list[int], config: RunConfig, epoch: int, processes: int) -> list[list[int]]:
    """The global batches of one epoch: a pure function of (seed, epoch), so a resumed run replays them exactly.

    Each global batch holds batch_size x processes examples; process k takes every processes-th of them, so N
    processes with batch_size b see the same global batches as one process with batch_size N x b.
    """
    rng = random.Random(config.seed * 100_003 + epoch)
    return length_grouped_batches(lengths, config.batch_size * processes, rng)


def _save_checkpoint(
    path: Path, progress: Progress, model: nn.Module, optimizer, scheduler, best_state: dict[str, torch.Tensor] | None
) -> None:
    state = {
        "progress": asdict(progress),
        "trainable": trainable_state(model),
        "best": best_state or {},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint intact


def _load_checkpoint(path: Path, model: nn.Module, optimizer, scheduler):
    try:
        state = torch.load(path, weights_only=True)
    except Exception as err:  # a torn or foreign file: say which
        raise ValueError(f"{path} is not a readable checkpoint: {err}") from err
    load_trainable_state(model, state["trainable"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return Progress(**state["progress"]), state["best"] or None


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_splits(config: RunConfig) -> dict[str, list[Example]]:
    """The paper's train/validation/test splits of config.task, cut to limit_train / limit_eval if set."""
    splits = paper_splits(config.task, config.data_dir, seed=config.split_seed)
    limits = {"train": config.limit_train, "validation": config.limit_eval, "test": config.limit_eval}
    return {name: examples[: limits[name]] if limits[name] else examples for name, examples in splits.items()}


def build_model(config: RunConfig) -> tuple[nn.Module, TaskFormat]:
    """Backbone + method + the task format for its family."""
    backbone = load_backbone(
        config.model, num_labels=head_outputs(config.task), seed=config.seed, trust_remote_code=config.trust_remote_code
    )
    fmt = make_format(backbone.family, config.task, backbone.tokenizer, config.max_length, config.t5_generate)
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
            [ex.candidates[p] if p >= 0 else "" for ex, p in zip(examples, preds, strict=True)],  # -1: no match
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
            FEATURES_VERSION,
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
