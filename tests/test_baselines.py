"""The paper's other baselines: DePT, LoPA, IDPG / M-IDPG, SMoP, Residual Prompt Tuning on the slot machinery, and
bottleneck adapters on module hooks. Each is checked against an independent computation on a tiny model."""

from __future__ import annotations

import pytest
import torch
from conftest import batch_inputs, build

import capt
from capt.baselines.adapter import BottleneckAdapter
from capt.baselines.options import AdapterOptions, make_options
from capt.baselines.residual import fold_residual_prompt
from capt.recipes.backbones import Backbone
from capt.recipes.methods import PROMPT_METHODS, MethodOptions, apply_method, capt_config

# Small settings: the tiny BERT has 64 positions, and short prompts keep the tests quick.
SMALL = {
    "dept": {"length": 4, "rank": 3, "positions": 16},
    "lopa": {"length": 4, "rank": 2, "encoder_hidden": 8},
    "idpg": {"length": 3, "bottleneck": 8},
    "m-idpg": {"length": 3, "bottleneck": 8},
    "smop": {"num_prompts": 3, "length": 2},
    "residual": {"length": 4, "bottleneck": 8},
    "vfpt": {"length": 5, "fourier_fraction": 0.5},  # 2 Fourier prompts (rounded down), 3 plain
}
FAMILIES = ("llama", "t5", "bert-cls")


