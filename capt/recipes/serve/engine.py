"""The model worker of `capt serve`: one thread owns the capsule bank and runs batches from a bounded queue.

Requests wait in the queue; the worker takes the first one, keeps collecting for `batch_window_s` or until
`max_batch` jobs, and runs them together: classification records of every task in one forward (one adapter per
row), completions as one left-padded batch decoded step by step by `decode_batch`, a loop over the model with its
KV cache. Decoding is step-synchronous: a batch's rows start together and leave one by one (stop, max_tokens,
end of sequence, or a client gone), and requests that arrive meanwhile wait for the next batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...model import CaptModel
from ..data import TASKS, Example, parse_record
from ..formats import TaskFormat, make_format
from ..predict import Scored, score_examples
from ..run import ADAPTER_DIR, read_run_config

BASE_MODEL = "base"  # the `model` name that runs the frozen backbone without capsules


@dataclass
class Limits:
    """What one request may ask and how much may wait (`capt serve` flags)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 1024
    max_tokens: int = 256
    max_records: int = 64
    queue_size: int = 64
    timeout_s: float = 60.0
    batch_window_s: float = 0.005
    max_batch: int = 16


@dataclass
class Completion:
    """One completion request, and what the worker tells its waiter (`emit` is called from the worker thread)."""

    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    emit: Callable[[dict[str, Any]], None]  # {"text": delta} ... then {"done": finish_reason, "tokens": n}
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class Classification:
    """One classify request: (adapter, format, example) items per record; `emit` gets the scored items."""

    items: list[list[tuple[str, TaskFormat, Example]]]
    emit: Callable[[dict[str, Any]], None]  # {"results": [[Scored, ...] per record]} or {"error": message}
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)


class QueueFull(Exception):
    """The request queue holds `Limits.queue_size` jobs already (HTTP 429)."""


@dataclass
class AdapterInfo:
    path: str
    task: str | None  # the SuperGLUE task it answers in /v1/classify (a run's task, or its name if one)
    max_length: int


def adapter_folder(path: str | Path) -> tuple[Path, AdapterInfo]:
    """An adapter folder, or the `adapter/` folder of a `capt train` run, with what the run says of its task."""
    directory = Path(path)
    if (directory / ADAPTER_DIR).is_dir():
        config = read_run_config(directory)
        return directory / ADAPTER_DIR, AdapterInfo(str(directory), config.task, config.max_length)
    if not directory.is_dir():
        raise FileNotFoundError(f"{path}: no such adapter folder or `capt train` run folder")
    return directory, AdapterInfo(str(directory), None, 256)


