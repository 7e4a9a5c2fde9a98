"""Which optional libraries are installed: a leaf module that imports nothing of capt.

Every probe is cached, cheap and import-free for the library it asks about, except `peft_available`, which has
to read PEFT's version. The library's lowest modules (`config.py`) ask here, so no module of capt ever needs
to import a higher one to learn what is installed.
"""

from __future__ import annotations

import importlib.util
from functools import cache

# The first PEFT line that supports transformers 5 (the project's transformers range).
MIN_PEFT_VERSION = "0.18"


@cache
def peft_available() -> bool:
    """True when a supported `peft` (and `aenum`, used to add CAPT to PEFT's closed PeftType enum) is installed."""
    try:
        import aenum  # noqa: F401
        import peft
        from packaging.version import Version
    except ImportError:
        return False
    return Version(peft.__version__) >= Version(MIN_PEFT_VERSION)


def config_base() -> type:
    """The base class of `CaptConfig`: `peft.PeftConfig` when PEFT is available, else `object`."""
    if not peft_available():
        return object
    from peft import PeftConfig

    return PeftConfig


def model_base() -> type:
    """The base class of `CaptModel`: `peft.PeftModel` when PEFT is available, else `torch.nn.Module`.

    `transformers.Trainer` and TRL save, checkpoint and reload a model as an adapter only when it is a `PeftModel`
    (an isinstance check, with no hook): as one, a bare `CaptModel` is saved as its adapter files, not whole.
    """
    if not peft_available():
        from torch import nn

        return nn.Module
    from peft import PeftModel

    return PeftModel


def missing_modules(*names: str) -> list[str]:
    """The top-level modules among `names` that cannot be imported (found without importing them)."""
    return [name for name in names if importlib.util.find_spec(name) is None]
