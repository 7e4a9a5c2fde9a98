"""Chat and instruction data (`generate` tasks) on decoder-only backbones: encoding, loss, and generated answers.

A row is either OpenAI-style `messages` (a list of `{"role": ..., "content": ...}`) or a `prompt` and a
`completion` (two strings). Rows are written as the tokenizer's own chat template writes them; the loss covers the
trained answer only (its labels; every other token is -100), and the capsule's instance tokens are the prompt, every
token before the first trained answer token, exactly what `generate` (and `capt serve`) feed the model at inference.

- `messages`: by default the LAST assistant turn is trained; everything before it is the prompt, as when the model
  is asked for that turn. With `assistant_turns="all"` every assistant turn is trained in one pass; the instance is
  then the prompt of the FIRST answer (the capsule is computed once per row and may not see any answer), so later
  turns are trained with a capsule of less context than they get at inference; an opening assistant turn (with no
  prompt before it) is context. Messages after the last trained turn train nothing and are dropped.
- `prompt`/`completion`: with a chat template, a user turn and an assistant turn. Without one, plain text as TRL
  writes non-conversational rows: the tokenizer's own leading special tokens (a BOS only where it adds one), the
  prompt, then the completion and an end-of-text token.

The one function that writes a prompt for generation, `prompt_ids`, serves training, evaluation and `capt serve`.

Example:
    >>> from capt.recipes.backbones import load_backbone
    >>> from capt.recipes.data import Example
    >>> tokenizer = load_backbone("tiny-llama").tokenizer
    >>> fmt = ChatFormat(task="my-chat", tokenizer=tokenizer, max_length=64)
    >>> row = fmt.encode(Example("my-chat", 0, {"prompt": "2 + 2 =", "completion": "4"}, None))
    >>> tokenizer.decode(row["input_ids"][: row["instance_length"]])
    '[CLS] 2 + 2 ='
    >>> tokenizer.decode([t for t in row["labels"] if t != -100])
    '4 [SEP]'
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from .data import Example
from .format_base import Features, TaskFormat, has_capsules, target_logprobs, to_device
from .metrics import exact_match, token_f1

ASSISTANT_TURNS = ("last", "all")
ROLES = ("system", "user", "assistant", "tool")
# The validation number early stopping follows (a task spec's first metric). Loss and perplexity enter as the inverse
# perplexity (the geometric mean probability of an answer token, in (0, 1]), so that every score is better when higher.
METRICS = ("exact_match", "token_f1", "perplexity", "loss")


class ChatDataError(ValueError):
    """A generate row that cannot be encoded; the message names the row and the field."""


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer itself writes before a text: a BOS where it adds one (Llama), BERT's [CLS],
    nothing for SmolLM2 (whose `bos_token` it never adds).

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> leading_special_ids(load_backbone("tiny-llama").tokenizer)  # MiniLM's [CLS]
        [101]
    """
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def end_of_text_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token a plain-text completion ends with: EOS, or [SEP] for BERT-style tokenizers that have no EOS."""
    token = _tokenizer_end_id(tokenizer)
    if token is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has neither an eos_token nor a sep_token to end text")
    return token


def _tokenizer_end_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id


def answer_stop_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Tokens that end a generated answer, sorted: the tokenizer's end of text (`end_of_text_id`, where it has
    one) and every EOS id of the model's generation config. Instruct models list their end-of-turn token only
    there (Gemma-3-it: `<eos>` and `<end_of_turn>`), so stopping at the tokenizer's EOS alone would run on to
    `max_tokens`.

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> backbone = load_backbone("tiny-llama")  # its end of text: [SEP], 102
        >>> backbone.model.generation_config.eos_token_id = [102, 7]  # 7 standing in for an end-of-turn token
        >>> answer_stop_ids(backbone.model, backbone.tokenizer)
        [7, 102]
    """
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops = set([configured] if isinstance(configured, int) else configured or [])
    tokenizer_end = _tokenizer_end_id(tokenizer)
    if tokenizer_end is not None:  # else only the config's ids stop
        stops.add(tokenizer_end)
    return sorted(stops)


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} dicts of strings; a ChatDataError naming `where` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            raise ChatDataError(f"{where}: messages[{number}] has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ChatDataError(f"{where}: messages[{number}] ({message['role']}) needs a string 'content'")
    return messages


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """The conversation as the tokenizer's own chat template writes it (text, not tokens)."""
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template, so it cannot write `messages` rows: use a "
            "chat model's tokenizer (one whose tokenizer_config.json has a chat_template), set "
            "tokenizer.chat_template, or give the rows as `prompt` and `completion` text"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]] | None = None, text: str = ""
) -> list[int]:
    """The tokens a model is given to write the next answer: for `messages`, the chat template with its generation
    prompt; for plain `text`, the tokenizer's leading special tokens and the text. Training, evaluation and
    `capt serve` all encode prompts here, so an adapter meets at inference the tokens it was trained on.

    The rendered template is tokenized without adding special tokens: the template writes any BOS itself.
    """
    if messages is not None:
        return tokenizer(render_chat(tokenizer, messages, True), add_special_tokens=False)["input_ids"]
    return leading_special_ids(tokenizer) + tokenizer(text, add_special_tokens=False)["input_ids"]


