"""The options of each baseline, with the paper's defaults and parameter-count formulas.

A leaf module (imports nothing of capt): `CaptConfig` validates `prompt_options` through it.

Example:
    >>> opts = make_options("dept", {})
    >>> opts.num_tokens, opts.rank, opts.parameter_count(hidden=768, layers=12)
    (60, 30, 76800)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(owner).__name__}.{name} must be a positive integer, got {value!r}")


def _number(owner: object, name: str, zero_allowed: bool) -> None:
    value = getattr(owner, name)
    bound = ">= 0" if zero_allowed else "> 0"
    if isinstance(value, bool) or not isinstance(value, int | float) or not (value >= 0 if zero_allowed else value > 0):
        raise ValueError(f"{type(owner).__name__}.{name} must be a number {bound}, got {value!r}")


def _flag(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, bool):
            raise ValueError(f"{type(owner).__name__}.{name} must be true or false, got {value!r}")


class _SoftPrompt:
    """What every prompt method's options tell the slot machinery: `length` slots, written at the input layer
    unless a subclass says `every_layer`."""

    every_layer = False

    @property
    def num_tokens(self) -> int:
        return self.length  # type: ignore[attr-defined]  (each subclass declares its own default length)


@dataclass(frozen=True)
class DePTOptions(_SoftPrompt):
    """DePT (Shi & Lipani, ICLR 2024): a soft prompt of `length` tokens plus A (positions x rank) @ B (rank x d)
    added to the first `positions` input token embeddings, scaled by `alpha / sqrt(rank)` as in the authors' code.
    T5-Base defaults: m=60, r=30, s=256 (76,800 parameters, the budget of a 100-token prompt), alpha 8."""

    length: int = 60
    rank: int = 30
    positions: int = 256
    alpha: float = 8.0  # the authors' lora_alpha (PromptTuningLoRAConfig default; train.py never sets it)

    def __post_init__(self) -> None:
        _positive(self, "length", "rank", "positions")
        _number(self, "alpha", zero_allowed=False)

    def parameter_count(self, hidden: int, layers: int) -> int:
        return self.length * hidden + self.rank * (self.positions + hidden)


@dataclass(frozen=True)
class LoPAOptions(_SoftPrompt):
    """LoPA (Jain et al., 2024): Z = Z_S * sigmoid(u(x) v(x)), Z_S a task-shared (length x d) prompt, u (length x
    rank) and v (rank x d) computed from the pooled input by two separate heads d -> `encoder_hidden` (tanh) -> out;
    width 256 as in the authors' NLU parameter counts (docs/baselines-provenance.md)."""

    length: int = 10
    rank: int = 1
    encoder_hidden: int = 256

    def __post_init__(self) -> None:
        _positive(self, "length", "rank", "encoder_hidden")

    def parameter_count(self, hidden: int, layers: int) -> int:
        first_layers = 2 * (hidden * self.encoder_hidden + self.encoder_hidden)  # one per head
        outputs = (self.encoder_hidden + 1) * self.rank * (self.length + hidden)
        return self.length * hidden + first_layers + outputs


@dataclass(frozen=True)
class IDPGOptions(_SoftPrompt):
    """IDPG / M-IDPG (Wu et al., NAACL 2022): a bottleneck generator d -> `bottleneck` (16; GELU) -> length x d maps the
    sentence representation (masked mean of the input embeddings) to the prompt, at the input layer (IDPG) or at
    every layer (M-IDPG, `every_layer=True`): one generator for all layers plus a bias per layer, the authors'
    `layerb` form. Count: d b + b + b m d + (1 or L) m d.

    `phm=n > 0` is the paper's PHM generator (n = 16 in the authors' scripts): each of its two matrices is
    sum_i kron(S_i, W_i) over n terms, S_i n x n, so d b becomes n^3 + d b / n and b m d becomes n^3 + b m d / n.
    n must divide d, b and m d."""

    length: int = 5
    bottleneck: int = 16  # the authors' scripts: --phm-bottleneck-dim 16 for both generators
    every_layer: bool = False
    phm: int = 0  # the authors' --generation-quaternions; 0 = the plain (DNN) generator

    def __post_init__(self) -> None:
        _positive(self, "length", "bottleneck")
        _flag(self, "every_layer")
        if not isinstance(self.phm, int) or isinstance(self.phm, bool) or self.phm < 0:
            raise ValueError(f"IDPGOptions.phm must be an integer >= 0, got {self.phm!r}")
        if self.phm and self.bottleneck % self.phm:
            raise ValueError(f"IDPGOptions.phm ({self.phm}) must divide the bottleneck ({self.bottleneck})")

    def check_width(self, hidden: int) -> None:
        """Raise ValueError unless the PHM terms divide the model width d (and so m d)."""
        if self.phm and hidden % self.phm:
            raise ValueError(f"IDPGOptions.phm ({self.phm}) must divide the model's hidden size ({hidden})")

    def parameter_count(self, hidden: int, layers: int) -> int:
        biases = layers if self.every_layer else 1
        down, up = hidden * self.bottleneck, self.bottleneck * self.length * hidden
        if self.phm:
            down, up = self.phm**3 + down // self.phm, self.phm**3 + up // self.phm
        return down + self.bottleneck + up + biases * self.length * hidden


