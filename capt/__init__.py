"""Capsule Prompt-Tuning (CaPT) for frozen Hugging Face transformers.

import capt
model = capt.get_capt_model(base, capt.CaptConfig())
"""

from .config import CaptConfig
from .model import CaptModel, get_capt_model

__all__ = ["CaptConfig", "CaptModel", "get_capt_model"]
__version__ = "0.1.0"
