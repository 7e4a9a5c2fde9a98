"""Optional integrations with other libraries; each is active only when its library is installed.

`import capt` calls `register_available()`, so that `peft.get_peft_model(base, capt.CaptConfig())` and
`peft.PeftModel.from_pretrained(base, path)` work without further setup.
"""

from __future__ import annotations

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


def register_available() -> None:
    """Register CaPT with every installed library that has a plugin mechanism (idempotent)."""
    if peft_available():
        from .peft import register

        register()
