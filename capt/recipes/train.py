"""The SuperGLUE training recipe: one self-contained run, in named steps.

    setup:   data (the paper's split, tokenised and cached) -> model (backbone + method) -> optimizer
    train:   epochs of batches, a validation score per epoch, early stopping, crash-safe checkpoints
    finish:  restore the best epoch -> score the test split (official val) -> results.json

Runs on Accelerate, so `accelerate launch capt train ...` is data-parallel with no code change.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import extract_model_from_parallel, set_seed
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup
from transformers.optimization import Adafactor

from ..baselines.registry import auxiliary_loss
from ..model import CaptModel, count_parameters
from ..optim import param_groups
from ..saving import atomic_write, atomic_write_text
from .evaluate import encode_cached, evaluate, load_task, to_device
from .formats import TaskFormat
from .methods import method_revision
from .reporting import MetricsLog, environment, plot_learning_curves
from .run import (
    ADAPTER_DIR,
    CHECKPOINT_NAME,
    NOT_RESULT_SETTINGS,
    RESULTS_NAME,
    RUN_CONFIG_NAME,
    TRAINABLE_NAME,
    RunConfig,
    build_model,
    describe_differences,
    load_trainable_state,
    read_run_config,
    run_config_from_dict,
    setting_differences,
    trainable_state,
)
from .tasks import TASK_FILE_NAME, builtin_tasks, write_task_file


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


SLOW_BF16_WARNING = (
    "warning: --bf16 on a CPU without bf16 matrix support (no AVX512 / AMX for oneDNN): autocast runs torch's "
    "fallback bf16 kernel, measured 18x slower than float32 on an AVX2-only EPYC. Drop --bf16 (YAML `bf16: false`) "
    "unless you need to match runs made in bf16"
)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matrix products through oneDNN (AVX512 or AMX); without it bf16 is far slower
    than float32, so `--bf16` only pays off on CPUs where this is True (and on accelerators)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def slow_bf16(config: RunConfig, device: torch.device) -> bool:
    """Whether `config` asks for bf16 autocast where it is slower than float32 (a CPU without oneDNN bf16)."""
    return config.bf16 and device.type == "cpu" and not cpu_has_fast_bf16()


def train(config: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run one seed of `config`; writes logs, checkpoints, the best trainable weights and results.json.

    With `resume`, continues from `output_dir/checkpoint.pt` (written atomically every `checkpoint_every`
    batches and at each epoch end); on CPU with the same seed the result equals an uninterrupted run.

    Example:
        >>> results = train(RunConfig(task="cb", model="tiny-llama", epochs=1, limit_train=8))  # doctest: +SKIP
    """
    recipe = TrainingRecipe(config)
    recipe.setup(resume)
    recipe.train()
    return recipe.finish()


