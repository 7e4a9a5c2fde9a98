"""`capt lm-eval`: lm-evaluation-harness on a CaPT adapter, scored the way CaPT was trained.

    capt lm-eval --model capt --model_args adapter=runs/copa-capt --tasks copa --limit 100 --log_samples \\
        --output_path lm-eval-out

Every flag is lm-evaluation-harness's own (`capt lm-eval --help` shows them); this module adds one model type,
`--model capt`, whose `--model_args` are:

- `adapter=FOLDER`: a `capt train` run folder (any method on a decoder backbone: the run's model and weights, as
  `capt eval` rebuilds them) or an adapter folder (`adapter_config.json`, from `save_pretrained`);
- `pretrained=NAME`: for an adapter folder, the backbone (a `capt` backbone name such as `smollm2`, or a local
  model folder); default: the `base_model_name_or_path` the adapter recorded;
- any argument of lm-eval's `hf` model (`add_bos_token`, `batch_size`, `max_length`, ...).

Why a model type of its own: lm-eval's `hf` model scores a log-likelihood request as one (context +
continuation) row, so every answer option would enter the capsule's mean. Here the continuation is a target, as
in training (`capt.recipes.formats.continuation_logits`): the mean covers the context only, and each option is
scored against the same capsule. Text is tokenised by lm-eval itself (a BOS only where the tokenizer adds one, or
as `add_bos_token` says); generation requests use the adapter's `generate`, whose prompt is the instance.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from ..config import CONFIG_NAME, CaptConfig
from ..model import CaptModel
from .backbones import load_backbone
from .formats import CausalLMFormat, continuation_logits, target_logprobs
from .run import RUN_CONFIG_NAME, load_run

MODEL_NAME = "capt"


def load_adapter_model(adapter: str, pretrained: str | None = None) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """The model and tokenizer that `--model_args adapter=...` names: a `capt train` run folder or an adapter folder.

    Example:
        >>> model, tokenizer = load_adapter_model("runs/copa-capt")  # doctest: +SKIP
    """
    folder = Path(adapter)
    if (folder / RUN_CONFIG_NAME).is_file():
        if pretrained is not None:
            raise ValueError(f"adapter={adapter} is a run folder: it names its backbone itself; leave out pretrained=")
        config, model, fmt = load_run(folder)
        if not isinstance(fmt, CausalLMFormat):
            raise ValueError(
                f"adapter={adapter}: lm-eval scores causal language models; this run trained {config.model} "
                f"with a {type(fmt).__name__} (a classifier or encoder-decoder)"
            )
        return model.eval(), fmt.tokenizer
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"adapter={adapter}: neither a `capt train` run folder ({RUN_CONFIG_NAME}) nor an adapter folder "
            f"({CONFIG_NAME})"
        )
    name = pretrained or CaptConfig.from_pretrained(folder).base_model_name_or_path
    if not name:
        raise ValueError(f"adapter={adapter} does not record its backbone: add pretrained=BACKBONE to --model_args")
    backbone = load_backbone(name)
    if backbone.family != "decoder":
        raise ValueError(f"pretrained={name} is an {backbone.family} model; lm-eval scores causal language models")
    return CaptModel.from_pretrained(backbone.model, folder).eval(), backbone.tokenizer


@register_model(MODEL_NAME)
class CaptLM(HFLM):
    """lm-eval's `hf` model, with log-likelihoods scored under CaPT's protocol (the capsule mean over the context).

    Example:
        >>> from lm_eval.api.instance import Instance
        >>> lm = CaptLM(adapter="runs/copa-capt", device="cpu")  # doctest: +SKIP
        >>> request = Instance("loglikelihood", {}, ("It rained, therefore", " the grass was wet"), 0)
        >>> lm.loglikelihood([request])  # (log-likelihood, greedy?) per request  # doctest: +SKIP
        [(-9.53..., False)]
    """

    def __init__(self, adapter: str, pretrained: str | None = None, device: str | None = None, **kwargs: Any):
        if str(kwargs.get("batch_size", 1)).startswith("auto"):
            raise ValueError("--model capt takes a number for --batch_size, not auto")
        model, tokenizer = load_adapter_model(adapter, pretrained)
        if kwargs.get("prefix_token_id") is None and tokenizer.bos_token_id is None and tokenizer.eos_token_id is None:
            # lm-eval scores a context-free continuation after this token; without one it fails deep inside.
            raise ValueError(
                "--model capt: the tokenizer has no BOS or EOS token for lm-eval to put before a continuation with "
                "no context; add prefix_token_id=ID to --model_args"
            )
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=model.to(device), tokenizer=tokenizer, backend="causal", **kwargs)
        self.adapter = adapter

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether greedy decoding gives it) per request.

        Requests are batched longest first; a context too long for the model loses its first tokens, as in `hf`.
        """
        batch_size = override_bs or int(self.batch_size)
        room = self.max_length - getattr(self.model, "num_slots", 0)  # the capsule slots take positions too
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: dict[int, tuple[float, bool]] = {}
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="loglikelihood (capt)")
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            rows = [_row(requests[i][1], requests[i][2], room) for i in chunk]
            inputs = _right_padded(rows, self.tokenizer.pad_token_id, self.device)
            with torch.no_grad():
                logits = continuation_logits(self.model, inputs)
            logprobs = target_logprobs(logits, inputs["labels"], shifted=True)
            greedy = greedy_targets(logits, inputs["labels"])
            for i, logprob, is_greedy in zip(chunk, logprobs.tolist(), greedy.tolist(), strict=True):
                results[i] = (logprob, is_greedy)
                if requests[i][0] is not None:  # lm-eval's --use_cache reads these back
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            progress.update(len(chunk))
        progress.close()
        return [results[i] for i in range(len(requests))]


def _row(context: list[int], continuation: list[int], room: int) -> tuple[list[int], list[int]]:
    """(input ids, labels): the context's labels are -100, so it alone is the capsule's instance."""
    if len(continuation) >= room:
        raise ValueError(f"a continuation of {len(continuation)} tokens leaves no room for its context in {room}")
    context = context[-(room - len(continuation)) :]  # the end of a context is what the continuation follows
    return context + continuation, [-100] * len(context) + continuation


def _right_padded(rows: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device) -> dict:
    width = max(len(ids) for ids, _ in rows)
    return {
        "input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in rows], device=device),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows], device=device),
        "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows], device=device),
    }


def greedy_targets(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Whether each row's labelled tokens are all the argmax of the logits before them, (R,); the logits cover the
    last positions of the labels, as in `target_logprobs`.

    Example:
        >>> logits = torch.log(torch.tensor([[[0.6, 0.4], [0.9, 0.1]]]))
        >>> greedy_targets(logits, torch.tensor([[-100, 0]])).tolist()
        [True]
    """
    width = min(logits.shape[1], labels.shape[1])
    predicted = logits[:, -width:][:, :-1].argmax(-1)
    targets = labels[:, -width:][:, 1:]
    return ((predicted == targets) | (targets == -100)).all(-1)


def run_harness(argv: list[str]) -> int:
    """lm-evaluation-harness's command line on `argv`, with `--model capt` registered (this module's import)."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["capt lm-eval", *argv]  # lm-eval parses sys.argv itself (and inserts its `run` command)
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
