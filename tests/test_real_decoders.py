"""CaPT on the real pretrained decoder LMs: SmolLM2-135M (Llama architecture) and Gemma-3-270M (sliding windows).

Each model is converted once (capt.recipes.gguf) and loaded once per test session; every test attaches its own
adapter and removes it again, so the frozen model is shared.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from transformers import DataCollatorWithPadding, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import capt
from capt.recipes.analysis.capture import use_eager_attention
from capt.recipes.backbones import load_backbone
from capt.recipes.data import paper_splits
from capt.recipes.formats import make_format

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
GREEDY = dict(do_sample=False, max_new_tokens=4)
PROMPTS = ["The capital of France is", "Two plus two equals four, and three plus three equals", "Hello"]


@pytest.fixture(scope="session")
def gemma():
    backbone = load_backbone("gemma3-270m")
    use_eager_attention(backbone.model)  # the sliding-window test reads attention weights
    backbone.model.eval()
    return backbone


@pytest.fixture
def capt_smollm2(smollm2):
    model = capt.get_capt_model(smollm2.model)
    _randomize(model)
    yield model
    model.unload()


def _randomize(model, std: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.capsule_vectors.copy_(torch.randn(model.capsule_vectors.shape, generator=generator) * std)


def _batch(tokenizer, side: str, prompts=PROMPTS) -> dict[str, torch.Tensor]:
    tokenizer.padding_side = side
    return tokenizer(prompts, return_tensors="pt", padding=True)


def _real_logits(model, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        logits = model(**batch).logits
    return [row[mask.bool()] for row, mask in zip(logits, batch["attention_mask"], strict=True)]


def _alone(model, tokenizer, prompts=PROMPTS) -> list[torch.Tensor]:
    return [_real_logits(model, tokenizer([p], return_tensors="pt"))[0] for p in prompts]


def test_smollm2_loads_and_answers(smollm2):
    tokenizer = smollm2.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = smollm2.model.generate(**ids, do_sample=False, max_new_tokens=10)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
    assert smollm2.model.config.num_hidden_layers == 30 and smollm2.model.config.hidden_size == 576


def test_smollm2_matches_a_layer_by_layer_reference(capt_smollm2, smollm2):
    base = smollm2.model
    ids = smollm2.tokenizer(["The capital of France is Paris"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got = capt_smollm2(input_ids=ids).logits
        with capt_smollm2.disable_adapter():  # the reference runs the bare layers
            hidden = base.model.embed_tokens(torch.cat([torch.zeros_like(ids[:, :1]), ids], dim=1))
            length = hidden.shape[1]
            positions = torch.arange(length)[None]
            rope = base.model.rotary_emb(hidden, positions)
            causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
            weights = torch.ones(1, length)
            weights[:, 0] = 0.0  # layer 1: the instance tokens only
            for i, layer in enumerate(base.model.layers):
                mean = (hidden * weights[..., None]).sum(1) / weights.sum(1, keepdim=True)
                capsule = capt_smollm2.capsule_vectors[i] + mean
                hidden = layer(
                    torch.cat([capsule[:, None], hidden[:, 1:]], dim=1),
                    attention_mask=causal,
                    position_embeddings=rope,
                    position_ids=positions,
                )
                weights = torch.ones(1, length)  # later layers: the slot's own output too
            expected = base.lm_head(base.model.norm(hidden)[:, 1:])
    assert (got - expected).abs().max() < 3e-4  # float32 on logits of size ~20: about 1e-5 relative


@pytest.mark.parametrize("side", ["left", "right"])
def test_smollm2_forward_does_not_depend_on_padding(capt_smollm2, smollm2, side):
    alone = _alone(capt_smollm2, smollm2.tokenizer)
    together = _real_logits(capt_smollm2, _batch(smollm2.tokenizer, side))
    for a, t in zip(alone, together, strict=True):
        assert (a - t).abs().max() < 1e-3


def test_smollm2_collator_and_explicit_positions_are_padding_invariant(capt_smollm2, smollm2):
    tokenizer = smollm2.tokenizer
    tokenizer.padding_side = "left"
    collated = DataCollatorWithPadding(tokenizer)([tokenizer(p) for p in PROMPTS])
    alone = _alone(capt_smollm2, tokenizer)
    for a, t in zip(alone, _real_logits(capt_smollm2, dict(collated)), strict=True):
        assert (a - t).abs().max() < 1e-3
    # Positions the caller gives are used as given (shifted past the slot).
    mask = collated["attention_mask"]
    explicit = dict(collated, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for a, t in zip(alone, _real_logits(capt_smollm2, explicit), strict=True):
        assert (a - t).abs().max() < 1e-3


def test_smollm2_generate_left_padded_cached_and_uncached_agree(capt_smollm2, smollm2):
    tokenizer = smollm2.tokenizer
    batch = _batch(tokenizer, "left")
    width = batch["input_ids"].shape[1]
    cached = capt_smollm2.generate(**batch, **GREEDY, pad_token_id=tokenizer.pad_token_id)
    uncached = capt_smollm2.generate(**batch, **GREEDY, use_cache=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(cached, uncached)
    for row, prompt in enumerate(PROMPTS):
        single = tokenizer([prompt], return_tensors="pt")
        new = capt_smollm2.generate(**single, **GREEDY)[0, single["input_ids"].shape[1] :]
        together = cached[row, width:]
        assert torch.equal(together[: len(new)], new)  # a row that stopped early is padded after its end
        assert (together[len(new) :] == tokenizer.pad_token_id).all()


def test_smollm2_layers_called_after_a_pass_see_no_stale_slot(capt_smollm2, smollm2):
    layer, base = smollm2.model.model.layers[3], smollm2.model
    ids = smollm2.tokenizer(["Hello there"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        capt_smollm2(input_ids=ids)  # leaves nothing behind
        hidden = torch.randn(1, ids.shape[1] + 1, 576)
        positions = torch.arange(hidden.shape[1])[None]
        kwargs = dict(position_embeddings=base.model.rotary_emb(hidden, positions), position_ids=positions)
        direct = layer(hidden, **kwargs)
        with capt_smollm2.disable_adapter():
            bare = layer(hidden, **kwargs)
    assert torch.equal(direct, bare)


def test_a_peft_saved_smollm2_adapter_is_refused_by_other_models(smollm2, tmp_path):
    wrapped = peft.get_peft_model(smollm2.model, capt.CaptConfig(task_type="CAUSAL_LM"))
    wrapped.save_pretrained(tmp_path / "adapter")
    wrapped.unload()
    shape = dict(vocab_size=128, num_attention_heads=8)
    others = [
        GPT2LMHeadModel(GPT2Config(n_embd=576, n_layer=30, n_head=8, vocab_size=128)),
        LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=12, **shape)),
    ]
    for other in others:
        with pytest.raises(ValueError, match="made for another model"):
            peft.PeftModel.from_pretrained(other, tmp_path / "adapter")
        assert not getattr(other, "_capt_attached", False)
        with pytest.raises(ValueError, match="made for another model"):
            capt.CaptModel.from_pretrained(other, tmp_path / "adapter")
    reloaded = capt.CaptModel.from_pretrained(smollm2.model, tmp_path / "adapter")  # the right model loads it
    reloaded.unload()


def test_gemma_forward_is_padding_invariant_and_survives_save_and_load(gemma, tmp_path):
    model = capt.get_capt_model(gemma.model)
    _randomize(model, std=0.5)
    try:
        alone = _alone(model, gemma.tokenizer)
        for side in ("left", "right"):
            for a, t in zip(alone, _real_logits(model, _batch(gemma.tokenizer, side)), strict=True):
                assert (a - t).abs().max() < 2e-3, side
        model.save_pretrained(tmp_path / "gemma")
    finally:
        model.unload()
    reloaded = capt.CaptModel.from_pretrained(gemma.model, tmp_path / "gemma")
    try:
        assert torch.allclose(_alone(reloaded, gemma.tokenizer)[0], alone[0], atol=1e-5)
    finally:
        reloaded.unload()


def test_gemma_beyond_the_sliding_window_cache_matches_and_only_full_layers_see_the_slot(gemma):
    config = gemma.model.config
    window = config.sliding_window
    model = capt.get_capt_model(gemma.model)
    _randomize(model, std=0.5)
    try:
        ids = torch.randint(100, 2000, (1, window + 40), generator=torch.Generator().manual_seed(0))
        ids[:, 0] = gemma.tokenizer.bos_token_id
        cached = model.generate(input_ids=ids, do_sample=False, max_new_tokens=2)
        uncached = model.generate(input_ids=ids, do_sample=False, max_new_tokens=2, use_cache=False)
        assert torch.equal(cached, uncached)

        seen = {}
        sliding = config.layer_types.index("sliding_attention")
        full = config.layer_types.index("full_attention")
        hooks = [
            gemma.model.model.layers[i].self_attn.register_forward_hook(
                lambda m, a, out, i=i: seen.__setitem__(i, out[1][0, :, -1, 0].max().item())
            )
            for i in (sliding, full)
        ]
        try:
            with torch.no_grad():
                model(input_ids=ids)
        finally:
            for hook in hooks:
                hook.remove()
        # The last query is window + 40 positions past the slot: a sliding layer cannot see it, a full layer can.
        assert seen[sliding] == 0.0 and seen[full] > 0.0
    finally:
        model.unload()


@pytest.mark.parametrize("name", ["smollm2", "gemma"])
def test_option_scores_from_one_prompt_pass_equal_one_pass_per_option(name, request):
    """The scoring shortcut on real weights: Llama's grouped-query attention, Gemma's sliding-window cache layers."""
    backbone = request.getfixturevalue(name)
    model = capt.get_capt_model(backbone.model)
    try:
        _randomize(model)
        fmt = make_format("decoder", "copa", backbone.tokenizer, 32)
        batch = fmt.collate([fmt.encode(ex) for ex in paper_splits("copa", DATA)["train"][:3]])
        inputs = batch["score_inputs"]
        with torch.no_grad():
            one_pass = fmt.scores_from_prompt_pass(model, inputs, batch["options"])
            per_row = fmt.row_scores(model, inputs)
    finally:
        model.unload()
    assert len(set((inputs["labels"] != -100).sum(-1).tolist())) > 1  # options of different lengths
    torch.testing.assert_close(one_pass, per_row, atol=1e-4, rtol=0)