class Engine:
    """The bank, its tokenizer, the queue and the worker thread; thread-safe `submit`, `load` and `unload`.

    Example:
        >>> engine = Engine(bank, backbone.tokenizer, backbone.family, Limits())  # doctest: +SKIP
        >>> engine.start(); engine.submit(Completion("rte", ids, 8, 0.0, 1.0, None, [], print))  # doctest: +SKIP
    """

    def __init__(self, bank: CaptModel, tokenizer, family: str, limits: Limits, observe=None):
        self.bank = bank.eval()
        self.tokenizer = tokenizer
        self.family = family
        self.limits = limits
        self.adapters: dict[str, AdapterInfo] = {}
        self.queue: queue.Queue = queue.Queue(maxsize=limits.queue_size)
        self.lock = threading.Lock()  # the bank is used by the worker and changed by load/unload
        self.observe = observe or (lambda kind, size: None)  # metrics hook: (batch kind, rows)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capt-serve-worker", daemon=True)

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def submit(self, job: Completion | Classification) -> None:
        try:
            self.queue.put_nowait(job)
        except queue.Full as err:
            raise QueueFull(f"the request queue is full ({self.limits.queue_size} waiting); retry later") from err

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Validate and attach an adapter (safetensors only; fingerprint and shapes checked by `load_adapter`)."""
        if name == BASE_MODEL:
            raise ValueError(f"{name!r} is reserved for the base model")
        folder, info = adapter_folder(path)
        with self.lock:
            if name in self.bank.adapter_configs:
                raise KeyError(f"an adapter named {name!r} is already loaded")
            self.bank.load_adapter(folder, adapter_name=name)
            self.adapters[name] = info
        return info

    def unload(self, name: str) -> None:
        with self.lock:
            if name not in self.adapters:
                raise LookupError(f"no adapter named {name!r}")
            if name == self.bank.active_adapter:
                others = [other for other in self.adapters if other != name]
                if not others:
                    raise ValueError(f"{name!r} is the last adapter; a bank keeps one")
                self.bank.set_adapter(others[0])
            self.bank.delete_adapter(name)
            del self.adapters[name]

    def classification_items(self, records: list[dict]) -> list[list[tuple[str, TaskFormat, Example]]]:
        """Parse official records (each with a `task` naming an adapter); raises LookupError / ValueError."""
        items = []
        for number, record in enumerate(records):
            if not isinstance(record, dict):
                raise ValueError(f"records[{number}] is not an object")
            record = dict(record)
            name = record.pop("task", None)
            info = self.adapters.get(name)
            if info is None:
                raise LookupError(f"records[{number}]: task {name!r} names no loaded adapter")
            task = info.task or name
            if task not in TASKS:
                raise ValueError(f"records[{number}]: adapter {name!r} answers no SuperGLUE task")
            fmt = make_format(self.family, task, self.tokenizer, info.max_length)
            items.append([(name, fmt, ex) for ex in parse_record(task, record, f"records[{number}]")])
        return items

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            jobs = [first]
            deadline = time.perf_counter() + self.limits.batch_window_s
            while len(jobs) < self.limits.max_batch and (left := deadline - time.perf_counter()) > 0:
                try:
                    jobs.append(self.queue.get(timeout=left))
                except queue.Empty:
                    break
            jobs = [job for job in jobs if not job.cancelled.is_set()]
            with self.lock:
                self._run_classifications([j for j in jobs if isinstance(j, Classification)])
                completions = [j for j in jobs if isinstance(j, Completion)]
                for base in (False, True):  # the base model runs with the capsules switched off
                    group = [j for j in completions if (j.model == BASE_MODEL) == base]
                    self._run_completions(group, base)

    def _run_classifications(self, jobs: list[Classification]) -> None:
        if not jobs:
            return
        flat = [item for job in jobs for record in job.items for item in record]
        self.observe("classify", len(flat))
        try:
            scored = iter(score_examples(self.bank, flat, batch_size=max(len(flat), 1)))
        except Exception as err:  # an adapter unloaded since parsing, or a model error: tell every waiter
            for job in jobs:
                job.emit({"error": str(err)})
            return
        for job in jobs:
            job.emit({"results": [[next(scored) for _ in record] for record in job.items]})

    def _run_completions(self, jobs: list[Completion], base: bool) -> None:
        if not jobs:
            return
        self.observe("completion", len(jobs))
        try:
            with self.bank.disable_adapter() if base else nullcontext():
                decode_batch(self.bank, self.tokenizer, jobs, num_slots=0 if base else self.bank.num_slots)
        except Exception as err:
            for job in jobs:
                job.emit({"error": str(err)})


@torch.no_grad()
def decode_batch(model: CaptModel, tokenizer, jobs: list[Completion], num_slots: int) -> None:
    """Generate for a batch of completions: left-padded prefill with one adapter per row, then one token per step.

    Each row samples with its own generator (seeded by its request), so its tokens do not depend on its
    batchmates. Positions follow the attention mask, as in `generate`: padding never shifts a row.
    """
    device = next(model.parameters()).device
    width = max(len(job.prompt_ids) for job in jobs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs], device=device)
    mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs], device=device)
    names = None if num_slots == 0 else [job.model for job in jobs]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, adapter_names=names, use_cache=True)
    generators = []
    for job in jobs:
        generator = torch.Generator(device=device)
        generator.manual_seed(job.seed if job.seed is not None else int(torch.randint(0, 2**31, ()).item()))
        generators.append(generator)
    tokens: list[list[int]] = [[] for _ in jobs]
    sent = [0] * len(jobs)
    done = [False] * len(jobs)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    hold = max((len(s) for j in jobs for s in j.stop), default=1) - 1  # text that may still start a stop string
    while True:
        logits = out.logits[:, -1].float()
        chosen = []
        for row, job in enumerate(jobs):
            chosen.append(pad if done[row] else _choose(logits[row], job, generators[row]))
        for row, job in enumerate(jobs):
            if done[row]:
                continue
            if job.cancelled.is_set():  # the client went away: its row leaves the batch
                done[row] = True
                continue
            token = chosen[row]
            finish = None
            if token == eos:
                finish = "stop"
            else:
                tokens[row].append(token)
                text = tokenizer.decode(tokens[row], skip_special_tokens=True)
                cut = min((i for s in job.stop if (i := text.find(s)) >= 0), default=-1)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
                elif len(tokens[row]) >= job.max_tokens:
                    finish = "length"
                end = len(text) if finish else max(sent[row], len(text) - hold)
                if end > sent[row]:
                    job.emit({"text": text[sent[row] : end]})
                    sent[row] = end
            if finish:
                done[row] = True
                job.emit({"done": finish, "tokens": len(tokens[row])})
        if all(done):
            return
        mask = torch.cat([mask, mask.new_ones(len(jobs), 1)], dim=1)
        positions = mask.sum(-1, keepdim=True) - 1 + num_slots
        cache = "cache" if "cache" in out else "past_key_values"  # transformers renamed it in 5.x
        step = torch.tensor(chosen, device=device)[:, None]
        out = model(input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True, **{cache: out[cache]})


def _choose(logits: torch.Tensor, job: Completion, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling (top_p) at the request's temperature."""
    if job.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / job.temperature, dim=-1)
    if job.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        keep = ordered.cumsum(-1) - ordered < job.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=generator)[0])


__all__ = ["BASE_MODEL", "Classification", "Completion", "Engine", "Limits", "QueueFull", "Scored", "decode_batch"]
