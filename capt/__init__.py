"""Capsule Prompt-Tuning (CaPT) for frozen Hugging Face transformers.

import capt
model = capt.get_capt_model(base, capt.CaptConfig())
# or, with the same config, through PEFT (registered on import when peft is installed); transformers.Trainer
# saves and reloads this one as an adapter:
model = peft.get_peft_model(base, capt.CaptConfig())
optimizer = torch.optim.AdamW(capt.param_groups(model, lr=3e-2, head_lr=1e-3))
"""

from .config import CaptConfig
from .integrations import register_available
from .model import CaptModel, get_capt_model
from .optim import param_groups

register_available()

__all__ = ["CaptConfig", "CaptModel", "get_capt_model", "param_groups"]
__version__ = "0.3.0"
