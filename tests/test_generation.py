"""Generation: KV cache equivalence, the prompt-only capsule, and left padding."""

import pytest
import torch
from conftest import build, randomize_capsules

import capt

GREEDY = dict(do_sample=False, pad_token_id=0)


def _manual_greedy(model, prompt, steps):
    """Full forwards without a cache; the instance mask covers the prompt only."""
    ids = prompt
    for _ in range(steps):
        instance = torch.zeros_like(ids)
        instance[:, : prompt.shape[1]] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, instance_mask=instance).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_cached_generation_equals_uncached_and_a_manual_loop(name):
    model = capt.get_capt_model(build(name))
    randomize_capsules(model)
    prompt = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    cached = model.generate(input_ids=prompt, max_new_tokens=6, use_cache=True, **GREEDY)
    uncached = model.generate(input_ids=prompt, max_new_tokens=6, use_cache=False, **GREEDY)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, _manual_greedy(model, prompt, 6))


def test_generated_tokens_never_enter_the_capsule_mean():
    """Each step's scores equal a full forward whose instance mask covers the prompt only, and differ
    from one whose mean also covers the generated tokens."""
    model = capt.get_capt_model(build("llama"))
    randomize_capsules(model, std=2.0)
    prompt = torch.tensor([[11, 12, 13, 14, 15]])
    out = model.generate(input_ids=prompt, max_new_tokens=6, output_scores=True, return_dict_in_generate=True, **GREEDY)
    for step in range(1, 6):
        ids = out.sequences[:, : prompt.shape[1] + step]
        prompt_only = torch.zeros_like(ids)
        prompt_only[:, : prompt.shape[1]] = 1
        with torch.no_grad():
            right = model(input_ids=ids, instance_mask=prompt_only).logits[:, -1]
            leaky = model(input_ids=ids).logits[:, -1]
        assert torch.allclose(out.scores[step], right, atol=1e-5)
        assert not torch.allclose(out.scores[step], leaky, atol=1e-3)


def test_t5_generation_with_and_without_cache():
    model = capt.get_capt_model(build("t5"))
    randomize_capsules(model)
    source = torch.tensor([[11, 12, 13, 14, 1], [21, 22, 23, 24, 1]])
    cached = model.generate(input_ids=source, max_new_tokens=5, use_cache=True, **GREEDY)
    uncached = model.generate(input_ids=source, max_new_tokens=5, use_cache=False, **GREEDY)
    assert torch.equal(cached, uncached)
    # Manual decoding: the encoder capsule sees the whole source at every step.
    decoder = torch.zeros(2, 1, dtype=torch.long)
    for _ in range(5):
        with torch.no_grad():
            logits = model(input_ids=source, decoder_input_ids=decoder).logits
        decoder = torch.cat([decoder, logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(cached, decoder)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(name):
    model = capt.get_capt_model(build(name))
    randomize_capsules(model)
    short, long = torch.tensor([[31, 32, 33]]), torch.tensor([[41, 42, 43, 44, 45, 46]])
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    together = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=5, **GREEDY)
    alone_short = model.generate(input_ids=short, max_new_tokens=5, **GREEDY)
    alone_long = model.generate(input_ids=long, max_new_tokens=5, **GREEDY)
    assert torch.equal(together[0, 3:], alone_short[0])
    assert torch.equal(together[1], alone_long[0])


def test_beam_search_and_several_return_sequences_work():
    model = capt.get_capt_model(build("llama"))
    randomize_capsules(model)
    prompt = torch.tensor([[11, 12, 13], [21, 22, 23]])
    out = model.generate(input_ids=prompt, max_new_tokens=3, num_beams=3, num_return_sequences=2, **GREEDY)
    assert out.shape == (4, 6)
    assert torch.equal(out[:, :3], prompt.repeat_interleave(2, 0))


def test_t5_decoder_capsules_generate_consistently():
    model = capt.get_capt_model(build("t5"), capt.CaptConfig(target="both"))
    randomize_capsules(model)
    assert model.capsule_vectors.shape == (4, 32)
    source = torch.tensor([[11, 12, 13, 14, 1]])
    cached = model.generate(input_ids=source, max_new_tokens=4, use_cache=True, **GREEDY)
    uncached = model.generate(input_ids=source, max_new_tokens=4, use_cache=False, **GREEDY)
    assert torch.equal(cached, uncached)
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=cached[:, :-1]).logits
    assert torch.equal(logits.argmax(-1), cached[:, 1:])
