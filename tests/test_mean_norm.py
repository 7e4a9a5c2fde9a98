"""CaptConfig.mean_norm="rms": each instance token RMS-normalised before the masked mean (issue 39)."""

import json
from pathlib import Path

import peft
import pytest
import torch
from conftest import TINY, build, randomize_capsules
from transformers import LlamaForCausalLM

import capt
from capt.recipes.backbones import load_backbone, random_config
from capt.recipes.methods import apply_method, capt_config, method_revision
from capt.recipes.settings import MethodOptions

EPS = 1e-3  # far from the 1e-6 fallback, so a capsule that ignored the backbone's eps would not match


def _llama(eps: float = EPS) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(random_config("llama", layers=3, pad_token_id=0, rms_norm_eps=eps, **TINY)).eval()


def _rms_model(eps: float = EPS):
    model = capt.get_capt_model(_llama(eps), capt.CaptConfig(mean_norm="rms"))
    randomize_capsules(model)
    return model


def _reference_mean(hidden, instance, eps):
    """Token by token: x / sqrt(mean(x^2) + eps), averaged over the instance tokens."""
    rows = []
    for b in range(hidden.shape[0]):
        tokens = [hidden[b, t] / torch.sqrt((hidden[b, t] ** 2).mean() + eps) for t in range(hidden.shape[1])]
        chosen = [token for token, keep in zip(tokens, instance[b].tolist(), strict=True) if keep]
        rows.append(torch.stack(chosen).mean(0))
    return torch.stack(rows)


def _layer_by_layer(model, ids, instance, eps):
    """The whole model run by hand, slot at row 0; layer i's slot is p_i + the normalised mean of its input."""
    base = model.base_model
    length = ids.shape[1] + 1
    slot_instance = torch.cat([torch.zeros(ids.shape[0], 1, dtype=torch.long), instance], dim=1)
    with torch.no_grad(), model.disable_adapter():
        hidden = base.model.embed_tokens(torch.cat([torch.zeros(ids.shape[0], 1, dtype=torch.long), ids], dim=1))
        positions = torch.arange(length)[None]
        rope = base.model.rotary_emb(hidden, positions)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        for i, layer in enumerate(base.model.layers):
            # Layer 0 reads the embeddings (the slot's own row is not an instance token); later layers also read
            # the slot row the previous layer wrote, as the paper's [S'_{i-1}; H_{i-1}].
            weights = slot_instance.clone()
            if i > 0:
                weights[:, 0] = 1
            capsule = model.capsule_vectors[i] + _reference_mean(hidden, weights, eps)
            hidden = layer(
                torch.cat([capsule[:, None], hidden[:, 1:]], dim=1),
                attention_mask=causal,
                position_embeddings=rope,
                position_ids=positions,
            )
        return base.lm_head(base.model.norm(hidden)[:, 1:])


def test_llama_with_the_normalised_mean_matches_a_token_by_token_reference():
    model = _rms_model()
    ids = torch.tensor([[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]])
    instance = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0]])  # the mean must skip the excluded tokens
    with torch.no_grad():
        got = model(input_ids=ids, instance_mask=instance).logits
    assert torch.allclose(got, _layer_by_layer(model, ids, instance, EPS), atol=1e-5)
    # The eps is the backbone's own: the 1e-6 fallback gives another capsule on this model.
    assert model.capsules.norm_eps == EPS
    assert not torch.allclose(got, _layer_by_layer(model, ids, instance, 1e-6), atol=1e-5)
    # And the option does something: the plain mean gives other logits.
    plain = capt.get_capt_model(_llama())
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(input_ids=ids, instance_mask=instance).logits, got, atol=1e-3)


def test_a_model_without_rms_norm_eps_falls_back_to_1e_6():
    model = capt.get_capt_model(build("bert-cls"), capt.CaptConfig(mean_norm="rms"))
    assert model.capsules.norm_eps == 1e-6


@pytest.mark.parametrize("side", ["left", "right"])
def test_each_row_of_a_padded_batch_equals_the_row_alone(side):
    """Garbage token ids under the padding: had a padding token entered the normalised mean, a row would move."""
    model = _rms_model()
    generator = torch.Generator().manual_seed(3)
    lengths = [3, 7, 5]
    width = max(lengths)
    ids = torch.randint(3, 100, (len(lengths), width), generator=generator)
    real = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    if side == "left":
        real = real.flip(-1)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=real.long()).logits
        for row in range(len(lengths)):
            alone = model(input_ids=ids[row][real[row]][None]).logits[0]
            assert torch.allclose(batch[row][real[row]], alone, atol=1e-5)