class TrainingRecipe:
    """The steps of one run; `train()` above calls them in order."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.out = Path(config.output_dir)
        self.checkpoint_file = self.out / CHECKPOINT_NAME
        self.accelerator = Accelerator(
            gradient_accumulation_steps=config.grad_accum,
            mixed_precision="bf16" if config.bf16 else "no",
            # Without an accelerator, `cpu=True` is what makes a torchrun/accelerate launch use gloo data parallelism.
            cpu=not torch.accelerator.is_available(),
        )
        self.progress = Progress()
        self.best_state: dict[str, torch.Tensor] | None = None
        self.log: MetricsLog | None = None

    # ------------------------------------------------------------------ setup

    def setup(self, resume: bool) -> None:
        config, accelerator = self.config, self.accelerator
        set_seed(config.seed)
        if resume and not self.checkpoint_file.is_file():
            raise FileNotFoundError(
                f"cannot resume: no {CHECKPOINT_NAME} in {self.out} (killed before the first checkpoint?); "
                "start it again with --overwrite"
            )
        checkpoint = self._read_checkpoint() if resume else None
        if checkpoint is not None:
            check_resumable(config, self._checkpoint_settings(checkpoint))
        if slow_bf16(config, accelerator.device):
            accelerator.print(SLOW_BF16_WARNING)
        # First: a data error stops the run before the model loads. A user task's labels come from its data.
        self.spec, self.splits, self.scored_split = load_task(config)
        self._setup_model()
        self._setup_data()
        self._setup_optimizer()
        if accelerator.is_main_process:
            # The folder's finished files (settings, weights, results) stay until finish() replaces them, each as
            # its new version is written: a re-run that fails or is killed leaves the finished run whole. The new
            # run's settings travel in its checkpoints meanwhile.
            self.out.mkdir(parents=True, exist_ok=True)
        self.model, self.optimizer = accelerator.prepare(self.model, self.optimizer)
        if checkpoint is not None:
            self._load_checkpoint(checkpoint)
            p = self.progress
            accelerator.print(f"resuming at epoch {p.epoch}, batch {p.batch} (step {p.step})")
        if accelerator.is_main_process:
            self.log = MetricsLog(self.out, keep_until_step=self.progress.step if resume else None)

    def _setup_model(self) -> None:
        self.model, self.fmt = build_model(self.config)
        self.trainable, self.total = count_parameters(self.model)

    def _setup_data(self) -> None:
        """Tokenise the splits in the model's format (cached across runs)."""
        self.features = {name: encode_cached(self.fmt, examples, self.config) for name, examples in self.splits.items()}
        self.lengths = [self.fmt.length(f) for f in self.features["train"]]
        c, s = self.config, self.splits
        self.accelerator.print(
            f"{c.task} / {c.method} on {c.model}: {len(s['train'])} train, {len(s['validation'])} validation, "
            f"{len(s['test'])} test examples; trainable {self.trainable:,} of {self.total:,} "
            f"({100 * self.trainable / self.total:.4f}%)"
        )

    def _setup_optimizer(self) -> None:
        config = self.config
        self.optimizer = _optimizer(self.model, config)
        batches_per_epoch = len(epoch_batches(self.lengths, config, 1, self.accelerator.num_processes))
        updates = math.ceil(batches_per_epoch / config.grad_accum) * config.epochs
        # The scheduler stays unprepared: Accelerate would step it once per process, but `updates` already counts
        # global batches.
        self.scheduler = get_linear_schedule_with_warmup(self.optimizer, int(config.warmup_ratio * updates), updates)

    # ------------------------------------------------------------------ train

    def train(self) -> None:
        self.started = time.time() - self.progress.elapsed_s
        for epoch in range(self.progress.epoch, self.config.epochs + 1):
            if self.progress.stopped:
                break
            self._train_epoch(epoch)
            self._validate(epoch)
            self.save_checkpoint()

    def _train_epoch(self, epoch: int) -> None:
        accelerator, progress, model = self.accelerator, self.progress, self.model
        model.train()
        batches = epoch_batches(self.lengths, self.config, epoch, accelerator.num_processes)
        positions = range(progress.batch, len(batches))
        for position in tqdm(positions, desc=f"epoch {epoch}", leave=False, disable=not accelerator.is_main_process):
            indices = batches[position][accelerator.process_index :: accelerator.num_processes]
            batch = to_device(self.fmt.collate([self.features["train"][i] for i in indices]), accelerator.device)
            with accelerator.accumulate(model):
                loss, auxiliary = training_loss(self.fmt, model, batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"loss is {loss.item()} at epoch {epoch}, step {progress.step + 1} (training examples "
                        f"{indices[:8]}{'...' if len(indices) > 8 else ''}); the last good checkpoint is kept"
                    )
                accelerator.backward(loss)
                self.optimizer.step()
                if accelerator.sync_gradients:
                    self.scheduler.step()
                self.optimizer.zero_grad()
            progress.step, progress.batch = progress.step + 1, position + 1
            if self.log:
                lr = self.scheduler.get_last_lr()[0]
                record = {"kind": "step", "epoch": epoch, "step": progress.step, "loss": loss.item(), "lr": lr}
                if auxiliary is not None:  # in metrics.jsonl only: `loss` includes it
                    record["auxiliary_loss"] = auxiliary.item()
                self.log.write(record)
            every = self.config.checkpoint_every
            if every and progress.step % every == 0 and accelerator.sync_gradients:
                progress.elapsed_s = time.time() - self.started
                self.save_checkpoint()

    def _validate(self, epoch: int) -> None:
        """Score the validation split; keep the best weights; decide on early stopping."""
        progress, model = self.progress, self.accelerator.unwrap_model(self.model)
        validation = self._score("validation", model)
        progress.epochs_run, progress.epoch, progress.batch = epoch, epoch + 1, 0
        progress.elapsed_s = time.time() - self.started
        if self.log:
            scores = {f"validation_{k}": v for k, v in validation.items()}
            self.log.write(
                {"kind": "epoch", "epoch": epoch, "step": progress.step, "elapsed_s": progress.elapsed_s, **scores}
            )
        if validation["score"] > progress.best_score:
            state = trainable_state(model)
            broken = [name for name, tensor in state.items() if not torch.isfinite(tensor).all()]
            if broken:  # never keep NaN/inf weights as the best ones
                raise FloatingPointError(
                    f"weights {broken[:3]} became NaN or inf by epoch {epoch}; they are not saved and the last good "
                    "checkpoint is kept: lower --lr"
                )
            progress.best_score, progress.best_epoch = validation["score"], epoch
            self.best_state = state
        elif epoch - progress.best_epoch >= self.config.patience:
            self.accelerator.print(f"early stop: no better validation score for {self.config.patience} epochs")
            progress.stopped = True

    def _score(self, split: str, model: nn.Module) -> dict[str, float]:
        # The unwrapped model runs outside Accelerate's autocast: without this, --bf16 would not reach scoring.
        with self.accelerator.autocast():
            return evaluate(
                model,
                self.fmt,
                self.features[split],
                self.splits[split],
                self.config.eval_batch_size,
                self.accelerator.device,
            )

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> None:
        """Everything a resumed run needs, replaced atomically: a crash leaves the previous checkpoint intact."""
        if self.accelerator.is_main_process:
            state = {
                "config": asdict(self.config),  # what a resume is checked against (run_config.json comes last)
                "method_revision": method_revision(self.config.method),
                "progress": asdict(self.progress),
                "trainable": trainable_state(self.accelerator.unwrap_model(self.model)),
                "best": self.best_state or {},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
            }
            atomic_write(self.checkpoint_file, lambda tmp: (torch.save(state, tmp), pause_point("checkpoint")))
        self.accelerator.wait_for_everyone()

    def _read_checkpoint(self) -> dict[str, Any]:
        try:
            return torch.load(self.checkpoint_file, weights_only=True)
        except Exception as err:  # a torn or foreign file: say which
            raise ValueError(f"{self.checkpoint_file} is not a readable checkpoint: {err}") from err

    def _checkpoint_settings(self, state: dict[str, Any]) -> RunConfig:
        """The settings the checkpoint was written under (older checkpoints lack them: their run_config.json)."""
        try:
            if "config" in state:
                return run_config_from_dict(state["config"], self.checkpoint_file)
            return read_run_config(self.out)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot resume {self.out}: {err}") from err

    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        load_trainable_state(self.accelerator.unwrap_model(self.model), state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.progress, self.best_state = Progress(**state["progress"]), state["best"] or None

    # ------------------------------------------------------------------ finish

    def finish(self) -> dict[str, Any]:
        """Restore the best epoch, score the test split, write the run's files; returns results.json's content."""
        config, progress = self.config, self.progress
        model = self.accelerator.unwrap_model(self.model)
        load_trainable_state(model, self.best_state)
        test = self._score("test", model)
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
            "trainable_params": self.trainable,
            "total_params": self.total,
            "trainable_percent": 100 * self.trainable / self.total,
            "wall_time_s": round(time.time() - self.started, 1),
            "train_examples": len(self.splits["train"]),
            "test_examples": len(self.splits["test"]),
            "processes": self.accelerator.num_processes,
            "method_revision": method_revision(config.method),
            "environment": environment(),  # float32 results agree across CPU kinds only to rounding
        }
        if self.scored_split != "test":  # a user task without a test file: "test" holds its validation scores
            results["scored_split"] = self.scored_split
        if self.accelerator.is_main_process:
            best = {k: v.contiguous() for k, v in self.best_state.items()}
            atomic_write(self.out / TRAINABLE_NAME, lambda tmp: save_file(best, tmp))
            # The settings go right beside the weights they produced (an overwrite kept the old ones until now).
            if self.spec.name not in builtin_tasks():  # the run names a user task: it carries the task's spec
                write_task_file(self.spec, self.out / TASK_FILE_NAME)
            atomic_write_text(self.out / RUN_CONFIG_NAME, json.dumps(asdict(config), indent=2) + "\n")
            pause_point("trainable")
            if isinstance(model, CaptModel):
                model.save_pretrained(self.out / ADAPTER_DIR)
                pause_point("adapter")
            atomic_write_text(self.out / RESULTS_NAME, json.dumps(results, indent=2) + "\n")
            pause_point("results")
            self.log.close()
            try:  # before the checkpoint goes: a run that fails here (a full disk) can still be finished
                plot_learning_curves(self.out)
            except OSError as err:
                raise OSError(f"{err}; the scores are saved: free space, then finish the run with --resume") from err
            self.checkpoint_file.unlink(missing_ok=True)  # the run is complete: nothing left to resume
        return results


