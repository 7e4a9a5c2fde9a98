"""`capt serve`'s worker on its own (no HTTP): rows of different adapters generating or scored together."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import capt
from capt.recipes.backbones import load_backbone
from capt.recipes.serve.engine import AdapterInfo, Classification, Completion, DecodeBatch, Engine, Limits

RTE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue" / "RTE" / "val.jsonl"

PROMPTS = ["The cat sat on the mat because", "Paris is"]
ROWS = [("a", PROMPTS[0]), ("b", PROMPTS[1]), ("b", PROMPTS[0]), ("a", PROMPTS[1])]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    """tiny-llama with two adapters that differ in their capsules and in their own trained `lm_head`."""
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("a", "b")):
        base = load_backbone("tiny-llama").model
        torch.manual_seed(seed)
        model = capt.get_capt_model(base, capt.CaptConfig(init="normal", init_std=1.0, modules_to_save=["lm_head"]))
        with torch.no_grad():
            model.base_model.lm_head.weight.normal_()
        model.save_pretrained(root / name)
        model.unload()
    backbone = load_backbone("tiny-llama")
    bank = capt.CaptModel.from_pretrained(backbone.model, root / "a", adapter_name="a")
    bank.load_adapter(root / "b", adapter_name="b")
    return bank.eval(), backbone.tokenizer


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids `/v1/completions` feeds (a BOS first where the tokenizer has one)."""
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def decode_together(bank, tokenizer, rows: list[tuple[str, str]], join_at: list[int] | None = None) -> list[str]:
    """Greedy texts of `rows` (adapter, prompt) in one `DecodeBatch`, row i joining before step `join_at[i]`."""
    join_at = join_at or [0] * len(rows)
    events: list[list[dict]] = [[] for _ in rows]
    jobs = [
        Completion(name, prompt_ids(tokenizer, prompt), NEW_TOKENS, 0.0, 1.0, None, [], events[i].append)
        for i, (name, prompt) in enumerate(rows)
    ]
    batch = DecodeBatch(bank, tokenizer, bank.num_slots)
    for step in range(NEW_TOKENS + max(join_at)):
        joining = [job for job, at in zip(jobs, join_at, strict=True) if at == step]
        if joining:
            batch.join(joining)
        if batch.rows:
            batch.step()
    assert not batch.rows and all("done" in row[-1] for row in events)
    return ["".join(event.get("text", "") for event in row) for row in events]


def generate_alone(bank, tokenizer, name: str, prompt: str) -> str:
    """What `generate` gives with `name` as the active adapter: no per-row adapter names at all."""
    bank.set_adapter(name)
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    out = bank.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_mixed_adapter_batch_gives_each_row_what_its_adapter_gives_alone(bank):
    model, tokenizer = bank
    alone = [generate_alone(model, tokenizer, name, prompt) for name, prompt in ROWS]
    model.set_adapter("a")  # "b" is then a stored adapter: its rows need their names at every step
    assert decode_together(model, tokenizer, ROWS) == alone
    assert [decode_together(model, tokenizer, [row])[0] for row in ROWS] == alone
    assert alone[0] != alone[2] and alone[1] != alone[3]  # the two adapters really answer differently


def test_rows_that_join_a_running_batch_get_what_they_get_alone(bank):
    model, tokenizer = bank
    alone = [generate_alone(model, tokenizer, name, prompt) for name, prompt in ROWS]
    model.set_adapter("a")
    assert decode_together(model, tokenizer, ROWS, join_at=[0, 0, 3, 6]) == alone


def test_a_row_ends_at_an_end_of_turn_token_that_only_the_generation_config_names(bank):
    """Instruct models (Gemma-3-it) list their end-of-turn token in generation_config.eos_token_id, not as the
    tokenizer's EOS: a served answer stops there, as `generate` does, instead of running on to max_tokens."""
    model, tokenizer = bank
    ids = prompt_ids(tokenizer, PROMPTS[0])
    model.set_adapter("a")

    def greedy() -> list[int]:
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        return out[0, len(ids) :].tolist()

    tokens = greedy()
    end_of_turn = tokens[3]  # stands in for <end_of_turn>: the fourth token greedy decoding writes
    config = model.base_model.generation_config
    saved = config.eos_token_id  # an int: tiny-llama's tokenizer (MiniLM's) has no EOS of its own
    assert end_of_turn != saved and end_of_turn not in tokens[:3]
    config.eos_token_id = [saved, end_of_turn]
    try:
        events: list[dict] = []
        batch = DecodeBatch(model, tokenizer, model.num_slots)
        batch.join([Completion("a", ids, NEW_TOKENS, 0.0, 1.0, None, [], events.append)])
        while batch.rows:
            batch.step()
        stopped = greedy()
    finally:
        config.eos_token_id = saved
    assert events[-1] == {"done": "stop", "tokens": 3}
    assert "".join(e.get("text", "") for e in events) == tokenizer.decode(tokens[:3], skip_special_tokens=True)
    assert stopped == tokens[:4]  # generate stops there too, after writing it


