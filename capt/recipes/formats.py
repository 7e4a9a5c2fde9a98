"""How each backbone family reads a SuperGLUE example, learns from it, and predicts it.

Every task is scored as a choice among options whose index is the label id:

- encoder classifiers (BERT, RoBERTa, MiniLM): a sentence pair into a classification head with one output per
  label; choice tasks (COPA, ReCoRD) as multiple choice: one pair per option, a one-output head scores each
  pair, and the options of an example compete in a softmax.
- T5: text-to-text; training maximises the gold label word, prediction compares the label words' likelihoods
  (or, with `t5_generate`, greedy-decodes and matches the text).
- decoder-only LMs: a prompt and one continuation per option; training maximises the gold continuation,
  prediction compares the continuations' log-likelihoods. Continuations carry labels, so the capsule mean of
  CaPT covers the prompt only.

A `generate` task (chat or instruction rows) has no options: `make_format` gives it `capt.recipes.chat.ChatFormat`,
on decoder-only LMs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..config import CaptConfig
from ..slots import positions_from_mask
from .data import Example
from .format_base import Features, TaskFormat, has_capsules, target_logprobs
from .settings import PROMPT_BOS
from .tasks import get_task, render
from .tasks.spec import TaskSpec

# What a generating format predicts for an answer that is none of the options: it matches no label, so it is wrong.
NO_OPTION = -1


def tokenizer_adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer(text)` starts with its BOS token (Llama's does; SmolLM2's and BERT's tokenizers do not)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a")["input_ids"]
    return (
        bool(with_special)
        and with_special[0] == bos
        and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos]
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, prompt_bos: str = "tokenizer") -> list[int]:
    """The token ids of a decoder prompt: the one function training, evaluation, `predict` and `serve` encode with.

    `prompt_bos="tokenizer"`: the text's ids, after a BOS only where the tokenizer adds one; `"always"`: the
    tokenizer's `bos_token` text, then the prompt, as runs made before capt 0.3 read their prompts.

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> tokenizer = load_backbone("tiny-llama").tokenizer  # BERT's tokenizer: no BOS token at all
        >>> encode_prompt(tokenizer, "hi") == tokenizer("hi", add_special_tokens=False)["input_ids"]
        True
    """
    if prompt_bos not in PROMPT_BOS:
        raise ValueError(f"prompt_bos {prompt_bos!r}; expected one of {', '.join(PROMPT_BOS)}")
    if prompt_bos == "always":
        return tokenizer((tokenizer.bos_token or "") + text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id, *ids] if tokenizer_adds_bos(tokenizer) else ids


@dataclass
class EncoderFormat(TaskFormat):
    """Sentence-pair classification, or multiple choice over pairs for COPA/ReCoRD.

    Decoder classifiers read this format too, padded on the left (`padding_side`) with positions counted from the
    first real token: their head reads the last position when it gets embeddings rather than ids, and that is the
    last real token only then. (PEFT prompt tuning still depends on padding: it ignores position ids.)
    """

    padding_side: str = "right"

    def _pad(self, rows, value):
        if self.padding_side == "right":
            return super()._pad(rows, value)
        width = max(len(r) for r in rows)
        return torch.tensor([[value] * (width - len(r)) + r for r in rows], dtype=torch.long)

    def encode(self, example: Example) -> Features:
        pairs = render.encoder_pairs(self.spec, example)
        encoded = [
            self.tokenizer(text, pair, truncation="longest_first", max_length=self.max_length) for text, pair in pairs
        ]
        rows = [dict(e) for e in encoded]
        return {"rows": rows, "label": example.label, "length": max(len(r["input_ids"]) for r in rows)}

    def collate(self, features: list[Features]) -> dict[str, Any]:
        rows = [row for f in features for row in f["rows"]]
        batch = {"input_ids": self._pad([r["input_ids"] for r in rows], self.tokenizer.pad_token_id)}
        batch["attention_mask"] = self._pad([[1] * len(r["input_ids"]) for r in rows], 0)
        if "token_type_ids" in rows[0]:
            batch["token_type_ids"] = self._pad([r["token_type_ids"] for r in rows], 0)
        if self.padding_side == "left":  # positions count from the first real token, as generate() does
            batch["position_ids"] = positions_from_mask(batch["attention_mask"])
        return {
            "model_inputs": batch,
            "options": [len(f["rows"]) for f in features],
            "labels": torch.tensor([f["label"] if f["label"] is not None else -100 for f in features]),
        }

    def scores(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        logits = model(**batch["model_inputs"]).logits
        if not self.spec.is_choice:
            return logits
        return _per_example(logits.squeeze(-1), batch["options"])

    def loss(self, model, batch):
        return F.cross_entropy(self.scores(model, batch), batch["labels"])


@dataclass
class OptionScoringFormat(TaskFormat):
    """Shared by T5 and decoder LMs: one (source, target) row per option, scored by summed target log-prob."""

    def _option_texts(self, example: Example) -> tuple[str, list[str]]:
        raise NotImplementedError

    def _rows(self, source: list[int], targets: list[list[int]]) -> list[dict[str, list[int]]]:
        raise NotImplementedError

    def _source_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=self._special_in_source)["input_ids"]

    def encode(self, example: Example) -> Features:
        source_text, option_texts = self._option_texts(example)
        targets = [
            self.tokenizer(text, add_special_tokens=self._special_in_targets)["input_ids"] for text in option_texts
        ]
        room = self.max_length - max(len(t) for t in targets) if self._shares_length else self.max_length
        if room < 1:  # source[-0:] would keep everything: truncation off instead of on
            raise ValueError(f"max_length {self.max_length} leaves no room for the prompt of example {example.idx}")
        source = self._source_ids(source_text)
        # Truncate from the left: the end of a prompt ("... Answer:") is what the options continue.
        source = source[-room:] if self._shares_length else source[:room]
        rows = self._rows(source, targets)
        length = max(len(r["input_ids"]) for r in rows)
        # Options as the tokenizer writes them back, so generated text compares like for like.
        decoded = [self.tokenizer.decode(t, skip_special_tokens=True).strip() for t in targets]
        return {"rows": rows, "label": example.label, "length": length, "option_texts": decoded}

    def _collate_rows(self, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self._pad([r["input_ids"] for r in rows], self.tokenizer.pad_token_id),
            "attention_mask": self._pad([[1] * len(r["input_ids"]) for r in rows], 0),
            "labels": self._pad([r["labels"] for r in rows], -100),
        }

    def collate(self, features: list[Features]) -> dict[str, Any]:
        gold = [f["rows"][f["label"]] for f in features if f["label"] is not None]
        everything = [row for f in features for row in f["rows"]]
        return {
            "train_inputs": self._collate_rows(gold) if gold else None,
            "score_inputs": self._collate_rows(everything),
            "options": [len(f["rows"]) for f in features],
            "option_texts": [f["option_texts"] for f in features],
            "labels": torch.tensor([f["label"] if f["label"] is not None else -100 for f in features]),
        }

    def loss(self, model, batch):
        return model(**batch["train_inputs"]).loss

    def row_scores(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed log-probability of each row's target tokens, (R,)."""
        return target_logprobs(model(**inputs).logits, inputs["labels"], shifted=self._shifted)

    def scores(self, model, batch):
        return _per_example(self.row_scores(model, batch["score_inputs"]), batch["options"])