def _model(family: str, method: str, seed: int = 1, options: dict | None = None):
    config = capt.CaptConfig(prompt_method=method, prompt_options=options or SMALL[method])
    model = capt.get_capt_model(build(family), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero everywhere (DePT's B and the adapters' up start at zero)
        for param in model.capsules.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()  # SMoP perturbs its router in training mode


def _reference_prompt(module, method: str, embeds: torch.Tensor, mask: torch.Tensor, layer: int = 0):
    """The prompt each paper defines, computed from the module's parameters with plain tensor operations."""
    o = module.options
    pooled = (embeds * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # sentence representation
    if method == "dept":
        return module.prompt.expand(len(embeds), -1, -1)
    if method == "lopa":

        def head(h):  # d -> width (tanh) -> out, one per factor
            return torch.tanh(pooled @ h[0].weight.T + h[0].bias) @ h[2].weight.T + h[2].bias

        u = head(module.u).view(-1, o.length, o.rank)
        v = head(module.v).view(-1, o.rank, embeds.shape[-1])
        return module.shared * torch.sigmoid(torch.einsum("bmr,brd->bmd", u, v))
    if method in ("idpg", "m-idpg"):  # one generator, a bias per prompted layer (the authors' `layerb`)
        h = torch.nn.functional.gelu(pooled @ _matrix(module.down) + module.down.bias)
        bias = module.layer_bias[layer if o.every_layer else 0]
        return (h @ _matrix(module.up)).view(len(embeds), o.length, -1) + bias
    if method == "smop":
        probs = torch.softmax(pooled @ module.router.weight.T, -1)  # the router has no bias
        k = probs.argmax(-1)
        return torch.stack([module.prompts[k[b]] * probs[b, k[b]] for b in range(len(embeds))])
    if method == "residual":
        lin1, lin2, norm = module.mlp[0], module.mlp[2], module.mlp[3]
        z = torch.relu(module.prompt @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias
        z = (z - z.mean(-1, keepdim=True)) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + norm.eps)
        return (module.prompt + z * norm.weight + norm.bias).expand(len(embeds), -1, -1)
    if method == "vfpt":  # the k Fourier prompts through explicit DFT matrices: Re(F_k P F_d)
        table = module.prompts[layer if o.every_layer else 0].double()
        k = int(o.length * o.fourier_fraction)
        fourier = (_dft(k) @ table[:k].to(torch.complex128) @ _dft(table.shape[-1])).real
        return torch.cat([fourier, table[k:]]).float().expand(len(embeds), -1, -1)
    raise AssertionError(method)


def _dft(n: int) -> torch.Tensor:
    """The n x n DFT matrix, exp(-2 pi i j l / n)."""
    j = torch.arange(n, dtype=torch.float64)
    return torch.exp(-2j * torch.pi * torch.outer(j, j) / n)


def _matrix(linear) -> torch.Tensor:
    """The (in, out) matrix of a generator layer: a PHM layer's sum of Kronecker products, or a Linear's W^T."""
    if hasattr(linear, "rules"):
        return sum(torch.kron(rule, factor) for rule, factor in zip(linear.rules, linear.factors, strict=True))
    return linear.weight.T


def _layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _dept_offsets(module, length: int) -> torch.Tensor:
    update = module.options.alpha / module.options.rank**0.5 * (module.secondary["a"] @ module.secondary["b"])
    rows = torch.zeros(length, update.shape[-1])
    rows[: min(length, len(update))] = update[:length]
    return rows


EVERY_LAYER_METHODS = ("m-idpg", "vfpt")
INPUT_LAYER_CASES = [(m, None) for m in PROMPT_METHODS if m not in EVERY_LAYER_METHODS] + [
    ("idpg", {"length": 3, "phm": 4}),
    ("vfpt", {**SMALL["vfpt"], "every_layer": False}),  # VFPT on VPT-shallow
]


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("method, options", INPUT_LAYER_CASES)
def test_input_layer_prompt_equals_prepending_it_to_the_embeddings(family, method, options):
    """An input-layer method is the base model run on [prompt(x) ; E (+ DePT's update)] as inputs_embeds. The PHM
    generator of IDPG is checked against torch.kron sums."""
    model = _model(family, method, options=options)
    inputs = batch_inputs(family, length=20)
    with torch.no_grad():
        ours = model(**inputs).logits
        base = model.base_model
        embeds = base.get_input_embeddings()(inputs["input_ids"])
        prompt = _reference_prompt(model.capsules, method, embeds, inputs["attention_mask"].float())
        if method == "dept":
            embeds = embeds + _dept_offsets(model.capsules, embeds.shape[1])
        full = torch.cat([prompt, embeds], 1)
        mask = torch.cat([torch.ones(len(full), prompt.shape[1], dtype=torch.long), inputs["attention_mask"]], 1)
        with model.disable_adapter():
            if family == "t5":
                reference = base(inputs_embeds=full, attention_mask=mask, labels=inputs["labels"]).logits
            else:
                reference = base(inputs_embeds=full, attention_mask=mask).logits[:, prompt.shape[1] :]
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", EVERY_LAYER_METHODS)
def test_every_layer_methods_write_each_layers_own_prompt(method):
    """M-IDPG: the slots at the input of layer i are layer i's generated prompt of the same s(x) (from layer 0).
    VFPT: layer i's table, its first k rows through the 2D DFT."""
    model = _model("llama", method)
    inputs = batch_inputs("llama", length=7)
    seen = {}
    layers = model.base_model.model.layers
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, a, k, i=i: seen.__setitem__(i, _layer_input(a, k).clone()), with_kwargs=True
        )
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        model(**inputs)
        embeds = model.base_model.get_input_embeddings()(inputs["input_ids"])
        slots = model.capsules.options.length
        for i in range(len(layers)):
            expected = _reference_prompt(model.capsules, method, embeds, inputs["attention_mask"].float(), i)
            torch.testing.assert_close(seen[i][:, :slots], expected, atol=1e-5, rtol=1e-4)
    for hook in hooks:
        hook.remove()
    assert model.injector.every_layer


def test_vfpt_without_fourier_prompts_is_deep_prompt_tuning():
    """fourier_fraction 0 leaves plain per-layer prompts: the same logits as Deep Prompt-Tuning with that table."""
    inputs = batch_inputs("llama", length=6)
    vfpt = _model("llama", "vfpt", options={"length": 4, "fourier_fraction": 0.0})
    deep = capt.get_capt_model(build("llama"), capt.CaptConfig(num_slots=4, instance_aware=False))
    with torch.no_grad():
        deep.capsule_vectors.copy_(vfpt.capsules.prompts.reshape(deep.capsule_vectors.shape))
        torch.testing.assert_close(vfpt(**inputs).logits, deep.eval()(**inputs).logits)
        assert make_options("vfpt", {"length": 10, "fourier_fraction": 0.29}).fourier_tokens == 2  # rounded down


def test_input_layer_methods_let_the_prompt_flow_through():
    """Layer 1 receives layer 0's output at the prompt positions: nothing overwrites them after the input layer."""
    model = _model("llama", "idpg")
    layers = model.base_model.model.layers
    seen = {}
    out = layers[0].register_forward_hook(lambda m, a, o: seen.__setitem__("out", o[0] if isinstance(o, tuple) else o))
    into = layers[1].register_forward_pre_hook(
        lambda m, a, k: seen.__setitem__("in", _layer_input(a, k)), with_kwargs=True
    )
    with torch.no_grad():
        model(**batch_inputs("llama"))
    out.remove(), into.remove()
    assert not model.injector.every_layer
    torch.testing.assert_close(seen["in"], seen["out"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", PROMPT_METHODS)
def test_padding_does_not_change_results(family, method):
    model = _model(family, method)
    inputs = batch_inputs(family, batch=2, length=9)
    inputs["attention_mask"][1, 6:] = 0
    alone = {k: v[1:2, :6] if k != "labels" else v[1:2] for k, v in inputs.items()}
    with torch.no_grad():
        batched = model(**inputs).logits[1]
        single = model(**alone).logits[0]
    rows = slice(None) if family != "llama" else slice(0, 6)
    torch.testing.assert_close(batched[rows], single, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", PROMPT_METHODS)
def test_save_and_load_round_trip(method, tmp_adapter):
    model = _model("bert-cls", method)
    inputs = batch_inputs("bert-cls")
    with torch.no_grad():
        before = model(**inputs).logits
    model.save_pretrained(tmp_adapter)
    loaded = capt.CaptModel.from_pretrained(build("bert-cls"), tmp_adapter)
    assert loaded.capt_config.prompt_method == method
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, before)


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("method", PROMPT_METHODS)
def test_generate_with_cache_equals_without(family, method):
    model = _model(family, method)
    ids = batch_inputs(family, batch=2, length=5)["input_ids"]
    mask = torch.ones_like(ids)
    if family == "llama":
        mask[0, :2] = 0  # left padding
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    cached = model.generate(**kwargs, use_cache=True)
    uncached = model.generate(**kwargs, use_cache=False)
    assert cached.shape == (2, 9) if family == "llama" else cached.shape[0] == 2
    assert torch.equal(cached, uncached)


def test_smop_routes_top1_and_perturbs_the_router_in_training_only():
    model = _model("llama", "smop")
    inputs = batch_inputs("llama", batch=4)
    with torch.no_grad():
        evaluated = [model(**inputs).logits for _ in range(2)]
        torch.testing.assert_close(evaluated[0], evaluated[1])
        model.train()
        torch.manual_seed(0)
        trained = [model(**inputs).logits for _ in range(4)]
    assert any(not torch.allclose(trained[0], t) for t in trained[1:])


def test_smop_load_balancing_loss_equals_the_authors_formula():
    """0.01 * k * sum_j mean_b(p_bj) * f_j, f_j the share of the batch routed to prompt j (noise off to compare)."""
    model = capt.get_capt_model(
        build("llama"), capt.CaptConfig(prompt_method="smop", prompt_options={**SMALL["smop"], "noise_std": 0.0})
    )
    module = model.capsules
    with torch.no_grad():
        module.router.weight.normal_(generator=torch.Generator().manual_seed(3))
    inputs = batch_inputs("llama", batch=6)
    inputs["attention_mask"][2, 5:] = 0
    model.eval()(**inputs)
    assert model.auxiliary_loss() is None  # evaluation mode: no balancing loss
    model.train()
    model(**inputs)
    embeds = model.base_model.get_input_embeddings()(inputs["input_ids"])
    mask = inputs["attention_mask"].float()
    pooled = (embeds * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    probs = torch.softmax(pooled @ module.router.weight.T, -1)
    share = [(probs.argmax(-1) == j).float().mean() for j in range(3)]
    expected = 0.01 * 3 * sum(probs[:, j].mean() * share[j] for j in range(3))
    torch.testing.assert_close(model.auxiliary_loss(), expected)
    model.auxiliary_loss().backward()
    assert module.router.weight.grad.abs().sum() > 0  # it trains the router
    model.eval()
    assert model.auxiliary_loss() is None  # the last training pass's loss is not an evaluation's
    off = capt.get_capt_model(
        build("llama"), capt.CaptConfig(prompt_method="smop", prompt_options={"balance_weight": 0})
    )
    off.train()(**inputs)
    assert off.auxiliary_loss() is None


def test_training_adds_the_methods_auxiliary_loss():
    """The recipe's training loss is the task loss plus `auxiliary_loss()` (SMoP); methods without one get none."""
    from capt.recipes.backbones import load_backbone
    from capt.recipes.data import Example
    from capt.recipes.formats import make_format
    from capt.recipes.train import training_loss

    examples = [Example("rte", i, {"premise": f"a b {i}", "hypothesis": "c d"}, i % 2) for i in range(4)]
    for method, has_auxiliary in (("smop", True), ("idpg", False)):
        backbone = load_backbone("tiny-llama")
        fmt = make_format(backbone.family, "rte", backbone.tokenizer, 64)
        batch = fmt.collate([fmt.encode(ex) for ex in examples])
        model = apply_method(backbone, method).train()
        torch.manual_seed(0)
        total, auxiliary = training_loss(fmt, model, batch)
        torch.manual_seed(0)  # the same router noise again
        task = fmt.loss(model, batch)
        assert (auxiliary is not None) == has_auxiliary
        torch.testing.assert_close(total, task + model.auxiliary_loss() if has_auxiliary else task)
        if has_auxiliary:
            assert auxiliary.item() > 0


def test_capt_train_logs_and_trains_on_the_auxiliary_loss(tmp_path, monkeypatch):
    """`capt train --method smop`: every step's logged loss includes the balancing loss, logged beside it."""
    import json
    from pathlib import Path

    from capt.recipes.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))  # the tokenisation cache lives under ~/.cache/capt
    data = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "superglue"
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny-llama", "--task", "cb", "--method", "smop", "--epochs", "1", "--batch-size", "8"]
    argv += ["--limit-train", "16", "--limit-eval", "8", "--data-dir", str(data), "--output-dir", str(out)]
    assert main(argv) == 0
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert steps and all(0 < r["auxiliary_loss"] < r["loss"] for r in steps)


def test_residual_prompt_folds_into_plain_prompts(tmp_adapter):
    model = _model("llama", "residual")
    inputs = batch_inputs("llama")
    with torch.no_grad():
        before = model(**inputs).logits
    fold_residual_prompt(model)
    assert model.capsules.mlp is None
    assert model.get_nb_trainable_parameters()[0] == 4 * 32  # only the m x d prompt is left
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, atol=1e-6, rtol=1e-5)
    model.save_pretrained(tmp_adapter)
    loaded = capt.CaptModel.from_pretrained(build("llama"), tmp_adapter)
    assert loaded.capt_config.prompt_options["reparameterize"] is False
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, before, atol=1e-6, rtol=1e-5)


