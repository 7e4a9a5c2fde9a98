"""`capt serve`: one frozen backbone, many CaPT task adapters, one HTTP service with mixed-task batching.

    capt serve --model tiny-llama --adapters rte=runs/rte,cb=runs/cb --port 8000

- `engine.py`: the worker thread that owns the capsule bank, the bounded queue and the batched decode loop;
- `app.py`: the FastAPI routes (OpenAI-style /v1/completions and /v1/chat/completions, /v1/classify, /v1/models,
  /v1/adapters, /health, /metrics), limits and the optional API key.
"""

from __future__ import annotations

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
    backbone = load_backbone(model)
    (first, first_path), *others = adapters.items()
    folder, info = adapter_folder(first_path)
    bank = CaptModel.from_pretrained(backbone.model, folder, adapter_name=first)
    engine = Engine(bank, backbone.tokenizer, backbone.family, limits or Limits())
    engine.adapters[first] = info
    for name, path in others:
        engine.load(name, path)
    engine.start()
    return engine


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

    engine = build_engine(model, adapters, limits)
    try:
        uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level="warning")
    finally:
        engine.stop()


__all__ = ["BASE_MODEL", "Engine", "Limits", "build_engine", "create_app", "serve"]
