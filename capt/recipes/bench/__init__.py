"""`capt bench`: training-step time and peak memory of CaPT against its floor and the PEFT baselines.

Run it as `capt bench ...` or `python -m capt.recipes.bench ...`; `benchmarks/README.md` explains the
measurements. Importing this package runs nothing.
"""

from .cli import main

__all__ = ["main"]
