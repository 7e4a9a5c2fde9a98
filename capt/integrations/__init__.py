"""Optional integrations with other libraries; each is active only when its library is installed.

`import capt` calls `register_available()`, so that `peft.get_peft_model(base, capt.CaptConfig())` and
`peft.PeftModel.from_pretrained(base, path)` work without further setup.
"""

from __future__ import annotations

from ..import_utils import peft_available


def register_available() -> None:
    """Register CaPT with every installed library that has a plugin mechanism (idempotent)."""
    if peft_available():
        from .peft import register

        register()