def test_a_tokenizer_without_an_end_token_stops_at_the_generation_configs_ids(bank):
    """Neither EOS nor [SEP] in the tokenizer: the decode loop still starts (serve builds one at startup) and
    stops where `generate` would, at the generation config's EOS."""
    import copy

    model, tokenizer = bank
    bare = copy.deepcopy(tokenizer)
    bare.sep_token = None
    assert bare.eos_token_id is None and bare.sep_token_id is None
    assert DecodeBatch(model, bare, model.num_slots).stop_ids == {model.base_model.generation_config.eos_token_id}


def test_unloading_an_adapter_mid_decode_fails_its_rows_only(bank, tmp_path):
    model, tokenizer = bank
    alone = generate_alone(model, tokenizer, "a", PROMPTS[0])
    model.set_adapter("a")
    model.save_pretrained(tmp_path / "b", adapter_name="b")  # to load "b" back for the other tests
    events: list[list[dict]] = [[], []]
    jobs = [
        Completion(name, prompt_ids(tokenizer, PROMPTS[0]), NEW_TOKENS, 0.0, 1.0, None, [], events[i].append)
        for i, name in enumerate(("a", "b"))
    ]
    batch = DecodeBatch(model, tokenizer, model.num_slots)
    batch.join(jobs)
    batch.step()
    model.delete_adapter("b")
    try:
        while batch.rows:
            batch.step()
    finally:
        model.load_adapter(tmp_path / "b", adapter_name="b")
    assert events[1][-1] == {"error": "adapter 'b' was unloaded while this completion ran"}
    assert "done" in events[0][-1] and not any("error" in event for event in events[0])
    assert "".join(event.get("text", "") for event in events[0]) == alone


def test_unloading_an_adapter_before_its_classification_runs_fails_that_job_only(bank, tmp_path):
    """Classify jobs for "a" and "b" wait together; "b" is unloaded before the batch runs: "b" gets an error
    naming it, and "a" exactly what it gets alone (not the error of the shared forward)."""
    model, tokenizer = bank
    engine = Engine(model, tokenizer, "decoder", Limits())
    engine.adapters = {name: AdapterInfo(str(tmp_path), "rte", 256) for name in ("a", "b")}
    record = json.loads(RTE.read_text().splitlines()[0])
    items = {name: engine.classification_items([{**record, "task": name}]) for name in ("a", "b")}
    alone: list[dict] = []
    engine._run_classifications([Classification(items["a"], alone.append)])
    model.save_pretrained(tmp_path / "b", adapter_name="b")  # to load "b" back for the other tests
    events: dict[str, list[dict]] = {"a": [], "b": []}
    jobs = [Classification(items[name], events[name].append) for name in ("a", "b")]
    engine.unload("b")
    try:
        engine._run_classifications(jobs)
    finally:
        model.load_adapter(tmp_path / "b", adapter_name="b")
    assert events["b"] == [{"error": "adapter 'b' was unloaded while this classification ran"}]
    assert "results" in alone[0] and events["a"] == alone


class Waiter:
    """What the worker tells one job, and when it has said its last word (done or error)."""

    def __init__(self):
        self.events: list[dict] = []
        self.finished = threading.Event()
        self.started = threading.Event()

    def __call__(self, event: dict) -> None:
        self.events.append(event)
        self.started.set()
        if "done" in event or "error" in event or "results" in event:
            self.finished.set()

    def text(self) -> str:
        assert self.finished.wait(60) and "done" in self.events[-1], self.events[-1:]
        return "".join(event.get("text", "") for event in self.events)

    def error(self) -> str:
        assert self.finished.wait(60) and "error" in self.events[-1], self.events[-1:]
        return self.events[-1]["error"]


