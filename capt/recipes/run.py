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

`RunConfig` itself lives in `settings.py`, which imports no torch (the CLI parses its flags from it); it is
re-exported here. `load_run` rebuilds a finished run's model for `capt eval`, `capt predict` and `capt analyze`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import typing
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .backbones import load_backbone
from .formats import TaskFormat, head_outputs, make_format
from .methods import apply_method, extra_positions
from .settings import DEFAULT_LR as DEFAULT_LR
from .settings import RunConfig as RunConfig
from .settings import field_kind as field_kind
from .tasks import TASK_FILE_NAME, read_task_file, register_task

RESULTS_NAME = "results.json"
RUN_CONFIG_NAME = "run_config.json"
TRAINABLE_NAME = "trainable.safetensors"
CHECKPOINT_NAME = "checkpoint.pt"
ADAPTER_DIR = "adapter"
LOCK_NAME = ".capt.lock"


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The settings of a run folder written by `capt train`; its task.yaml (a user task's spec) is registered.

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
    register_run_task(run_dir)
    return run_config_from_dict(settings, config_file)


def register_run_task(run_dir: str | Path) -> None:
    """Make the task recorded in a run folder (its task.yaml, written for user tasks) known by its name."""
    task_file = Path(run_dir) / TASK_FILE_NAME
    if task_file.is_file():
        register_task(read_task_file(task_file))


def run_config_from_dict(settings: object, source: Path) -> RunConfig:
    """RunConfig from stored settings (run_config.json, a checkpoint); errors and unknown keys name `source`.

    Fields missing from `settings` (added after the file was written) take their defaults, except `prompt_bos`:
    a run written before it existed put a BOS before every prompt, so it reads back as "always".
    """
    if not isinstance(settings, dict):
        raise ValueError(f"{source}: expected a JSON object of settings")
    settings = {"prompt_bos": "always", **settings}
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
    if config.t5_generate and backbone.family != "encoder-decoder":
        warnings.warn(
            f"--t5-generate applies to T5 (encoder-decoder) models only; {config.model} is {backbone.family}: ignored",
            stacklevel=2,
        )
    fmt = make_format(
        backbone.family,
        config.task,
        backbone.tokenizer,
        max_length,
        config.t5_generate,
        config.decoder_head,
        config.prompt_bos,
    )
    return apply_method(backbone, config.method, config.method_options()), fmt


def load_run(run_dir: str | Path) -> tuple[RunConfig, nn.Module, TaskFormat]:
    """Rebuild a finished run's model with its best weights (for `capt eval`, `predict` and `analyze`)."""
    config = read_run_config(run_dir)
    model, fmt = build_model(config)
    load_trainable_state(model, read_trainable(Path(run_dir) / TRAINABLE_NAME))
    return config, model, fmt


def missing_weights(path: Path) -> FileNotFoundError:
    """The error for a run's weights file or adapter folder `path` that is missing where the weights are needed
    (eval, predict, serve, analyze). A run whose results.json holds its scores is finished: tabulating it
    (`compare`, `sweep`) reads only the scores, so a study committed without its weights still tabulates, and
    only a command that loads the weights names the missing file.

    Example:
        >>> str(missing_weights(Path("runs/none/adapter")))
        'no adapter in runs/none: the run did not finish (train it with --resume)'
    """
    run_dir = path.parent
    if (run_dir / RESULTS_NAME).is_file():
        return FileNotFoundError(
            f"no {path.name} in {run_dir}: the run finished (its scores are in {RESULTS_NAME}) but its weights are "
            "gone; this command needs them: train it again with --overwrite"
        )
    return FileNotFoundError(f"no {path.name} in {run_dir}: the run did not finish (train it with --resume)")


def read_trainable(path: Path) -> dict[str, torch.Tensor]:
    """The weights file of a run, or a ValueError saying it is missing, torn or holds NaN/inf."""
    if not path.is_file():
        raise missing_weights(path)
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


@contextlib.contextmanager
def reading_back(path: Path) -> typing.Iterator[None]:
    """Errors of the block, which reads back what `path` holds, as one ValueError naming the file: a results file
    damaged by hand or by a foreign writer lacks a key or holds a wrong type, and says so, not `KeyError`."""
    try:
        yield
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as err:
        if isinstance(err, ValueError) and str(path) in str(err):
            raise  # names the file already
        problem = f"no {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise ValueError(f"{path} is damaged ({problem}); rerun that run with --overwrite") from err


def read_json(path: Path) -> typing.Any:
    """The JSON in `path`; text that is not JSON (or not UTF-8) is a ValueError naming the file."""
    try:
        return json.loads(path.read_bytes())
    except ValueError as err:
        raise ValueError(f"{path} is damaged ({err}); rerun that run with --overwrite") from err


def read_results(path: Path) -> dict:
    """A results.json as the summary over seeds. A run killed between its seed's results and the summary (one
    seed: the same file) left a seed's results: it is summarised here and the file completed. A damaged file is
    a ValueError naming it."""
    from .reporting import aggregate_seeds

    results = read_json(path)
    with reading_back(path):
        if not isinstance(results, dict):
            raise TypeError(f"expected an object, got {type(results).__name__}")
        if "runs" in results:
            return results
        results = aggregate_seeds([results])
        from ..saving import atomic_write_text

        atomic_write_text(path, json.dumps(results, indent=2) + "\n")
    return results
