"""The names of CaPT's capsule variants: a leaf module (no torch, no peft), read by `CaptConfig` and by the CLI.

Example:
    >>> from capt.variants import VARIANTS
    >>> VARIANTS[0]
    'add'
"""

VARIANTS = ("add", "prepend", "extract", "project")