@pytest.fixture()
def live_engine(bank, tmp_path):
    """The worker thread running over the bank; a batch waits 0.3 s for more jobs, so jobs sent together share
    it. `batches` records (kind, rows) of every model batch."""
    model, tokenizer = bank
    model.set_adapter("a")
    engine = Engine(model, tokenizer, "decoder", Limits(batch_window_s=0.3))
    engine.adapters = {name: AdapterInfo(str(tmp_path), "rte", 256) for name in ("a", "b")}
    engine.batches = []
    engine.observe = lambda kind, rows: engine.batches.append((kind, rows))
    engine.start()
    yield engine
    engine.stop()


def completion(tokenizer, name: str, prompt: str, tokens: int, temperature=0.0, seed=None, ids=None):
    waiter = Waiter()
    ids = ids if ids is not None else prompt_ids(tokenizer, prompt)
    return Completion(name, ids, tokens, temperature, 0.9, seed, [], waiter), waiter


def test_a_bad_row_in_a_live_decode_batch_fails_alone(live_engine, bank):
    """A greedy row decodes; a sampled row and three bad ones (a seed torch refuses, a NaN temperature that
    breaks sampling, a token id past the vocabulary that breaks the shared prefill) join it together. The bad
    rows get an error each; the good rows get exactly the text they get alone."""
    _, tokenizer = bank
    good = [("a", PROMPTS[0], 40, 0.0, None), ("b", PROMPTS[1], 12, 0.8, 3)]
    alone = []
    for name, prompt, tokens, temperature, seed in good:
        job, waiter = completion(tokenizer, name, prompt, tokens, temperature, seed)
        live_engine.submit(job)
        alone.append(waiter.text())

    first, first_waiter = completion(tokenizer, *good[0])
    live_engine.submit(first)
    assert first_waiter.started.wait(60)  # decoding now
    vocab = len(tokenizer)
    bad = [
        completion(tokenizer, "b", PROMPTS[1], 8, temperature=0.5, seed=2**70),
        completion(tokenizer, "a", PROMPTS[1], 8, temperature=float("nan")),
        completion(tokenizer, "b", PROMPTS[0], 8, ids=[vocab + 5, vocab + 9]),
    ]
    second, second_waiter = completion(tokenizer, *good[1])
    live_engine.batches.clear()
    for job, _ in [bad[0], bad[1], (second, second_waiter), bad[2]]:
        live_engine.submit(job)
    assert [first_waiter.text(), second_waiter.text()] == alone
    errors = [waiter.error() for _, waiter in bad]
    assert "seed" in errors[0] and all(errors)
    assert ("prefill", 4) in live_engine.batches  # the four joined together, then the bad ones failed alone
    deadline = time.monotonic() + 5  # rows leave right after their last word
    while live_engine.decoding and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live_engine.decoding == 0


def test_a_bad_record_in_a_live_classify_batch_fails_its_job_alone(live_engine, bank):
    """Three classify jobs share one forward; one holds a record the tokenizer cannot take (a lone surrogate,
    past the HTTP checks). That job gets an error naming its record; the others the answers they get alone."""
    model, tokenizer = bank
    lines = RTE.read_text().splitlines()
    good = [live_engine.classification_items([{**json.loads(line), "task": name}]) for line, name in
            ((lines[0], "a"), (lines[1], "b"))]  # fmt: skip
    broken = json.loads(lines[2])
    broken["premise"] += "\udfff"
    bad_items = live_engine.classification_items([{**json.loads(lines[3]), "task": "a"}, {**broken, "task": "b"}])

    alone = []
    for items in good:
        waiter = Waiter()
        live_engine.submit(Classification(items, waiter))
        assert waiter.finished.wait(60)
        alone.append(waiter.events[-1]["results"])

    waiters = [Waiter(), Waiter(), Waiter()]
    live_engine.batches.clear()
    for items, waiter in zip([good[0], bad_items, good[1]], waiters, strict=True):
        live_engine.submit(Classification(items, waiter))
    assert all(waiter.finished.wait(60) for waiter in waiters)
    assert live_engine.batches[0] == ("classify", 4)  # one shared forward first
    assert waiters[1].events[-1]["error"].startswith("records[1] could not be scored")
    for waiter, expected in zip([waiters[0], waiters[2]], alone, strict=True):
        (got,) = waiter.events[-1]["results"]
        assert [s.label for s in got] == [s.label for s in expected[0]]
        assert [s.scores for s in got] == [pytest.approx(s.scores, abs=1e-5) for s in expected[0]]
