"""`capt serve`: one frozen backbone, many CaPT task adapters, one HTTP service with mixed-task batching.

    capt serve --model tiny-llama --adapters rte=runs/rte,cb=runs/cb --port 8000

- `engine.py`: the worker thread that owns the capsule bank, the bounded queue and the batched decode loop;
- `app.py`: the FastAPI routes (OpenAI-style /v1/completions and /v1/chat/completions, /v1/classify, /v1/models,
  /v1/adapters, /health, /metrics), limits and the optional API key.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from ...model import CaptModel
from ..backbones import load_backbone
from .app import create_app
from .engine import BASE_MODEL, Engine, Limits, adapter_folder


def build_engine(model: str, adapters: Mapping[str, str | Path], limits: Limits | None = None) -> Engine:
    """Load `model` once and attach every adapter (run folders or adapter folders) to it; the worker is started.

    Example:
        >>> engine = build_engine("tiny-llama", {"rte": "runs/rte"})  # doctest: +SKIP
        >>> sorted(engine.adapters)  # doctest: +SKIP
        ['rte']
    """
    if not adapters:
        raise ValueError("--adapters: serve needs at least one adapter (name=FOLDER)")
    folders = {name: adapter_folder(path) for name, path in adapters.items()}  # a missing one before the model
    backbone = load_backbone(model)
    (first, _), *others = adapters.items()
    folder, info = folders[first]
    bank = CaptModel.from_pretrained(backbone.model, folder, adapter_name=first)
    engine = Engine(bank, backbone.tokenizer, backbone.family, limits or Limits())
    engine.adapters[first] = info
    for name, path in others:
        engine.load(name, path)
    engine.start()
    return engine


def check_address(host: str, port: int) -> None:
    """Refuse (OSError or ValueError naming --host / --port) an address the service could not listen on, before
    any model loads: a port out of range, a host that does not resolve, a port in use or not allowed.

    Example:
        >>> check_address("127.0.0.1", 70000)
        Traceback (most recent call last):
        ...
        ValueError: --port must be 1 to 65535, got 70000
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be 1 to 65535, got {port}")
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise OSError(f"--host {host!r}: cannot be resolved ({err})") from None
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            raise OSError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None


def serve(
    model: str,
    adapters: Mapping[str, str | Path],
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    limits: Limits | None = None,
) -> None:
    """Run the service until interrupted (uvicorn, one process: the bank lives in this process's worker)."""
    import uvicorn

    check_address(host, port)
    engine = build_engine(model, adapters, limits)
    try:
        uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level="warning")
    finally:
        engine.stop()


__all__ = ["BASE_MODEL", "Engine", "Limits", "build_engine", "check_address", "create_app", "serve"]
