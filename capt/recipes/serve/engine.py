"""The model worker of `capt serve`: one thread owns the capsule bank and runs batches from a bounded queue.

Between two decode steps the worker takes what waits in the queue (when idle: the first job, then whatever
arrives within `batch_window_s`, up to `max_batch`). Classification records of every task run as one forward, one
adapter per row. Completions join a `DecodeBatch` (continuous batching): their prefill runs, their KV cache is
merged into the running batch, and from the next step on they decode with the rows already there; a row leaves
as soon as it finishes or its client goes away. The base model's rows decode in a batch of their own, with the
capsules switched off.
"""

from __future__ import annotations

import inspect
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ...model import CaptModel
from ..chat import answer_stop_ids
from ..data import Example
from ..formats import TaskFormat, make_format
from ..predict import Scored, score_examples
from ..run import ADAPTER_DIR, RUN_CONFIG_NAME, missing_weights, read_run_config
from ..tasks import get_task, parse_task_record

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

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, int) and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0 < self.timeout_s < math.inf:  # also refuses nan
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")
        if not 0 <= self.batch_window_s < math.inf:
            raise ValueError(f"--batch-window-ms must be >= 0, got {self.batch_window_s * 1000}")


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
    task: str | None  # the task it answers in /v1/classify (a run's task, or its name if a built-in's)
    max_length: int
    prompt_bos: str = "tokenizer"  # how its run encoded decoder prompts (RunConfig.prompt_bos)