# The paper defaults and the parameter-count formulas at real sizes, on the meta device (no weights).
REAL = {"minilm": (6, 384), "smollm2-135m": (30, 576), "t5-base": (12, 768)}


@pytest.mark.parametrize("method", PROMPT_METHODS)
@pytest.mark.parametrize("family", ["llama", "t5"])
def test_parameter_count_follows_the_papers_formula(method, family):
    from transformers import LlamaForCausalLM, T5ForConditionalGeneration

    from capt.recipes.backbones import random_config

    layers, width = (30, 576) if family == "llama" else (12, 768)
    cls = LlamaForCausalLM if family == "llama" else T5ForConditionalGeneration
    with torch.device("meta"):
        base = cls(random_config(family, layers=layers, width=width, heads=4, vocab=101))
    model = capt.get_capt_model(base, capt_config(method, MethodOptions()))
    expected = make_options(method, None).parameter_count(width, layers)
    assert model.get_nb_trainable_parameters()[0] == expected


def test_dept_defaults_are_the_papers():
    options = make_options("dept", None)
    assert (options.length, options.rank, options.positions, options.alpha) == (60, 30, 256, 8.0)
    assert options.parameter_count(768, 12) == 100 * 768  # the budget of a 100-token prompt on T5-Base


def test_m_idpg_count_is_the_authors_layerb_form():
    """One generator for all layers plus a bias table per layer: d b + b + b m d + L m d (SmolLM2: L 30, d 576)."""
    from transformers import LlamaForCausalLM

    from capt.recipes.backbones import random_config

    with torch.device("meta"):
        base = LlamaForCausalLM(random_config("llama", layers=30, width=576, heads=4, vocab=101))
    d, b, m, layers, n = 576, 16, 5, 30, 16
    for method, biases in (("m-idpg", layers), ("idpg", 1)):
        model = capt.get_capt_model(base, capt.CaptConfig(prompt_method=method))
        assert model.get_nb_trainable_parameters()[0] == d * b + b + b * m * d + biases * m * d
        model.unload()
        # The PHM generator (n = 16): each matrix is n rules of n x n plus n factors of (rows / n) x (cols / n).
        model = capt.get_capt_model(base, capt.CaptConfig(prompt_method=method, prompt_options={"phm": n}))
        phm = n**3 + d * b // n + b + n**3 + b * m * d // n + biases * m * d
        assert model.get_nb_trainable_parameters()[0] == phm == {"idpg": 14_544, "m-idpg": 98_064}[method]
        model.unload()


