"""Adapter files: the one atomic-write helper, PEFT's key names, and safe reading of the weights file.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors`, keyed as PEFT keys them, so that
`CaptModel` and `peft.PeftModel` read each other's files. Pickle weights (`adapter_model.bin`) are read only on
request. Every file is replaced atomically: a crash leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CONFIG_NAME, PICKLE_WEIGHTS_NAME, WEIGHTS_NAME

# mkstemp creates files readable by their owner only; a written file gets the mode a plain open() would give it.
_UMASK = os.umask(0o022)
os.umask(_UMASK)

# adapter_model.safetensors uses PEFT's key names, so that either API reads the other's files.
FILE_KEY_PREFIXES = {"capsules.": "base_model.capt_layer.capt_capsules.", "modules_to_save.": "base_model.model."}


def atomic_write(target: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call `write(tmp)` on a unique temporary path beside `target`, then move it over `target` in one step.

    Example:
        >>> atomic_write("notes.txt", lambda tmp: Path(tmp).write_text("done\\n"))  # doctest: +SKIP
    """
    target = Path(target)
    mode = target.stat().st_mode & 0o777 if target.is_file() else 0o666 & ~_UMASK  # as open() would: keep, or umask
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except (OSError, RuntimeError) as err:  # torch's writer reports a full disk as a RuntimeError
        Path(tmp).unlink(missing_ok=True)
        raise OSError(f"could not write {target} ({err}); disk full? Any previous {target.name} is intact") from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(target: str | os.PathLike, text: str) -> None:
    atomic_write(target, lambda tmp: Path(tmp).write_text(text))


def write_adapter(directory: str | os.PathLike, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Write an adapter folder: `config` as adapter_config.json, `state` (CaptModel's keys) in PEFT's keys."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} is a file; save the adapter into a folder")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {_file_key(k): v.detach().to("cpu").contiguous() for k, v in state.items()}
    atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_text(directory / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_adapter_weights(directory: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The saved tensors, keyed as `CaptModel.adapter_state_dict` keys them (unknown keys stay as they are).

    Pickle weights (`adapter_model.bin`) are read only when the caller opts in, and then with
    `torch.load(weights_only=True)`, which refuses anything but tensors and plain containers."""
    weights, pickled = directory / WEIGHTS_NAME, directory / PICKLE_WEIGHTS_NAME
    if not weights.is_file():
        if allow_pickle and pickled.is_file():
            weights = pickled
        else:
            hint = (
                (
                    f" (found pickle weights {PICKLE_WEIGHTS_NAME}; CaPT reads safetensors only unless you pass "
                    "allow_pickle=True)"
                )
                if pickled.is_file()
                else ""
            )
            raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}{hint}")
    try:
        tensors = torch.load(weights, weights_only=True) if weights == pickled else load_file(weights)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{weights} is truncated or corrupt and cannot be read: {err}") from err
    ours = {file_prefix: prefix for prefix, file_prefix in FILE_KEY_PREFIXES.items()}
    state = {}
    for key, tensor in tensors.items():
        file_prefix = next((p for p in ours if key.startswith(p)), "")
        state[ours.get(file_prefix, "") + key.removeprefix(file_prefix)] = tensor
    return state


def _file_key(key: str) -> str:
    prefix = next(p for p in FILE_KEY_PREFIXES if key.startswith(p))
    return FILE_KEY_PREFIXES[prefix] + key.removeprefix(prefix)


# Trainer saves a model that is not a PreTrainedModel with safetensors, which refuses tied weights (T5, GPT-2,
# Llama-3.2 embeddings): state_dict() lists each tied tensor once, load_state_dict restores the rest.


def skip_tied_duplicates_in_state_dict(module: nn.Module) -> None:
    """Make `module.state_dict()` list each tied parameter once, and `load_state_dict` fill in the rest."""
    module.register_state_dict_post_hook(_drop_tied_duplicates)
    module.register_load_state_dict_pre_hook(_restore_tied_duplicates)


def _tied_duplicates(module: nn.Module) -> dict[str, str]:
    """Parameter name -> the first name of the same (tied) parameter, for every name but the first."""
    first: dict[int, str] = {}
    duplicates = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            duplicates[name] = first[id(param)]
    return duplicates


def _drop_tied_duplicates(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name in _tied_duplicates(module):
        state_dict.pop(prefix + name, None)


def _restore_tied_duplicates(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for name, kept in _tied_duplicates(module).items():
        if prefix + kept in state_dict and prefix + name not in state_dict:
            state_dict[prefix + name] = state_dict[prefix + kept]