@dataclass(frozen=True)
class SMoPOptions(_SoftPrompt):
    """SMoP (Choi et al., EMNLP 2023): `num_prompts` prompts of `length` tokens; a linear router on the pooled input
    picks one (top-1), scaled by its probability; in training scaled Gaussian noise (std `noise_std`, relative to
    each logit) perturbs the router logits, and a load-balancing loss of weight `balance_weight` (0.01, 0 turns it
    off) joins the task loss. The router has no bias, as in the authors' code."""

    num_prompts: int = 4
    length: int = 5
    noise_std: float = 1.0
    balance_weight: float = 0.01  # the authors' alpha (`load_balancing=True`)

    def __post_init__(self) -> None:
        _positive(self, "num_prompts", "length")
        _number(self, "noise_std", zero_allowed=True)
        _number(self, "balance_weight", zero_allowed=True)

    def parameter_count(self, hidden: int, layers: int) -> int:
        return self.num_prompts * self.length * hidden + hidden * self.num_prompts


@dataclass(frozen=True)
class ResidualPromptOptions(_SoftPrompt):
    """Residual Prompt Tuning (Razdaibiedina et al., ACL 2023): P' = P + LayerNorm(up(ReLU(down(P)))), one MLP
    (bottleneck `bottleneck`, 800 as in the authors' code) shared by the `length` tokens. `reparameterize=False` is
    the folded form: plain prompts P', what `fold_residual_prompt` leaves after training."""

    length: int = 10
    bottleneck: int = 800  # arazd/ResidualPrompts train.py: --bottleneck_size 800, which its example commands keep
    reparameterize: bool = True

    def __post_init__(self) -> None:
        _positive(self, "length", "bottleneck")

    def parameter_count(self, hidden: int, layers: int) -> int:
        mlp = 2 * hidden * self.bottleneck + self.bottleneck + hidden + 2 * hidden if self.reparameterize else 0
        return self.length * hidden + mlp


@dataclass(frozen=True)
class VFPTOptions(_SoftPrompt):
    """VFPT (Zeng et al., NeurIPS 2024): Deep Prompt-Tuning whose first floor(`fourier_fraction` x `length`) prompts
    of each layer pass through a 2D FFT, over the hidden and then the sequence axis, real part:
    [Re(FFT_seq(FFT_hidden(P_f))) ; P_s]. The authors' defaults (runtsang/VFPT `src/configs/config.py`): fraction
    0.5, the transform over both axes, in the first layer too, the Fourier prompts first, a table per layer
    (`every_layer`, their `DEEP True` runs). Length 10 as our Deep Prompt-Tuning: the authors tune it per dataset."""

    length: int = 10
    fourier_fraction: float = 0.5
    every_layer: bool = True

    def __post_init__(self) -> None:
        _positive(self, "length")
        _number(self, "fourier_fraction", zero_allowed=True)
        if self.fourier_fraction > 1:
            raise ValueError(f"VFPTOptions.fourier_fraction must be a number <= 1, got {self.fourier_fraction!r}")
        _flag(self, "every_layer")

    @property
    def fourier_tokens(self) -> int:
        """How many of each layer's prompts pass through the transform (rounded down, as the authors do)."""
        return math.floor(self.length * self.fourier_fraction)

    def parameter_count(self, hidden: int, layers: int) -> int:
        return (layers if self.every_layer else 1) * self.length * hidden


@dataclass(frozen=True)
class AdapterOptions:
    """Bottleneck adapters (Houlsby et al., 2019): h + up(GELU(down(h))) after the attention and the feed-forward
    sublayer of every layer; `up` starts at zero, so the untrained adapter is the identity. With `train_norms` (the
    authors' setting) the model's layer-norm parameters train too."""

    bottleneck: int = 64
    train_norms: bool = True

    def __post_init__(self) -> None:
        _positive(self, "bottleneck")
        _flag(self, "train_norms")

    def parameter_count(self, hidden: int, sublayers: int, norm_params: int = 0) -> int:
        """`sublayers`: 2 per encoder or decoder-only layer, 3 per T5 decoder layer (cross-attention too);
        `norm_params`: the model's layer-norm parameters, counted when `train_norms`."""
        adapters = sublayers * (2 * hidden * self.bottleneck + self.bottleneck + hidden)
        return adapters + (norm_params if self.train_norms else 0)


PROMPT_OPTIONS = {
    "dept": DePTOptions,
    "lopa": LoPAOptions,
    "idpg": IDPGOptions,
    "m-idpg": IDPGOptions,
    "smop": SMoPOptions,
    "residual": ResidualPromptOptions,
    "vfpt": VFPTOptions,
}
PromptOptions = DePTOptions | LoPAOptions | IDPGOptions | SMoPOptions | ResidualPromptOptions | VFPTOptions


def make_options(method: str, values: dict[str, Any] | None) -> PromptOptions:
    """The validated options of prompt method `method` from a dict (unknown keys raise ValueError)."""
    if method not in PROMPT_OPTIONS:
        raise ValueError(f"unknown prompt method {method!r}; choose one of {', '.join(PROMPT_OPTIONS)}")
    cls = PROMPT_OPTIONS[method]
    values = dict(values or {})
    if method == "m-idpg":
        values.setdefault("every_layer", True)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"prompt_options for {method!r}: unknown fields {unknown}; known: {sorted(known)}")
    return cls(**values)


def options_dict(options: PromptOptions) -> dict[str, Any]:
    return asdict(options)
