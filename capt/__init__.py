"""Capsule Prompt-Tuning (CaPT) for frozen Hugging Face transformers.

import capt
model = capt.get_capt_model(base, capt.CaptConfig())
# or, with the same config, through PEFT (registered on import when peft is installed):
model = peft.get_peft_model(base, capt.CaptConfig())
"""

from .config import CaptConfig
from .integrations import register_available
from .model import CaptModel, get_capt_model

register_available()

__all__ = ["CaptConfig", "CaptModel", "get_capt_model"]
__version__ = "0.2.0"
