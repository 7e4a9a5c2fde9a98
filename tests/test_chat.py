"""Chat and instruction data (`generate`): what is trained, what the capsule sees, the loss, and generated answers."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

import capt
from capt.recipes.backbones import load_backbone, model_source
from capt.recipes.chat import ChatDataError, ChatFormat, leading_special_ids, prompt_ids
from capt.recipes.data import Example
from capt.recipes.metrics import exact_match, token_f1

# A small chat template with generation markers, so Hugging Face's own assistant mask is an independent reference.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' %}{% generation %} {{ m['content'] }}"
    "[SEP]\n{% endgeneration %}{% else %} {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello you"},
    {"role": "user", "content": "capital of france?"},
    {"role": "assistant", "content": "Paris, France."},
]
ROWS = [
    {"messages": [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three"}]},
    {"messages": CONVERSATION},
    {"prompt": "the cat sat on the", "completion": "mat today"},
    {"messages": [{"role": "user", "content": "red green blue yellow purple"}, {"role": "assistant", "content": "x"}]},
]


def example(fields, idx=0):
    return Example("chat", idx, fields, None)


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama with sharpened weights (at their 0.02 init, attention and logits are so flat that capsules barely
    matter) and its tokenizer, given the chat template."""
    backbone = load_backbone("tiny-llama")
    backbone.tokenizer.chat_template = TEMPLATE
    with torch.no_grad():
        for name, param in backbone.model.named_parameters():
            if "proj" in name or "lm_head" in name:
                param.mul_(10)
    return backbone


@pytest.fixture
def model(tiny):
    model = capt.get_capt_model(tiny.model, capt.CaptConfig(init="normal", init_std=2.0))
    yield model.eval()
    model.unload()


def fmt_of(tiny, **options):
    return ChatFormat(task="chat", tokenizer=tiny.tokenizer, max_length=options.pop("max_length", 64), **options)


@pytest.mark.parametrize("turns", ["last", "all"])
def test_labels_are_the_assistant_spans_that_hugging_face_marks(tiny, turns):
    """Hugging Face's `{% generation %}` mask is the reference: labels are the ids there (the trained turns'), and
    -100 everywhere else; the tokens are the whole conversation's, as the template writes it."""
    row = fmt_of(tiny, assistant_turns=turns).encode(example({"messages": CONVERSATION}))
    reference = tiny.tokenizer.apply_chat_template(CONVERSATION, return_assistant_tokens_mask=True)
    assert row["input_ids"] == reference["input_ids"]
    spans = reference["assistant_masks"]
    if turns == "last":  # only the last span: the first assistant turn is prompt
        first_end = spans.index(0, spans.index(1))
        spans = [0] * first_end + spans[first_end:]
    assert [int(label != -100) for label in row["labels"]] == spans
    assert all(label in (-100, token) for label, token in zip(row["labels"], row["input_ids"], strict=True))


@pytest.mark.parametrize("turns", ["last", "all"])
def test_the_instance_is_the_prompt_before_the_first_answer(tiny, turns):
    fmt = fmt_of(tiny, assistant_turns=turns)
    row = fmt.encode(example({"messages": CONVERSATION}))
    first_answer = next(i for i, label in enumerate(row["labels"]) if label != -100)
    assert row["instance_length"] == first_answer
    # The prompt of the reference (last) answer is what generation and `capt serve` are given.
    assert row["prompt_ids"] == prompt_ids(tiny.tokenizer, CONVERSATION[:-1])
    if turns == "last":
        assert row["input_ids"][:first_answer] == row["prompt_ids"]
    batch = fmt.collate([row, fmt.encode(example(ROWS[0]))])
    mask = batch["train_inputs"]["instance_mask"]
    assert mask[0].tolist() == [i < first_answer for i in range(len(row["input_ids"]))]
    short = fmt.encode(example(ROWS[0]))
    assert mask[1].tolist() == [i < short["instance_length"] for i in range(mask.shape[1])]  # padding never enters