def request_prompt_ids(tokenizer: PreTrainedTokenizerBase, fields: dict[str, Any], where: str) -> list[int]:
    """The prompt of a generate row to answer, exactly as training wrote that row's prompt (`capt predict`, and
    `capt serve` for a generate-trained adapter). The row is `messages` (where it ends with an assistant turn, that
    turn is the answer asked for, as in training; else the turn after the last message) or a `prompt` (written as
    a user turn where the tokenizer has a chat template, as training writes `prompt`/`completion` rows; a
    `completion`, if given, is not read). Raises ChatDataError naming `where`.

    Example:
        >>> from capt.recipes.backbones import load_backbone
        >>> tokenizer = load_backbone("tiny-llama").tokenizer  # no chat template: plain text
        >>> tokenizer.decode(request_prompt_ids(tokenizer, {"prompt": "2 + 2 ="}, "row 1"))
        '[CLS] 2 + 2 ='
    """
    if "messages" in fields:
        messages = check_messages(fields["messages"], where)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise ChatDataError(f"{where}: messages holds only an assistant turn; there is no prompt to answer")
        ids = prompt_ids(tokenizer, messages)
    elif isinstance(fields.get("prompt"), str):
        if has_chat_template(tokenizer):
            ids = prompt_ids(tokenizer, [{"role": "user", "content": fields["prompt"]}])
        else:
            ids = prompt_ids(tokenizer, text=fields["prompt"])
    else:
        raise ChatDataError(f"{where}: a row to answer needs `messages`, or a `prompt` string")
    if not ids:
        raise ChatDataError(f"{where}: the prompt writes no token; the capsule summarises the prompt")
    return ids


