"""Analyses of trained adapters: attention anchors (paper Findings I and III) and training-free instance tokens
(Finding II). `capt analyze attention` and `capt analyze instance-token` run them; each writes one report folder.

Layout: `capture.py` (attention weights with the slots kept), `tokens.py` (slot / structural / input roles),
`anchors.py` (the anchor numbers), `attention.py` (models, examples, averaging), `instance_token.py`,
`plots.py` and `report.py` (PNG, JSON and report.md).
"""

from .anchors import METRICS, anchor_metrics, role_matrix
from .attention import AttentionStudy, StreamMap, Subject, analyze_attention, example_maps
from .capture import capture_attention, use_eager_attention
from .instance_token import instance_token_scores, instance_tokens
from .report import AttentionOptions, InstanceTokenOptions, write_attention_report, write_instance_token_report

__all__ = [
    "METRICS",
    "AttentionOptions",
    "AttentionStudy",
    "InstanceTokenOptions",
    "StreamMap",
    "Subject",
    "analyze_attention",
    "anchor_metrics",
    "capture_attention",
    "example_maps",
    "instance_token_scores",
    "instance_tokens",
    "role_matrix",
    "use_eager_attention",
    "write_attention_report",
    "write_instance_token_report",
]