def test_training_loss_is_the_masked_nll_with_the_prompt_as_instance(tiny):
    # Zero capsules: the capsule is the instance mean alone, so what enters the mean shows most in the loss.
    model = capt.get_capt_model(tiny.model, capt.CaptConfig()).eval()
    fmt = fmt_of(tiny)
    features = [fmt.encode(example(fields, i)) for i, fields in enumerate(ROWS)]
    batch = fmt.collate(features)
    with torch.no_grad():
        loss = fmt.loss(model, batch)
    total, count = 0.0, 0
    for row in features:  # each row alone, full logits, its own prompt as the instance
        ids = torch.tensor([row["input_ids"]])
        instance = torch.arange(ids.shape[1])[None] < row["instance_length"]
        with torch.no_grad():
            logprobs = model(input_ids=ids, instance_mask=instance).logits[0].log_softmax(-1)
        for position, label in enumerate(row["labels"]):
            if label != -100:
                total -= float(logprobs[position - 1, label])
                count += 1
    assert count == sum(sum(t != -100 for t in r["labels"]) for r in features)
    assert loss.item() == pytest.approx(total / count, abs=1e-5)
    # The instance mask matters: with the answer in the capsule's mean, the loss differs.
    inputs = {k: v for k, v in batch["train_inputs"].items() if k not in ("labels", "instance_mask")}
    with torch.no_grad():
        leaky = model(**inputs).logits.log_softmax(-1)
    labels = batch["train_inputs"]["labels"]
    picked = leaky[:, :-1].gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    assert abs(-(picked * (labels[:, 1:] != -100)).sum().item() / count - loss.item()) > 0.05
    model.unload()


def test_a_training_step_moves_only_the_capsules(tiny, model):
    fmt = fmt_of(tiny)
    batch = fmt.collate([fmt.encode(example(fields, i)) for i, fields in enumerate(ROWS)])
    model.train()
    before = model.capsule_vectors.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    fmt.loss(model, batch).backward()
    optimizer.step()
    assert not torch.equal(model.capsule_vectors, before)
    assert all(not p.requires_grad for p in tiny.model.parameters())


def test_batched_cached_answers_equal_one_at_a_time_uncached_generation(tiny, model):
    fmt = fmt_of(tiny, max_new_tokens=6)
    features = [fmt.encode(example(fields, i)) for i, fields in enumerate(ROWS)]
    batched = fmt.predict(model, fmt.collate(features))
    stops = fmt.stop_ids(model)
    alone = []
    for row in features:
        ids = torch.tensor([row["prompt_ids"]])
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, use_cache=False, eos_token_id=stops)
        tokens = out[0, ids.shape[1] :].tolist()
        tokens = tokens[: next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]
        alone.append(tiny.tokenizer.decode(tokens, skip_special_tokens=True).strip())
    assert batched == alone
    assert len(set(batched)) > 1  # the rows do not all get one answer


def test_evaluate_reports_loss_perplexity_and_answer_scores(tiny, model):
    fmt = fmt_of(tiny, max_new_tokens=5)
    features = [fmt.encode(example(fields, i)) for i, fields in enumerate(ROWS)]
    scores = fmt.evaluate(model, features, batch_size=3)
    with torch.no_grad():
        whole = fmt.loss(model, fmt.collate(features)).item()
    assert scores["loss"] == pytest.approx(whole, rel=1e-5)  # token-weighted over batches of 3 and 1
    assert scores["perplexity"] == pytest.approx(math.exp(whole), rel=1e-5)
    assert scores["score"] == scores["token_f1"]
    answers = fmt.predict(model, fmt.collate(features))
    assert (
        scores["exact_match"] == sum(exact_match(a, f["reference"]) for a, f in zip(answers, features, strict=True)) / 4
    )
    # With the model's own answers as references (same prompts), every answer matches exactly.
    own = [{**f, "reference": a} for f, a in zip(features, answers, strict=True)]
    assert all(answers)
    mirrored = fmt_of(tiny, max_new_tokens=5, metric="exact_match").evaluate(model, own, batch_size=2)
    assert mirrored["exact_match"] == mirrored["token_f1"] == mirrored["score"] == 1.0
    by_perplexity = fmt_of(tiny, max_new_tokens=5, metric="perplexity").evaluate(model, features, batch_size=4)
    assert by_perplexity["score"] == pytest.approx(1 / scores["perplexity"])