def test_cached_generation_equals_uncached_and_keeps_generated_tokens_out_of_the_mean():
    model = _rms_model()
    prompt = torch.tensor([[0, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])  # the first prompt left-padded
    greedy = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    cached = model.generate(input_ids=prompt, use_cache=True, **greedy)
    assert torch.equal(cached, model.generate(input_ids=prompt, use_cache=False, **greedy))
    # Each step equals a full forward whose mean covers the prompt only.
    ids = cached[1:, :-1]
    prompt_only = torch.zeros_like(ids)
    prompt_only[:, : prompt.shape[1]] = 1
    with torch.no_grad():
        next_token = model(input_ids=ids, instance_mask=prompt_only).logits[:, -1].argmax(-1)
    assert next_token.item() == cached[1, -1].item()


def test_a_saved_adapter_keeps_the_option_and_an_old_config_without_it_loads_as_none(tmp_path):
    model = _rms_model()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "rms")
    saved = json.loads((tmp_path / "rms" / "adapter_config.json").read_text())
    assert saved["mean_norm"] == "rms"
    loaded = capt.CaptModel.from_pretrained(_llama(), tmp_path / "rms")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)
    via_peft = peft.PeftModel.from_pretrained(_llama(), tmp_path / "rms")
    with torch.no_grad():
        assert torch.allclose(via_peft(input_ids=ids).logits, expected, atol=1e-6)

    # An adapter saved before the option existed: its config has no mean_norm, and it is the plain mean.
    del saved["mean_norm"]
    (tmp_path / "rms" / "adapter_config.json").write_text(json.dumps(saved))
    old = capt.CaptModel.from_pretrained(_llama(), tmp_path / "rms")
    assert capt.CaptConfig.from_pretrained(tmp_path / "rms").mean_norm == "none"
    plain = capt.get_capt_model(_llama())
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(old(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert not torch.allclose(old(input_ids=ids).logits, expected, atol=1e-3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mean_norm": "l2"}, "CaptConfig.mean_norm must be one of ['none', 'rms'], got 'l2'"),
        ({"mean_norm": "rms", "instance_aware": False}, "needs instance_aware=True"),
        ({"mean_norm": "rms", "prompt_method": "dept"}, "needs instance_aware=True and no prompt_method"),
    ],
)
def test_a_bad_mean_norm_is_one_clear_error(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        capt.CaptConfig(**changes)


def test_plain_capt_keeps_the_plain_mean_so_its_finished_runs_read_back():
    """The guard of METHOD_REVISIONS: the study's finished `capt` runs (revision 1) used the plain mean. Should
    `capt` ever default to the normalised mean, it would be another method: bump METHOD_REVISIONS["capt"]."""
    assert capt_config("capt", MethodOptions()).mean_norm == "none" and method_revision("capt") == 1
    assert capt.CaptConfig().mean_norm == "none"
    assert capt_config("capt-rms", MethodOptions()).mean_norm == "rms" and method_revision("capt-rms") == 1


def test_the_recipes_train_capt_rms_as_its_own_method():
    rms = apply_method(load_backbone("tiny-llama"), "capt-rms")
    plain = apply_method(load_backbone("tiny-llama"), "capt")
    assert rms.capsules.config.mean_norm == "rms" and plain.capsules.config.mean_norm == "none"
    assert rms.get_nb_trainable_parameters() == plain.get_nb_trainable_parameters()  # parameter-free


def test_method_gaps_reads_the_committed_study_as_sweep_md_prints_it():
    """CaPT's gap to Prompt Tuning on CB is sweep.md's Prompt Tuning row (+8.5, p 0.21) turned round."""
    from capt.recipes.analysis.method_gaps import gaps_table

    study = Path(__file__).resolve().parents[1] / "results" / "smollm2-study"
    table = gaps_table(study, "capt", ["cb", "copa", "rte", "wic"])
    assert "| cb | 45.0 ± 8.2 (0.09) | prompt | 53.5 ± 4.6 | -8.5 (p 0.21) |" in table
    assert "Average over cb, copa, rte, wic: capt 54.2; " in table and "prompt 57.0" in table


def test_capsule_norms_measures_both_means_layer_by_layer():
    from capt.recipes.analysis.capsule_norms import measure

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "superglue"
    results = measure("tiny-llama", "cb", 2, str(data), 64)
    hidden = load_backbone("tiny-llama").model.config.hidden_size
    assert set(results) == {"none", "rms"} and len(results["rms"]) == len(results["none"]) >= 2
    # A mean of unit-RMS tokens has norm at most sqrt(d); the plain one is not bounded so.
    assert all(0 < row["capsule"] <= hidden**0.5 + 1e-4 for row in results["rms"])
    assert all(row["first"] > 0 and row["median_other"] > 0 for row in results["none"])
