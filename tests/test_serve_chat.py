"""`capt serve`'s /v1/chat/completions: a real server on loopback, driven by the `openai` client."""

from __future__ import annotations

import pytest
import torch
from test_chat import TEMPLATE
from test_serve import Server, save_adapter, sharpen

from capt.recipes.chat import prompt_ids
from capt.recipes.serve import Limits, build_engine

openai = pytest.importorskip("openai")

MESSAGES = [
    {"role": "system", "content": "answer in one word"},
    {"role": "user", "content": "what colour is the sky?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    engine = build_engine("tiny-llama", {"chat": save_adapter(root / "chat", 0), "other": save_adapter(root / "o", 1)})
    engine.tokenizer.chat_template = TEMPLATE
    sharpen(engine)
    running = Server(engine)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def greedy(engine, name: str, messages, max_tokens: int) -> tuple[str, int]:
    """What `generate` writes for the chat prompt, as training and evaluation encode it: (text, tokens)."""
    ids = torch.tensor([prompt_ids(engine.tokenizer, messages)])
    with engine.lock, torch.no_grad():
        if name == "base":
            with engine.bank.disable_adapter():
                out = engine.bank.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False)
        else:
            out = engine.bank.generate(input_ids=ids, adapter_names=[name], max_new_tokens=max_tokens, do_sample=False)
    tokens = out[0, ids.shape[1] :].tolist()
    if engine.bank.config.eos_token_id in tokens:
        tokens = tokens[: tokens.index(engine.bank.config.eos_token_id)]
    return engine.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def test_chat_completion_is_the_greedy_answer_to_the_chat_template_prompt(server, client):
    for name in ("chat", "other", "base"):
        answer = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8, temperature=0)
        text, tokens = greedy(server.engine, name, MESSAGES, 8)
        assert answer.object == "chat.completion" and answer.model == name
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].message.content == text
        assert answer.choices[0].finish_reason == ("length" if tokens == 8 else "stop")
        assert answer.usage.prompt_tokens == len(prompt_ids(server.engine.tokenizer, MESSAGES))
        assert answer.usage.completion_tokens == tokens
    texts = {
        name: client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
        for name in ("chat", "other")
    }
    assert texts["chat"] != texts["other"]  # each adapter's own capsules answer


def test_streamed_chat_sends_the_role_then_the_same_text_then_the_finish(client):
    whole = client.chat.completions.create(model="chat", messages=MESSAGES, max_completion_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=MESSAGES, max_completion_tokens=10, temperature=0, stream=True
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_conversation_with_earlier_answers_is_written_by_the_template(server, client):
    messages = [*MESSAGES, {"role": "assistant", "content": "blue"}, {"role": "user", "content": "and grass?"}]
    answer = client.chat.completions.create(model="chat", messages=messages, max_tokens=6, temperature=0)
    assert answer.choices[0].message.content == greedy(server.engine, "chat", messages, 6)[0]


def test_bad_chat_requests_get_clear_errors(server, client):
    post = server.client.post
    bad_role = post("/v1/chat/completions", json={"model": "chat", "messages": [{"role": "robot", "content": "x"}]})
    assert bad_role.status_code == 422 and "role" in bad_role.json()["error"]["message"]
    empty = post("/v1/chat/completions", json={"model": "chat", "messages": []})
    assert empty.status_code == 422
    with pytest.raises(openai.NotFoundError, match="neither 'base' nor a loaded adapter"):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="max_tokens: at most"):
        client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=Limits().max_tokens + 1)
    template = server.engine.tokenizer.chat_template
    server.engine.tokenizer.chat_template = None
    try:
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            client.chat.completions.create(model="chat", messages=MESSAGES)
    finally:
        server.engine.tokenizer.chat_template = template