def test_plain_prompt_completion_without_a_chat_template():
    """As TRL writes non-conversational rows: the tokenizer's own leading tokens, the prompt, the completion, EOS."""
    minilm = load_backbone("tiny-llama").tokenizer
    minilm.chat_template = None  # MiniLM's own tokenizer: the tiny decoders are given one
    smollm2 = AutoTokenizer.from_pretrained(model_source("smollm2"))
    smollm2.chat_template = None
    for tokenizer, lead in ((minilm, [minilm.cls_token_id]), (smollm2, [])):  # SmolLM2 never adds its BOS
        assert leading_special_ids(tokenizer) == lead
        row = ChatFormat("chat", tokenizer, 64).encode(example({"prompt": "Paris is in", "completion": " France"}))
        prompt = tokenizer("Paris is in", add_special_tokens=False)["input_ids"]
        answer = tokenizer(" France", add_special_tokens=False)["input_ids"]
        end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        assert row["input_ids"] == lead + prompt + answer + [end]
        assert row["labels"] == [-100] * len(lead + prompt) + answer + [end]
        assert row["instance_length"] == len(lead + prompt) and row["reference"] == " France"
    with pytest.raises(ValueError, match="no chat template.*prompt` and `completion`"):
        ChatFormat("chat", minilm, 64).encode(example(ROWS[0]))


def test_smollm2_chat_template_tokens_labels_and_instance():
    """The real template: its own system prompt, no BOS beyond the template's `<|im_start|>`, the answer and its
    `<|im_end|>` trained; the segments tokenize as the whole text does."""
    tokenizer = AutoTokenizer.from_pretrained(model_source("smollm2"))
    fmt = ChatFormat("chat", tokenizer, 256)
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]
    row = fmt.encode(example({"messages": messages}))
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert row["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert (
        row["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        and row["input_ids"][1] != row["input_ids"][0]
    )
    prompt = tokenizer.decode(row["input_ids"][: row["instance_length"]])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant") and prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode([t for t in row["labels"] if t != -100]) == "Paris.<|im_end|>\n"
    assert row["prompt_ids"] == tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)["input_ids"]
    assert tokenizer.eos_token_id in fmt.stop_ids(torch.nn.Module())


@pytest.mark.parametrize("template", [True, False])
def test_long_prompts_are_cut_from_the_left_and_answers_never(template):
    tokenizer = load_backbone("tiny-llama").tokenizer
    tokenizer.chat_template = TEMPLATE if template else None
    lead = [] if template else [tokenizer.cls_token_id]  # the template writes no special token in front
    fields = {"prompt": "w " * 40, "completion": "the answer here"}
    full = ChatFormat("chat", tokenizer, 200).encode(example(fields))
    cut = ChatFormat("chat", tokenizer, 20).encode(example(fields))
    assert len(cut["input_ids"]) == 20
    answer = [t for t in full["labels"] if t != -100]
    assert [t for t in cut["labels"] if t != -100] == answer
    kept = 20 - len(answer) - len(lead)
    full_prompt = full["input_ids"][: full["instance_length"]]
    assert full_prompt[: len(lead)] == lead
    assert cut["input_ids"][: cut["instance_length"]] == lead + full_prompt[-kept:]
    assert cut["prompt_ids"] == cut["input_ids"][: cut["instance_length"]]
    with pytest.raises(ChatDataError, match=r"row 7: the answer takes \d+ tokens.*max_length 4"):
        ChatFormat("chat", tokenizer, 4).encode(example(fields, idx=7))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "row 3: messages has no assistant turn"),
        ({"messages": [{"role": "user", "content": ["a"]}]}, r"row 3: messages\[0\] \(user\) needs a string"),
        ({"messages": []}, "row 3: messages must be a non-empty list"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, r"row 3: messages\[0\] is an assistant turn with no"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"row 3: messages\[0\] has role 'robot'; expected one"),
        ({"messages": ["hi"]}, r"row 3: messages\[0\] has role None"),
        ({"prompt": "a", "completion": ""}, "row 3: completion is empty"),
        ({"text": "a"}, "row 3: a generate row needs `messages`, or `prompt` and `completion`"),
    ],
)
def test_bad_rows_get_one_line_naming_the_row(tiny, fields, message):
    with pytest.raises(ChatDataError, match=message):
        fmt_of(tiny).encode(example(fields, idx=3))


def test_a_row_without_prompt_tokens_is_refused():
    """SmolLM2 adds no BOS: an empty plain-text prompt would leave the capsule no instance token."""
    tokenizer = AutoTokenizer.from_pretrained(model_source("smollm2"))
    tokenizer.chat_template = None
    with pytest.raises(ChatDataError, match="row 5: the prompt writes no token"):
        ChatFormat("chat", tokenizer, 64).encode(example({"prompt": "", "completion": "x"}, idx=5))