@dataclass
class T5Format(OptionScoringFormat):
    """Text-to-text: `rte hypothesis: ... premise: ...` -> `entailment` / `not_entailment`."""

    generate: bool = False  # predict by greedy decoding + exact match instead of comparing likelihoods

    _special_in_source = True
    _special_in_targets = True
    _shares_length = False  # source and target are separate sequences
    _shifted = False  # decoder logits at position t predict label t

    def predict(self, model, batch):
        if not self.generate:
            return super().predict(model, batch)
        inputs, options = batch["score_inputs"], batch["options"]
        first_rows = torch.tensor([0, *torch.tensor(options).cumsum(0)[:-1].tolist()])  # one row per example
        generated = model.generate(
            input_ids=inputs["input_ids"][first_rows],
            attention_mask=inputs["attention_mask"][first_rows],
            max_new_tokens=inputs["labels"].shape[1] + 1,
            do_sample=False,
        )
        texts = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
        return [
            next((i for i, o in enumerate(opts) if o.strip() == text.strip()), NO_OPTION)
            for text, opts in zip(texts, batch["option_texts"], strict=True)
        ]

    def _option_texts(self, example):
        return render.t5_source(self.spec, example), render.t5_targets(self.spec, example)

    def _rows(self, source, targets):
        return [{"input_ids": source, "labels": target} for target in targets]


