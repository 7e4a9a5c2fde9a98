"""The trainable part of CaPT: per-layer capsule vectors and the instance summary.

    S_i = p_i + Mean(instance tokens of the layer input)          (variant "add", the paper's default)

With `CaptConfig.mean_norm="rms"` each token is first divided by its root mean square (`rms_normalise`).

Calling `Capsules(layer, hidden, weights)` returns the vectors written at the front of layer `layer`'s input.
`weights` (B x T) holds the masked-mean weights: 1/count on instance tokens, 0 elsewhere, so the summary is
one batched matrix product. The capsules are computed by *calling* the module (not by reading its parameter from
a hook) so that DeepSpeed ZeRO-3 gathers the partitioned parameters around the call.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import CaptConfig


class DepthwiseExtractor(nn.Module):
    """`extract` variant: a depthwise 1-D convolution over the sequence, then the masked mean."""

    def __init__(self, hidden: int, kernel_size: int, device=None):
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, kernel_size, padding=kernel_size // 2, groups=hidden, device=device)
        if self.conv.weight.device.type != "meta":
            # Start as the identity, so the untrained summary equals the plain mean.
            with torch.no_grad():
                self.conv.weight.zero_()
                self.conv.weight[:, 0, kernel_size // 2] = 1.0
                self.conv.bias.zero_()

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # Zero the non-instance positions first so padding never leaks in through the kernel.
        masked = hidden * (weights > 0).unsqueeze(-1).to(hidden.dtype)
        features = self.conv(masked.transpose(1, 2).to(self.conv.weight.dtype)).transpose(1, 2)
        return masked_mean(features, weights)


class LowRankProjector(nn.Module):
    """`project` variant: the masked mean mapped through d -> r -> d."""

    def __init__(self, hidden: int, rank: int, device=None):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False, device=device)
        self.up = nn.Linear(rank, hidden, bias=False, device=device)

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        mean = masked_mean(hidden, weights)
        return self.up(self.down(mean.to(self.down.weight.dtype)))


# The eps of `mean_norm="rms"` on a backbone without an RMSNorm of its own (BERT, GPT-2; T5's is named otherwise):
# T5's RMS layer norm default, far below any hidden state's mean square, so it only guards a zero vector.
FALLBACK_NORM_EPS = 1e-6


def rms_normalise(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """Each token at unit scale: x / sqrt(mean(x^2) + eps), a weightless RMSNorm, computed in float32 as the
    backbones' own RMSNorms do (a bf16 square of a massive activation loses most of its digits).

    Example:
        >>> rms_normalise(torch.tensor([[[3.0, -4.0]]]), eps=0.0)
        tensor([[[ 0.8485, -1.1314]]])
    """
    wide = hidden.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(hidden.dtype)


def masked_mean(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B, T, d), (B, T) -> (B, d): sum_t weights[b, t] * hidden[b, t]."""
    return torch.bmm(weights.to(hidden.dtype).unsqueeze(1), hidden).squeeze(1)


class Capsules(nn.Module):
    """Capsule vectors p (num_layers x [num_slots x] hidden) and, for `extract` / `project`, the instance module:
    the convolution or projection that turns the layer input into the instance summary (one shared by all layers,
    or one per layer: `CaptConfig.share_instance_module`)."""

    def __init__(
        self, config: CaptConfig, num_layers: int, hidden: int, device=None, norm_eps: float = FALLBACK_NORM_EPS
    ):
        super().__init__()
        self.config = config
        self.num_layers = num_layers
        self.norm_eps = norm_eps  # mean_norm="rms": the backbone's RMSNorm eps (`capt.sites.rms_norm_eps`)
        shape = (num_layers, hidden) if config.num_slots == 1 else (num_layers, config.num_slots, hidden)
        # Capsules stay float32 whatever the base dtype (master weights); they are cast when written.
        self.vectors = nn.Parameter(torch.zeros(shape, device=device, dtype=torch.float32))
        if config.init == "normal" and self.vectors.device.type != "meta":
            nn.init.normal_(self.vectors, std=config.init_std)

        self.instance_modules = None
        if config.variant in ("extract", "project"):
            count = 1 if config.share_instance_module else num_layers
            if config.variant == "extract":
                modules = [DepthwiseExtractor(hidden, config.kernel_size, device) for _ in range(count)]
            else:
                if config.rank > hidden:  # a low-rank projection; a huge rank would try to allocate d x rank floats
                    raise ValueError(f"CaptConfig.rank {config.rank} is beyond this model's hidden size {hidden}")
                modules = [LowRankProjector(hidden, config.rank, device) for _ in range(count)]
            self.instance_modules = nn.ModuleList(modules)

    def summary(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The instance-aware part, (B, d). Padding and targets have weight 0, normalised or not."""
        if self.config.mean_norm == "rms":
            hidden = rms_normalise(hidden, self.norm_eps)
        if self.instance_modules is None:
            return masked_mean(hidden, weights)
        module = self.instance_modules[0 if len(self.instance_modules) == 1 else layer]
        return module(hidden, weights)

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The (B, slots_per_layer, d) vectors written at the front of layer `layer`'s input."""
        batch = hidden.shape[0]
        learned = self.vectors[layer].view(1, self.config.num_slots, -1).expand(batch, -1, -1)
        if not self.config.instance_aware:
            return learned.to(hidden.dtype)
        summary = self.summary(layer, hidden, weights).unsqueeze(1)
        if self.config.variant == "prepend":
            return torch.cat([learned.to(hidden.dtype), summary.to(hidden.dtype)], dim=1)
        return (learned + summary).to(hidden.dtype)