def training_loss(fmt: TaskFormat, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, auxiliary) of one training batch: the task loss plus the method's auxiliary loss where it has one
    (`auxiliary_loss()` of the model, as `CaptModel` and a CaPT `PeftModel` offer; SMoP's load balancing), and
    that auxiliary part."""
    loss = fmt.loss(model, batch)
    auxiliary = auxiliary_loss(extract_model_from_parallel(model))
    return (loss if auxiliary is None else loss + auxiliary), auxiliary


# Settings a resumed run may change: those that cannot change its result, and --epochs (to extend a run; the
# linear decay is then recomputed for the new total, so the result differs from a run planned that long).
RESUME_MAY_CHANGE = NOT_RESULT_SETTINGS | {"epochs"}


def check_resumable(config: RunConfig, saved: RunConfig) -> None:
    """Refuse to resume a run whose settings differ from those it was started with, naming the differences."""
    differing = setting_differences(config, saved, ignore=RESUME_MAY_CHANGE)
    if differing:
        raise ValueError(
            f"cannot resume {config.output_dir} with other settings: {describe_differences(differing)}. Resume with "
            "the original settings, or start again with --overwrite"
        )


def interrupted_settings(run_dir: str | Path) -> tuple[RunConfig, int] | None:
    """(settings, method revision) of the interrupted run in `run_dir`, as its checkpoint records them; None when
    it has no checkpoint, or one that is torn or older than these records.

    Example:
        >>> interrupted_settings("runs/none-here") is None
        True
    """
    file = Path(run_dir) / CHECKPOINT_NAME
    if not file.is_file():
        return None
    try:  # mmap: only the settings are read, the weights and optimizer state stay on disk
        state = torch.load(file, weights_only=True, mmap=True)
        return run_config_from_dict(state["config"], file), int(state["method_revision"])
    except Exception:  # torn, foreign or older: nothing to continue from, whatever the reason
        return None


_PAUSES: dict[str, int] = {}


def pause_point(name: str) -> None:
    """Test hook of the fault-injection tests: with CAPT_PAUSE_AT=<name>@<n>, the n-th time the run gets here it
    says so on stdout and waits to be killed."""
    _PAUSES[name] = _PAUSES.get(name, 0) + 1
    if os.environ.get("CAPT_PAUSE_AT") == f"{name}@{_PAUSES[name]}":
        print(f"CAPT_PAUSED {name}", flush=True, file=sys.stdout)
        time.sleep(600)


def epoch_batches(lengths: list[int], config: RunConfig, epoch: int, processes: int) -> list[list[int]]:
    """The global batches of one epoch: a pure function of (seed, epoch), so a resumed run replays them exactly.

    Each global batch holds batch_size x processes examples; process k takes every processes-th of them, so N
    processes with batch_size b see the same global batches as one process with batch_size N x b.
    """
    rng = random.Random(config.seed * 100_003 + epoch)
    return length_grouped_batches(lengths, config.batch_size * processes, rng)


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


def _optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    # head_lr is for a task head trained beside another method's parameters; for head-only and full fine-tuning
    # the head is (part of) the method, trained at lr, so a learning-rate sweep of `head` moves the head.
    head_lr = config.lr if config.method in ("head", "full") else config.head_lr
    groups = param_groups(model, lr=config.lr, head_lr=head_lr, secondary_lr=config.lr_secondary)
    if config.optimizer == "adafactor":
        return Adafactor(
            groups, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(groups, weight_decay=config.weight_decay)