@dataclass
class CausalLMFormat(OptionScoringFormat):
    """Prompt + continuation; labels are -100 on the prompt, so the capsule never sees the answer."""

    prompt_bos: str = "tokenizer"  # see PROMPT_BOS and encode_prompt

    _special_in_source = False
    _special_in_targets = False
    _shares_length = True
    _shifted = True  # logits at position t predict token t + 1

    def _option_texts(self, example):
        return render.lm_source(self.spec, example), render.lm_continuations(self.spec, example)

    def _source_ids(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, self.prompt_bos)

    def _rows(self, source, targets):
        return [{"input_ids": source + target, "labels": [-100] * len(source) + target} for target in targets]

    def loss(self, model, batch):
        inputs = batch["train_inputs"]
        targets = (inputs["labels"][:, 1:] != -100).sum()  # the first token is never a target
        return -self.row_scores(model, inputs).sum() / targets  # HF's mean over target tokens

    def row_scores(self, model, inputs):
        return target_logprobs(continuation_logits(model, inputs), inputs["labels"], shifted=True)

    def scores(self, model, batch):
        """Option scores from one prompt pass per example where that is exact (`prompt_pass_is_exact`), else from
        one pass over each (prompt + option) row.

        Under low-precision autocast (`--bf16`) scoring stays row by row: there the two paths round differently
        (up to 0.36 nats apart on SmolLM2 CB, against 1e-5 in float32), which flipped validation predictions in a
        study run and so moved early stopping; row by row keeps bf16 runs equal to those made before one-pass
        scoring existed."""
        if not prompt_pass_is_exact(model) or _autocasting():
            return super().scores(model, batch)
        return _per_example(
            self.scores_from_prompt_pass(model, batch["score_inputs"], batch["options"]), batch["options"]
        )

    def scores_from_prompt_pass(
        self, model: nn.Module, inputs: dict[str, torch.Tensor], options: list[int]
    ) -> torch.Tensor:
        """`row_scores` of the option rows, with each example's prompt run once (as lm-evaluation-harness does).

        The prompts are prefilled as a left-padded batch, whose last logits score each option's first token; the
        KV cache is then repeated for each option, and all options continue from it in one cached pass (none when
        every option is one token). The prompt's states (and any slot) are the same in every option row, so this is
        the plain path's result at about 1/options of its prompt work.
        """
        ids, mask, labels = inputs["input_ids"], inputs["attention_mask"].bool(), inputs["labels"]
        pad = self.tokenizer.pad_token_id
        prompt_lengths = (mask & (labels == -100)).sum(-1)  # per row; rows are right-padded, targets follow prompts
        counts = torch.tensor(options, device=ids.device)
        example_of_row = torch.repeat_interleave(torch.arange(len(options), device=ids.device), counts)
        first_rows = counts.cumsum(0) - counts

        # Each example's prompt (from its first row), moved to the right edge: a left-padded batch.
        lengths = prompt_lengths[first_rows]
        columns = torch.arange(int(lengths.max()), device=ids.device)[None] - (lengths.max() - lengths)[:, None]
        prompt_mask = columns >= 0
        prompt_ids = torch.where(prompt_mask, ids[first_rows].gather(1, columns.clamp(min=0)), pad)
        prefill = _with_rows(model, first_rows)(
            input_ids=prompt_ids,
            attention_mask=prompt_mask.long(),
            position_ids=positions_from_mask(prompt_mask),
            use_cache=True,
            logits_to_keep=1,
        )
        # The prompt's last logits predict each option's first token; the option's own logits predict the rest.
        logits = prefill.logits[example_of_row, -1:]

        # Each row's target tokens, right-padded, at the positions that follow its prompt (and the slots).
        target_lengths = (labels != -100).sum(-1)
        steps = torch.arange(int(target_lengths.max()), device=ids.device)[None]
        target_mask = steps < target_lengths[:, None]
        source = (prompt_lengths[:, None] + steps).clamp(max=ids.shape[1] - 1)
        target_ids = torch.where(target_mask, ids.gather(1, source), pad)
        if steps.shape[1] > 1:  # one-token options (CB's label words) need no second pass
            key = "cache" if "cache" in prefill else "past_key_values"  # transformers 5.x renamed it
            cache = prefill[key]
            slots = cache.get_seq_length() - prompt_ids.shape[1]  # the slot columns a CaPT model put in front
            cache.batch_select_indices(example_of_row)  # one copy of its example's prompt states per option row
            continued = model(
                input_ids=target_ids,
                attention_mask=torch.cat([prompt_mask[example_of_row], target_mask], 1).long(),
                position_ids=prompt_lengths[:, None] + slots + steps,  # a cached step counts the slots, as generate
                **{key: cache},
            )
            logits = torch.cat([logits, continued.logits[:, :-1]], 1)
        return target_logprobs(logits, torch.where(target_mask, target_ids, -100), shifted=False)