@dataclass
class ChatFormat(TaskFormat):
    """A `generate` task on a decoder-only LM: rows from `Example.fields` (`messages`, or `prompt` and
    `completion`), trained on the answer, evaluated by loss, perplexity and greedy answers (exact match, token F1).

    `assistant_turns`: "last" (default) or "all" (see the module docstring). `metric` names the validation number
    that becomes "score": "token_f1" (default), "exact_match", or "perplexity" or "loss" (either as 1 / perplexity).
    Generated answers stop at an end-of-text token or after `max_new_tokens`.

    Padding: training rows on the right (as `CausalLMFormat`), generation prompts on the left (as `generate`
    needs); the capsule's positions do not depend on either.
    """

    assistant_turns: str = "last"
    metric: str = "token_f1"
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.assistant_turns not in ASSISTANT_TURNS:
            raise ValueError(f"assistant_turns must be one of {ASSISTANT_TURNS}, got {self.assistant_turns!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS} for a generate task, got {self.metric!r}")
        if self.max_new_tokens < 1 or self.max_length < 2:
            raise ValueError("max_new_tokens must be >= 1 and max_length >= 2")

    # ------------------------------------------------------------------ encoding

    def cache_settings(self) -> dict[str, Any]:
        """What besides the examples and the tokenizer's name decides `encode`'s output (the feature cache key)."""
        return {
            "assistant_turns": self.assistant_turns,
            "chat_template": hashlib.sha256(repr(self.tokenizer.chat_template).encode()).hexdigest(),
            "code": hashlib.sha256(inspect.getsource(inspect.getmodule(ChatFormat)).encode()).hexdigest(),
        }

    def encode(self, example: Example) -> Features:
        """{"input_ids", "labels" (-100 outside the trained answer), "instance_length" (the prompt's tokens, all
        before the first answer token), "prompt_ids" (the prompt of the reference answer, for generation),
        "reference" (that answer's text), "length"}. Raises ChatDataError naming the row."""
        where = f"row {example.idx}"
        segments, prompt, reference = self._segments(example.fields, where)
        answer_tokens = sum(len(ids) for ids, trained in segments[1:])
        room = self.max_length - answer_tokens
        if not segments[0][0]:  # the capsule's mean needs a token (the spec: no row without instance tokens)
            raise ChatDataError(f"{where}: the prompt writes no token; the capsule summarises the prompt")
        context = self._truncated(segments[0][0], room, where, answer_tokens)
        input_ids, labels = list(context), [-100] * len(context)
        for ids, trained in segments[1:]:
            input_ids += ids
            labels += ids if trained else [-100] * len(ids)
        prompt = context if prompt is None else self._truncated(prompt, self.max_length, where, 0)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "instance_length": len(context),
            "prompt_ids": prompt,
            "reference": reference,
            "length": len(input_ids),
        }

    def encode_request(self, fields: dict[str, Any], where: str) -> Features:
        """{"prompt_ids", "length"}: the prompt of a row to answer (`capt predict`), as `request_prompt_ids` writes
        it, cut from the left to `max_length` as training cuts prompts. Raises ChatDataError naming `where`."""
        ids = self._truncated(request_prompt_ids(self.tokenizer, fields, where), self.max_length, where, 0)
        return {"prompt_ids": ids, "length": len(ids)}

    def _segments(
        self, fields: dict[str, Any], where: str
    ) -> tuple[list[tuple[list[int], bool]], list[int] | None, str]:
        """(segments, generation prompt or None when it is the first segment, reference answer).

        Segments are (token ids, trained) in order; the first is the instance (the prompt), the second the first
        trained answer. Each is tokenized on its own, the prompt exactly as `prompt_ids` writes it."""
        if "messages" in fields:
            messages = check_messages(fields["messages"], where)
        elif "prompt" in fields and "completion" in fields:
            prompt, completion = fields["prompt"], fields["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise ChatDataError(f"{where}: prompt and completion must be strings")
            if not completion:
                raise ChatDataError(f"{where}: completion is empty: there is nothing to train on")
            if not has_chat_template(self.tokenizer):
                answer = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
                answer.append(end_of_text_id(self.tokenizer))
                return [(prompt_ids(self.tokenizer, text=prompt), False), (answer, True)], None, completion
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        else:
            raise ChatDataError(f"{where}: a generate row needs `messages`, or `prompt` and `completion`")
        return self._chat_segments(messages, where)

    def _chat_segments(
        self, messages: list[dict[str, str]], where: str
    ) -> tuple[list[tuple[list[int], bool]], list[int] | None, str]:
        assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if not assistant:
            raise ChatDataError(f"{where}: messages has no assistant turn to train on")
        # An opening assistant turn (a greeting) has no prompt to summarise: "all" trains the turns after it.
        trained = [i for i in assistant if i > 0] if self.assistant_turns == "all" else assistant[-1:]
        tokenize = self.tokenizer
        segments: list[tuple[list[int], bool]] = []
        written = ""  # the rendered text the segments so far cover
        if not trained or trained[0] == 0:
            raise ChatDataError(f"{where}: messages[0] is an assistant turn with no prompt before it to answer")
        for turn in trained:
            # The answer is what the template writes after the generation prompt: the content and its end-of-turn.
            before = render_chat(tokenize, messages[:turn], True)
            through = render_chat(tokenize, messages[: turn + 1], False)
            if not through.startswith(before):
                raise ChatDataError(
                    f"{where}: the chat template's generation prompt does not begin messages[{turn}] as the template "
                    "writes it, so its answer cannot be told apart from its prompt"
                )
            if not before.startswith(written):
                raise ChatDataError(
                    f"{where}: the chat template writes the turns before messages[{turn}] differently once more "
                    "follow (it rewrites earlier turns); train the last turn only (assistant_turns='last')"
                )
            if not written:
                context = prompt_ids(tokenize, messages[:turn])
            else:
                context = tokenize(before[len(written) :], add_special_tokens=False)["input_ids"]
            answer = tokenize(through[len(before) :], add_special_tokens=False)["input_ids"]
            if not answer:
                raise ChatDataError(f"{where}: messages[{turn}] writes no tokens to train on")
            segments += [(context, False), (answer, True)] if context or not segments else [(answer, True)]
            written = through
        last = trained[-1]
        generation_prompt = None if len(trained) == 1 else prompt_ids(tokenize, messages[:last])
        return segments, generation_prompt, messages[last]["content"]

    def _truncated(self, context: list[int], room: int, where: str, answer_tokens: int) -> list[int]:
        """`context` cut from the left (after its leading special tokens) to `room` tokens; the answer is never cut:
        a row whose answer leaves no room for a prompt token is refused."""
        if len(context) <= room:
            return context
        special = leading_special_ids(self.tokenizer)
        lead = len(special) if context[: len(special)] == special else 0
        if room - lead < 1:
            raise ChatDataError(
                f"{where}: the answer takes {answer_tokens} tokens (with any turns after it), which leaves no room "
                f"for the prompt within max_length {self.max_length}; raise --max-length or shorten the answer"
            )
        return context[:lead] + context[len(context) - (room - lead) :]

    # ------------------------------------------------------------------ batches

    def collate(self, features: list[Features]) -> dict[str, Any]:
        """{"train_inputs": right-padded rows with labels and instance_mask, "prompt_inputs": left-padded
        generation prompts, "references": the answers' texts}; prompts only for `encode_request`'s features."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompts = [f["prompt_ids"] for f in features]
        width = max(len(p) for p in prompts)
        prompt_inputs = {
            "input_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long),
            "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
        }
        if not all("input_ids" in f for f in features):
            return {"prompt_inputs": prompt_inputs}
        rows = [f["input_ids"] for f in features]
        attention = self._pad([[1] * len(r) for r in rows], 0)
        positions = torch.arange(attention.shape[1])[None]
        instance = positions < torch.tensor([f["instance_length"] for f in features])[:, None]
        return {
            "train_inputs": {
                "input_ids": self._pad(rows, pad),
                "attention_mask": attention,
                "labels": self._pad([f["labels"] for f in features], -100),
                "instance_mask": instance & attention.bool(),
            },
            "prompt_inputs": prompt_inputs,
            "references": [f["reference"] for f in features],
        }

    def answer_logprobs(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed log-probability of each row's answer tokens, answer tokens per row).

        The LM head runs only from the earliest answer position on (`logits_to_keep`); the labels stay out of the
        model (it would compute a loss over every position), and the capsule's mean covers the instance only
        (`instance_mask`, given to models with capsules)."""
        labels = inputs["labels"]
        first_target = int((labels != -100).int().argmax(-1).min())
        model_inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        if has_capsules(model):
            model_inputs["instance_mask"] = inputs["instance_mask"]
        logits = model(**model_inputs, logits_to_keep=labels.shape[1] - first_target + 1).logits
        return target_logprobs(logits, labels, shifted=True), (labels[:, 1:] != -100).sum(-1)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Mean negative log-likelihood per answer token of the batch (Hugging Face's causal-LM loss on the answer)."""
        logprobs, tokens = self.answer_logprobs(model, batch["train_inputs"])
        return -logprobs.sum() / tokens.sum()

    def scores(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        raise TypeError("a generate task has no options to score: use ChatFormat.predict or ChatFormat.evaluate")

    def stop_ids(self, model: nn.Module) -> list[int]:
        """Tokens that end an answer (`answer_stop_ids`)."""
        return answer_stop_ids(model, self.tokenizer)

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: dict[str, Any]) -> list[str]:
        """Greedy answers to the batch's prompts: one batched, KV-cached `generate`, decoded without special tokens
        and stripped. A CaPT model computes each capsule from its own prompt only."""
        prompts = batch["prompt_inputs"]
        stops = self.stop_ids(model)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stops[0]
        generated = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=pad,
        )[:, prompts["input_ids"].shape[1] :]
        return [
            self.tokenizer.decode(_until(row.tolist(), stops), skip_special_tokens=True).strip() for row in generated
        ]

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, features: list[Features], batch_size: int, device: torch.device | str = "cpu"
    ) -> dict[str, float]:
        """{"loss" (mean NLL per answer token), "perplexity", "exact_match", "token_f1" (means over rows of the
        greedy answers against the references), "score" (the number `metric` names; 1 / perplexity for
        "perplexity" and "loss")}. Batched in length order, for less padding.

        Example:
            >>> scores = fmt.evaluate(model, features, batch_size=16)  # doctest: +SKIP
            >>> sorted(scores)  # doctest: +SKIP
            ['exact_match', 'loss', 'perplexity', 'score', 'token_f1']
        """
        if not features:
            raise ValueError("no examples to evaluate")
        model.eval()
        order = sorted(range(len(features)), key=lambda i: features[i]["length"])
        logprob_sum, tokens = 0.0, 0
        matches, overlaps = [], []
        for start in range(0, len(order), batch_size):
            batch = to_device(self.collate([features[i] for i in order[start : start + batch_size]]), device)
            logprobs, counts = self.answer_logprobs(model, batch["train_inputs"])
            logprob_sum, tokens = logprob_sum + float(logprobs.sum()), tokens + int(counts.sum())
            for answer, reference in zip(self.predict(model, batch), batch["references"], strict=True):
                matches.append(exact_match(answer, reference))
                overlaps.append(token_f1(answer, reference))
        loss = -logprob_sum / tokens
        scores = {
            "loss": loss,
            "perplexity": math.exp(loss),
            "exact_match": sum(matches) / len(matches),
            "token_f1": sum(overlaps) / len(overlaps),
        }
        scores["score"] = math.exp(-loss) if self.metric in ("perplexity", "loss") else scores[self.metric]
        return scores


def _until(tokens: Sequence[int], stops: Sequence[int]) -> list[int]:
    """`tokens` up to (not including) the first stop token."""
    ends = [i for i, token in enumerate(tokens) if token in stops]
    return list(tokens[: ends[0]] if ends else tokens)