def test_bad_settings_are_refused(tiny):
    with pytest.raises(ValueError, match="assistant_turns"):
        fmt_of(tiny, assistant_turns="first")
    with pytest.raises(ValueError, match="metric"):
        fmt_of(tiny, metric="accuracy")


@pytest.mark.parametrize(
    ("prediction", "reference", "em", "f1"),
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0, 1.0),
        ("Paris, France", "Paris", 0.0, 2 / 3),
        ("a cat and a dog", "the dog and the cat", 0.0, 1.0),  # same words, another order: F1 1, EM 0
        ("nothing", "something else", 0.0, 0.0),
        ("", "", 1.0, 0.0),  # SQuAD: an empty answer shares no word
    ],
)
def test_exact_match_and_token_f1_on_known_strings(prediction, reference, em, f1):
    assert exact_match(prediction, reference) == em
    assert token_f1(prediction, reference) == pytest.approx(f1)


def test_the_feature_cache_follows_the_chat_template_and_turn_setting(tmp_path):
    from capt.recipes.evaluate import encode_cached
    from capt.recipes.run import RunConfig

    tokenizer = load_backbone("tiny-llama").tokenizer
    tokenizer.chat_template = TEMPLATE
    config, rows = RunConfig(cache_dir=str(tmp_path)), [example({"messages": CONVERSATION})]
    last = encode_cached(ChatFormat("chat", tokenizer, 64), rows, config)
    every = encode_cached(ChatFormat("chat", tokenizer, 64, assistant_turns="all"), rows, config)
    assert last != every
    tokenizer.chat_template = TEMPLATE.replace(":", " >")
    renamed = encode_cached(ChatFormat("chat", tokenizer, 64), rows, config)
    assert renamed != last and renamed == [ChatFormat("chat", tokenizer, 64).encode(rows[0])]


def test_a_template_whose_generation_prompt_does_not_start_the_answer_is_refused(tiny):
    tokenizer = load_backbone("tiny-llama").tokenizer
    tokenizer.chat_template = TEMPLATE.replace("assistant:{% endif %}", "bot:{% endif %}")
    with pytest.raises(
        ChatDataError, match=r"row 0: the chat template's generation prompt does not begin messages\[1\]"
    ):
        ChatFormat("chat", tokenizer, 64).encode(example(ROWS[0]))


def test_the_shared_predict_loop_returns_answers_in_input_order(tiny, model):
    """`capt.recipes.evaluate.predict` (length-sorted batches) gives a generate task its answers in row order."""
    from capt.recipes.evaluate import predict

    fmt = fmt_of(tiny, max_new_tokens=4)
    features = [fmt.encode(example(fields, i)) for i, fields in enumerate(ROWS)]
    assert predict(model, fmt, features, batch_size=2) == [fmt.predict(model, fmt.collate([f]))[0] for f in features]


def test_all_turns_leaves_an_opening_assistant_greeting_as_context(tiny):
    greeting = [{"role": "assistant", "content": "welcome"}, *CONVERSATION[1:]]
    row = fmt_of(tiny, assistant_turns="all").encode(example({"messages": greeting}))
    trained = tiny.tokenizer.decode([t for t in row["labels"] if t != -100])
    assert "welcome" not in trained and "hello you" in trained and "paris" in trained
    assert "welcome" in tiny.tokenizer.decode(row["input_ids"][: row["instance_length"]])


@pytest.mark.parametrize("method", ["deep-prompt", "prompt", "lora"])
def test_other_methods_train_and_answer_generate_rows(method):
    """Models without capsules (PEFT prompt tuning, LoRA) and with extra slots take the same batches."""
    from capt.recipes.methods import apply_method

    backbone = load_backbone("tiny-llama")
    backbone.tokenizer.chat_template = TEMPLATE
    model = apply_method(backbone, method)
    fmt = ChatFormat("chat", backbone.tokenizer, 64, max_new_tokens=3)
    features = [fmt.encode(example(fields, i)) for i, fields in enumerate(ROWS)]
    loss = fmt.loss(model.train(), fmt.collate(features))
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.parameters() if p.requires_grad)
    scores = fmt.evaluate(model, features, batch_size=2)
    assert scores["loss"] == pytest.approx(loss.item(), rel=1e-4)  # no dropout in tiny-llama: eval = train