@pytest.mark.parametrize("family", FAMILIES)
def test_bottleneck_adapters_follow_houlsby(family):
    base = build(family)
    model = apply_method(Backbone(base, None, family_of(family), family), "adapter", MethodOptions(bottleneck=4))
    adapters = [m for m in model.modules() if isinstance(m, BottleneckAdapter)]
    sublayers = {"llama": 2 * 3, "t5": 2 * 2 + 3 * 2, "bert-cls": 2 * 3}[family]
    assert len(adapters) == sublayers
    head = sum(p.numel() for n, p in model.named_parameters() if "classifier" in n)
    # The layer norms train too, as in Houlsby et al.'s code. d = 32: BERT, 2 LayerNorms (weight + bias) per layer
    # and the embeddings'; Llama, 2 RMSNorms per layer and the final one; T5, a norm per sublayer and per stack.
    norms = {"bert-cls": (3 * 2 + 1) * 2 * 32, "llama": (3 * 2 + 1) * 32, "t5": (2 * 2 + 1 + 2 * 3 + 1) * 32}[family]
    expected = AdapterOptions(4).parameter_count(32, sublayers, norms) + head
    assert model.num_parameters(only_trainable=True) == expected
    inputs = batch_inputs(family)
    with torch.no_grad():
        untouched = model(**inputs).logits  # up starts at zero: the identity
        for adapter in adapters:
            adapter.up.weight.normal_()
        changed = model(**inputs).logits
    reference_base = build(family)
    with torch.no_grad():
        torch.testing.assert_close(untouched, reference_base(**inputs).logits)
    assert not torch.allclose(changed, untouched)
    # The math on one sublayer: output + up(gelu(down(output))).
    adapter = adapters[0]
    h = torch.randn(2, 5, 32)
    expected = h + torch.nn.functional.gelu(h @ adapter.down.weight.T + adapter.down.bias) @ adapter.up.weight.T
    torch.testing.assert_close(adapter(h), expected + adapter.up.bias)