def adapter_folder(path: str | Path) -> tuple[Path, AdapterInfo]:
    """An adapter folder, or the `adapter/` folder of a `capt train` run, with what the run says of its task."""
    directory = Path(path)
    if (directory / RUN_CONFIG_NAME).is_file() and not (directory / ADAPTER_DIR).is_dir():
        raise missing_weights(directory / ADAPTER_DIR)  # a run folder without its adapter
    if (directory / ADAPTER_DIR).is_dir():
        config = read_run_config(directory)
        info = AdapterInfo(str(directory), config.task, config.max_length, config.prompt_bos)
        return directory / ADAPTER_DIR, info
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
        # Completions prefilled while their generation batch was decoding: they joined it instead of waiting for it
        # to end (continuous batching). Exposed as capt_batch_joins_total.
        self.joins = 0
        # Seconds the worker spent in each kind of forward, to tell where a latency tail comes from. Exposed as
        # capt_worker_seconds_total{kind}.
        self.busy = dict.fromkeys(("classify", "prefill", "decode"), 0.0)
        self._stop = threading.Event()
        self._held: Completion | None = None  # taken from the queue while the decode batch was full: next in line
        # The base model runs with the capsules switched off, so its rows decode in a batch of their own.
        self.lanes = {False: DecodeBatch(bank, tokenizer, bank.num_slots), True: DecodeBatch(bank, tokenizer, 0)}
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

    def prompt_bos(self, name: str) -> str:
        """How prompts for `name` (an adapter, or the base model) are encoded: as its run was trained."""
        info = self.adapters.get(name)
        return "tokenizer" if info is None else info.prompt_bos

    def generates(self, name: str) -> bool:
        """Whether `name` is an adapter trained on a generate task (its prompts are then written as its training
        wrote them: `capt.recipes.chat.request_prompt_ids`)."""
        info = self.adapters.get(name)
        return info is not None and info.task is not None and get_task(info.task).kind == "generate"

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
        """Parse records (each with a `task` naming an adapter; official records for SuperGLUE tasks, the task's own
        fields for a user task); raises LookupError / ValueError."""
        items = []
        for number, record in enumerate(records):
            if not isinstance(record, dict):
                raise ValueError(f"records[{number}] is not an object")
            record = dict(record)
            name = record.pop("task", None)
            info = self.adapters.get(name)
            if info is None:
                raise LookupError(f"records[{number}]: task {name!r} names no loaded adapter")
            try:
                spec = get_task(info.task or name)
            except ValueError as err:
                raise ValueError(f"records[{number}]: adapter {name!r} answers no task ({err})") from err
            if spec.kind == "generate":
                raise ValueError(
                    f"records[{number}]: adapter {name!r} was trained on the generate task {spec.name!r}: it writes "
                    "answers and has no labels to classify; ask it through /v1/chat/completions"
                )
            fmt = make_format(self.family, spec.name, self.tokenizer, info.max_length, prompt_bos=info.prompt_bos)
            items.append([(name, fmt, ex) for ex in parse_task_record(spec, record, f"records[{number}]")])
        return items

    # ------------------------------------------------------------------ the worker

    @property
    def decoding(self) -> int:
        """Rows generating now (a row leaves when it finishes or its client goes away)."""
        return sum(len(lane.rows) for lane in self.lanes.values())

    def _run(self) -> None:
        lanes = self.lanes
        while not self._stop.is_set():
            running = sum(len(lane.rows) for lane in lanes.values())
            room = self.limits.max_batch - running if all(lane.accepts for lane in lanes.values()) else 0
            jobs = self._collect(wait=running == 0, room=room)
            with self.lock:  # held for one step: adapters load and unload between steps
                self._run_classifications([j for j in jobs if isinstance(j, Classification)])
                for base, lane in lanes.items():
                    joining = [j for j in jobs if isinstance(j, Completion) and (j.model == BASE_MODEL) == base]
                    if joining or lane.rows:
                        with self.bank.disable_adapter() if base else nullcontext():
                            self._advance(lane, joining)

    def _collect(self, wait: bool, room: int) -> list[Completion | Classification]:
        """The jobs to start now, at most `max_batch`; completions only while the decode batch has `room`.

        With nothing decoding, it waits for a first job and then `batch_window_s` for more, so that requests
        arriving together prefill together. While rows decode it takes only what is already waiting: the next
        step is the window. The first completion that does not fit stays first in line (`_held`).
        """
        jobs: list[Completion | Classification] = []
        deadline = None
        while len(jobs) < self.limits.max_batch:
            try:
                if self._held is not None:
                    job, self._held = self._held, None
                elif not wait:
                    job = self.queue.get_nowait()
                elif deadline is None:
                    job = self.queue.get(timeout=0.1)
                elif (left := deadline - time.perf_counter()) > 0:
                    job = self.queue.get(timeout=left)
                else:
                    break
            except queue.Empty:
                break
            if wait and deadline is None:
                deadline = time.perf_counter() + self.limits.batch_window_s
            if job.cancelled.is_set():
                continue
            if isinstance(job, Completion):
                if room == 0:
                    self._held = job
                    break
                room -= 1
            jobs.append(job)
        return jobs

    def _run_classifications(self, jobs: list[Classification]) -> None:
        # A job naming an adapter unloaded since its request was parsed is refused on its own: in the shared
        # forward its rows would fail every job of the batch, other adapters' too.
        jobs = [job for job in jobs if not _refuse_unloaded(self.bank, job)]
        if not jobs:
            return
        flat = [item for job in jobs for record in job.items for item in record]
        self.observe("classify", len(flat))
        try:
            with self._busy("classify"):
                scored = iter(score_examples(self.bank, flat, batch_size=max(len(flat), 1)))
        except Exception:  # one job's record may have caused it: each job is scored again alone
            for job in jobs:
                self._classify_alone(job)
            return
        for job in jobs:
            job.emit({"results": [[next(scored) for _ in record] for record in job.items]})

    def _classify_alone(self, job: Classification) -> None:
        """Score one job on its own, after its shared batch failed: the others' answers are what they get alone,
        and a job that fails alone is told which of its records fails."""
        items = [item for record in job.items for item in record]
        try:
            with self._busy("classify"):
                scored = iter(score_examples(self.bank, items, batch_size=max(len(items), 1)))
        except Exception as err:  # reported to this job's waiter only
            job.emit({"error": _failing_record(self.bank, job, err)})
            return
        job.emit({"results": [[next(scored) for _ in record] for record in job.items]})

    def _advance(self, lane: DecodeBatch, joining: list[Completion]) -> None:
        """New rows join `lane` (their prefill), then every row decodes one token."""
        if joining:
            self.observe("prefill", len(joining))
            decoding = bool(lane.rows)
            try:
                with self._busy("prefill"):
                    lane.join(joining)
            except Exception:  # one request may have caused it: each joins again alone
                for job in joining:
                    self._join_alone(lane, job, decoding)
            else:
                self.joins += len(joining) if decoding else 0
        if lane.rows:
            self.observe("completion", len(lane.rows))
            try:
                with self._busy("decode"):
                    lane.step()
            except Exception as err:
                lane.fail(str(err))

    def _join_alone(self, lane: DecodeBatch, job: Completion, decoding: bool) -> None:
        """Prefill one request on its own after its shared prefill failed: a row's tokens do not depend on who
        prefills with it, so the others get what they get alone, and only the request that fails alone fails."""
        try:
            with self._busy("prefill"):
                lane.join([job])
        except Exception as err:  # reported to this request's waiter only
            job.emit({"error": f"this completion failed: {err}"})
        else:
            self.joins += 1 if decoding else 0

    @contextmanager
    def _busy(self, kind: str) -> Iterator[None]:
        """Adds the time the block takes (raising or not) to `busy[kind]`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.busy[kind] += time.perf_counter() - started


@dataclass
class _Row:
    """One request in a decode batch: its sampler and what it has generated and sent so far."""

    job: Completion
    generator: torch.Generator
    hold: int  # characters held back while they may still begin a stop string
    tokens: list[int] = field(default_factory=list)
    sent: int = 0


class DecodeBatch:
    """Continuous batching: rows that generate together, with one KV cache, joining and leaving between steps.

    `join` prefills new requests as a left-padded batch of their own, one adapter per row, so each capsule is
    computed from its own prompt exactly as in `generate`; their cache is then merged into the running one, the
    shorter side widened with masked columns between the slot and the tokens. `step` decodes one token for every
    row. A row leaves as soon as it finishes (end of sequence, a stop string, `max_tokens`) or its client goes
    away, and columns no remaining row attends to are dropped. Positions follow each row's own tokens, and masked
    columns weigh exactly nothing, so a row's tokens do not depend on who shares its batch, nor when they came.

    Caches other than full-attention `DynamicLayer`s (sliding windows) cannot be widened: there, new rows wait
    for the batch to empty (`accepts`), and rows still leave early.

    Example:
        >>> batch = DecodeBatch(bank, tokenizer, bank.num_slots)  # doctest: +SKIP
        >>> batch.join([Completion("rte", ids, 8, 0.0, 1.0, None, [], print)])  # doctest: +SKIP
        >>> while batch.rows: batch.step()  # doctest: +SKIP
    """

    def __init__(self, model: CaptModel, tokenizer, num_slots: int):
        self.model, self.tokenizer, self.num_slots = model, tokenizer, num_slots
        self.device = next(model.parameters()).device
        self.stop_ids = frozenset(answer_stop_ids(model, tokenizer))  # as `generate` and `capt predict` stop
        forward = inspect.signature(type(model.base_model).forward).parameters
        self.cache_key = "cache" if "cache" in forward else "past_key_values"  # transformers 5 renamed it
        # The prefill needs the last position's logits only; the LM head over the whole prompt is wasted work.
        self.prefill_options = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (rows, columns) over the tokens; the injector adds the slots'
        self.last: torch.Tensor | None = None  # (rows,) the token each row feeds next

    @property
    def accepts(self) -> bool:
        """Whether new rows can join now (always, unless the running cache cannot be widened)."""
        return not self.rows or _widenable(self.cache)

    @torch.no_grad()
    def join(self, jobs: list[Completion]) -> None:
        """Prefill `jobs` together, choose their first tokens and add the rows that go on to the batch."""
        rows = [row for job in jobs if not self._refuse_unloaded(job) and (row := _new_row(job, self.device))]
        if not rows:
            return
        jobs = [row.job for row in rows]
        width = max(len(job.prompt_ids) for job in jobs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs], device=self.device
        )
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            adapter_names=self._adapter_names(jobs),
            use_cache=True,
            **self.prefill_options,
        )
        chosen = self._choose_and_send(rows, out.logits[:, -1].float())
        going = [i for i, token in enumerate(chosen) if token is not None]
        if not going:
            return
        cache = out[self.cache_key]
        index = torch.tensor(going, device=self.device)
        if len(going) < len(rows):
            cache.batch_select_indices(index)
        rows, mask = [rows[i] for i in going], mask[index]
        last = torch.tensor([chosen[i] for i in going], device=self.device)
        if not self.rows:
            self.rows, self.cache, self.mask, self.last = rows, cache, mask, last
            return
        extra = self.mask.shape[1] - mask.shape[1]  # > 0: the newcomers are shorter; < 0: the batch is
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([self._widen(old.keys, -extra), self._widen(new.keys, extra)])
            old.values = torch.cat([self._widen(old.values, -extra), self._widen(new.values, extra)])
        self.mask = torch.cat([_pad_left(self.mask, -extra), _pad_left(mask, extra)])
        self.rows += rows
        self.last = torch.cat([self.last, last])

    @torch.no_grad()
    def step(self) -> None:
        """Decode one token for every row whose client and adapter are still there; finished rows leave."""
        # Gone clients and rows of an adapter unloaded since the last step leave before it, so that one
        # unloaded adapter fails its own rows only, not the whole batch.
        self._keep([not (row.job.cancelled.is_set() or self._refuse_unloaded(row.job)) for row in self.rows])
        if not self.rows:
            return
        mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        out = self.model(
            input_ids=self.last[:, None],
            attention_mask=mask,
            position_ids=mask.sum(-1, keepdim=True) - 1 + self.num_slots,
            adapter_names=self._adapter_names([row.job for row in self.rows]),
            use_cache=True,
            **{self.cache_key: self.cache},
        )
        self.mask, self.cache = mask, out[self.cache_key]
        chosen = self._choose_and_send(self.rows, out.logits[:, -1].float())
        self.last = torch.tensor([token or 0 for token in chosen], device=self.device)  # 0: a row that leaves now
        self._keep([token is not None for token in chosen])

    def fail(self, message: str) -> None:
        """Tell every row's waiter that the batch failed, and empty it."""
        for row in self.rows:
            row.job.emit({"error": message})
        self._keep([False] * len(self.rows))

    def _refuse_unloaded(self, job: Completion) -> bool:
        """Whether `job`'s adapter is no longer loaded (never in the base model's batch); its waiter is told."""
        return self.num_slots > 0 and _refuse_unloaded(self.model, job)

    def _adapter_names(self, jobs: list[Completion]) -> list[str] | None:
        """Each row's adapter, for every pass (prefill and decode steps: heads trained per adapter run at each);
        None in the base model's batch, whose capsules are switched off."""
        return None if self.num_slots == 0 else [job.model for job in jobs]

    def _choose_and_send(self, rows: list[_Row], logits: torch.Tensor) -> list[int | None]:
        """Each row's next token from its logits, its new text sent; None where the row has finished."""
        chosen: list[int | None] = []
        for row, row_logits in zip(rows, logits, strict=True):
            try:
                chosen.append(self._choose_one(row, row_logits))
            except Exception as err:  # this row's own sampling or text failed: it leaves alone
                row.job.emit({"error": f"this completion failed: {err}"})
                chosen.append(None)
        return chosen

    def _choose_one(self, row: _Row, logits: torch.Tensor) -> int | None:
        """`row`'s next token, its new text sent; None where the row has finished."""
        job, token = row.job, _choose(logits, row.job, row.generator)
        finish = None
        if token in self.stop_ids:
            finish = "stop"
        else:
            row.tokens.append(token)
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            cut = min((i for s in job.stop if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
            elif len(row.tokens) >= job.max_tokens:
                finish = "length"
            end = len(text) if finish else max(row.sent, len(text) - row.hold)
            if end > row.sent:
                job.emit({"text": text[row.sent : end]})
                row.sent = end
        if finish:
            job.emit({"done": finish, "tokens": len(row.tokens)})
        return None if finish else token

    def _keep(self, keep: list[bool]) -> None:
        """Only the rows marked True stay; then the leading columns every remaining row masks are dropped."""
        if all(keep):
            return
        if not any(keep):
            self.rows, self.cache, self.mask, self.last = [], None, None, None
            return
        index = torch.tensor([i for i, k in enumerate(keep) if k], device=self.device)
        self.cache.batch_select_indices(index)
        self.rows = [row for row, k in zip(self.rows, keep, strict=True) if k]
        self.mask, self.last = self.mask[index], self.last[index]
        unused = int(self.mask.any(0).long().argmax())  # leading columns that are padding in every row
        if unused and _widenable(self.cache):
            n = self.num_slots
            for layer in self.cache.layers:
                layer.keys = torch.cat([layer.keys[..., :n, :], layer.keys[..., n + unused :, :]], dim=-2)
                layer.values = torch.cat([layer.values[..., :n, :], layer.values[..., n + unused :, :]], dim=-2)
            self.mask = self.mask[:, unused:]

    def _widen(self, states: torch.Tensor, columns: int) -> torch.Tensor:
        """(rows, heads, length, dim) cached states with `columns` zero columns inserted after the slot columns."""
        if columns <= 0:
            return states
        n = self.num_slots
        zeros = states.new_zeros(*states.shape[:-2], columns, states.shape[-1])
        return torch.cat([states[..., :n, :], zeros, states[..., n:, :]], dim=-2)


def _refuse_unloaded(bank: CaptModel, job: Completion | Classification) -> bool:
    """Whether an adapter `job` runs is no longer in `bank` (unloaded while the job waited or ran); its waiter is
    then told which. A refused job does not run, and the others of its batch go on without it."""
    if isinstance(job, Completion):
        names, kind = [job.model], "completion"
    else:
        names, kind = [name for record in job.items for name, _, _ in record], "classification"
    gone = next((name for name in names if name not in bank.adapter_configs), None)
    if gone is None:
        return False
    job.emit({"error": f"adapter {gone!r} was unloaded while this {kind} ran"})
    return True


def _widenable(cache: DynamicCache | None) -> bool:
    return cache is not None and all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_left(mask: torch.Tensor, columns: int) -> torch.Tensor:
    return mask if columns <= 0 else torch.cat([mask.new_zeros(mask.shape[0], columns), mask], dim=1)


def _new_row(job: Completion, device: torch.device) -> _Row | None:
    """A request's row with its own sampler, seeded by its request (its tokens do not depend on its batchmates);
    None, its waiter told why, where the sampler cannot be built from what the request asks."""
    generator = torch.Generator(device=device)
    try:
        generator.manual_seed(job.seed if job.seed is not None else int(torch.randint(0, 2**31, ()).item()))
    except (ValueError, RuntimeError, OverflowError, TypeError) as err:
        job.emit({"error": f"seed {job.seed!r}: {err}"})
        return None
    return _Row(job, generator, max(map(len, job.stop), default=1) - 1)


def _failing_record(bank: CaptModel, job: Classification, err: Exception) -> str:
    """Which of `job`'s records fails when scored alone (the first), with its error; else `err` itself."""
    for number, record in enumerate(job.items):
        try:
            score_examples(bank, record, batch_size=max(len(record), 1))
        except Exception as own:  # the record's own error is the answer
            return f"records[{number}] could not be scored: {own}"
    return f"this classification failed: {err}"


def _choose(logits: torch.Tensor, job: Completion, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling (top_p) at the request's temperature.

    The logits are shifted so that their largest is 0 before the division, in float64: any temperature above 0
    then gives finite scores (the others at worst -inf), never the inf - inf = nan of a tiny temperature."""
    if job.temperature == 0:
        return int(logits.argmax())
    shifted = logits.double() - logits.max().double()
    probs = torch.softmax(shifted / job.temperature, dim=-1)
    if job.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        keep = ordered.cumsum(-1) - ordered < job.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=generator)[0])


__all__ = [
    "BASE_MODEL",
    "Classification",
    "Completion",
    "DecodeBatch",
    "Engine",
    "Limits",
    "QueueFull",
    "Scored",
]
