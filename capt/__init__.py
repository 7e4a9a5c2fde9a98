"""Capsule Prompt-Tuning (CaPT) for frozen Hugging Face transformers.

import capt
model = capt.get_capt_model(base, capt.CaptConfig())
# or, with the same config, through PEFT (CaPT is registered with PEFT as soon as both are imported, in either
# order); transformers.Trainer saves and reloads this one as an adapter:
model = peft.get_peft_model(base, capt.CaptConfig())
optimizer = torch.optim.AdamW(capt.param_groups(model, lr=3e-2, head_lr=1e-3))

The names below load on first use, so that `import capt` (and `capt --help`) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .integrations import register_when_loaded

if TYPE_CHECKING:
    from .config import CaptConfig
    from .model import CaptModel, get_capt_model
    from .optim import param_groups

# Public name -> the module that defines it.
_LAZY_NAMES = {"CaptConfig": ".config", "CaptModel": ".model", "get_capt_model": ".model", "param_groups": ".optim"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'capt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


register_when_loaded()

__all__ = ["CaptConfig", "CaptModel", "get_capt_model", "param_groups"]
__version__ = "0.4.0"