def continuation_logits(model: nn.Module | partial, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A causal LM's logits on right-padded (prompt + continuation) rows whose `labels` are -100 on the prompt: the
    capsule mean covers the prompt only, the protocol CaPT trains under (shared with `capt lm-eval`).

    The LM head runs only on the trailing positions that predict a target (`logits_to_keep`). Right-padded rows end
    their targets at different places, so the kept span starts one position before the earliest target of any row.
    Labels are not passed: the model would compute a loss over all positions. The capsule mean still leaves the
    targets out (`instance_mask`), as it does when it reads labels.
    """
    labels = inputs["labels"]
    first_target = (labels != -100).int().argmax(-1).min().item()
    keep = labels.shape[1] - first_target + 1
    model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    if has_capsules(model):
        model_inputs["instance_mask"] = labels == -100
    return model(**model_inputs, logits_to_keep=keep).logits


def _with_rows(model: nn.Module | partial, rows: torch.Tensor) -> nn.Module | partial:
    """`model` for a batch of the given option rows only: a bank's per-row `adapter_names` picked to match."""
    names = model.keywords.get("adapter_names") if isinstance(model, partial) else None
    if names is None:
        return model
    return partial(model.func, *model.args, **{**model.keywords, "adapter_names": [names[i] for i in rows.tolist()]})


def prompt_pass_is_exact(model: nn.Module | partial) -> bool:
    """Whether option scores from one cached prompt pass per example equal one pass per (prompt + option) row.

    Exact: the bare model and weight-only adapters (LoRA, IA3, the Houlsby adapter, a trained head), where a token's
    states depend only on the tokens before it, which the cache holds; CaPT and Deep Prompt-Tuning, whose slots are
    written in the prompt's pass from the prompt alone (the capsule mean leaves the options out). Not exact, so
    scored row by row: PEFT Prompt Tuning and prefix tuning (they prepend virtual tokens or a prefix cache to every
    call, a cached one included), the `capt.baselines` prompt methods (DePT adds per-position offsets to every
    input token, options included, which a cached pass does not apply; the others are not verified). A bank called
    with per-row `adapter_names` (a `functools.partial`) is exact when all its adapters are: the prompt pass names
    each example's adapter, the continued pass each row's (cached steps honour `adapter_names`).
    """
    if isinstance(model, partial):
        configs = getattr(model.func, "adapter_configs", {})
        return bool(configs) and all(config.prompt_method is None for config in configs.values())
    config = getattr(model, "capt_config", None)
    if config is None and hasattr(model, "peft_config"):
        config = model.peft_config[model.active_adapter]
    if isinstance(config, CaptConfig):
        return config.prompt_method is None
    return config is None or not config.is_prompt_learning


def _autocasting() -> bool:
    """Whether a lower-precision autocast (CPU or CUDA) is on for the current code."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


FORMATS = {"encoder": EncoderFormat, "encoder-decoder": T5Format, "decoder": CausalLMFormat}


def head_outputs(task: str) -> int:
    """Outputs of an encoder's classification head: one per label, or one score per option for choice tasks."""
    spec = get_task(task)
    return 1 if spec.is_choice else len(spec.labels)


def make_format(
    family: str,
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    t5_generate: bool = False,
    decoder_head: str = "lm",
    prompt_bos: str = "tokenizer",
) -> TaskFormat:
    """The format of a backbone family; decoders with `decoder_head="classifier"` read the encoder's, left-padded.

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> tokenizer = load_backbone("tiny-llama").tokenizer
        >>> type(make_format("decoder", "copa", tokenizer, 64, decoder_head="classifier")).__name__
        'EncoderFormat'
    """
    spec = get_task(task)
    if spec.kind == "generate":
        return _generate_format(spec, family, tokenizer, max_length, decoder_head)
    if family == "decoder" and decoder_head == "classifier":
        return EncoderFormat(task=task, tokenizer=tokenizer, max_length=max_length, padding_side="left")
    options = {"generate": t5_generate} if family == "encoder-decoder" else {}
    if family == "decoder":
        if prompt_bos not in PROMPT_BOS:
            raise ValueError(f"prompt_bos {prompt_bos!r}; expected one of {', '.join(PROMPT_BOS)}")
        options = {"prompt_bos": prompt_bos}
    return FORMATS[family](task=task, tokenizer=tokenizer, max_length=max_length, **options)


def _generate_format(
    spec: TaskSpec, family: str, tokenizer: PreTrainedTokenizerBase, max_length: int, decoder_head: str
) -> TaskFormat:
    """The chat format of a generate task: a decoder-only LM writes the answer, so no other family or head can."""
    from .chat import ChatFormat  # chat builds on this module: a module-level import would be circular

    if family != "decoder" or decoder_head != "lm":
        backbone = "a decoder with --decoder-head classifier" if family == "decoder" else f"an {family} model"
        raise ValueError(
            f"--model: {spec.name} is a generate task, which needs a decoder-only LM that writes its answers "
            f"(e.g. --model smollm2, or tiny-llama for a quick try); this backbone is {backbone}"
        )
    return ChatFormat(task=spec.name, tokenizer=tokenizer, max_length=max_length, metric=spec.metrics[0])


def _per_example(row_scores: torch.Tensor, options: list[int]) -> torch.Tensor:
    """Flat per-option scores -> (examples, max options), missing options at -inf."""
    table = row_scores.new_full((len(options), max(options)), float("-inf"))
    for i, chunk in enumerate(torch.split(row_scores, options)):
        table[i, : len(chunk)] = chunk
    return table