def family_of(name: str) -> str:
    return {"llama": "decoder", "t5": "encoder-decoder", "bert-cls": "encoder"}[name]


def test_dept_low_rank_pair_gets_its_own_learning_rate():
    from capt.recipes.run import RunConfig
    from capt.recipes.train import _optimizer

    model = capt.get_capt_model(build("llama"), capt.CaptConfig(prompt_method="dept", prompt_options=SMALL["dept"]))
    optimizer = _optimizer(model, RunConfig(method="dept", lr=0.3, lr_secondary=1e-4))
    groups = {g["lr"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    assert groups[0.3] == {id(model.capsules.prompt)}
    assert groups[1e-4] == {id(p) for p in model.capsules.secondary.values()}


@pytest.mark.parametrize("method", ["head", "full", "capt"])
def test_a_head_trains_at_lr_when_it_is_the_method_and_at_head_lr_beside_another(method):
    from capt.recipes.backbones import load_backbone
    from capt.recipes.methods import apply_method
    from capt.recipes.run import RunConfig
    from capt.recipes.train import _optimizer

    model = apply_method(load_backbone("tiny-llama", num_labels=3, decoder_head="classifier"), method)
    optimizer = _optimizer(model, RunConfig(method=method, lr=0.3, head_lr=1e-4))
    head = {id(p) for n, p in model.named_parameters() if n.endswith("score.weight")}
    at_lr = {id(p) for g in optimizer.param_groups if g["lr"] == 0.3 for p in g["params"]}
    assert head and (head <= at_lr) == (method != "capt")  # before the fix, head-only ignored lr: a sweep moved nothing
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == trainable


def test_phm_terms_must_divide_the_widths():
    with pytest.raises(ValueError, match=r"IDPGOptions\.phm \(3\) must divide the bottleneck"):
        make_options("idpg", {"phm": 3})
    options, base = {"phm": 12, "bottleneck": 24}, build("llama")
    with pytest.raises(ValueError, match=r"IDPGOptions\.phm \(12\) must divide the model's hidden size \(32\)"):
        capt.get_capt_model(base, capt.CaptConfig(prompt_method="idpg", prompt_options=options))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in base.modules())  # left as it was


@pytest.mark.parametrize(
    "method, field, value",
    [
        ("smop", "balance_weight", -0.1),
        ("smop", "noise_std", "1"),
        ("dept", "alpha", 0),
        ("dept", "alpha", True),
        ("vfpt", "fourier_fraction", 1.5),
        ("vfpt", "fourier_fraction", True),
    ],
)
def test_bad_number_options_name_the_field(method, field, value):
    with pytest.raises(ValueError, match=rf"Options\.{field} must be a number"):
        make_options(method, {field: value})


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: make_options("vfpt", {"every_layer": "yes"}), "VFPTOptions.every_layer"),
        (lambda: make_options("idpg", {"every_layer": 1}), "IDPGOptions.every_layer"),
        (lambda: AdapterOptions(train_norms="no"), "AdapterOptions.train_norms"),
    ],
)
def test_bad_flag_options_name_the_field(make, field):
    with pytest.raises(ValueError, match=rf"{field} must be true or false"):
        make()
