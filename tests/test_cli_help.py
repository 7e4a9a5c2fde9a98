"""`capt --help` is quick and self-explaining: no command's help imports torch, and every flag says what it
does, its default and its choices, made from the registries (so a new method, task or variant shows up alone)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from capt.recipes.cli import _parser
from capt.recipes.settings import FIELD_HELP, METHODS, NAMED_MODELS, RunConfig, field_help
from capt.recipes.tasks import KINDS, builtin_tasks
from capt.variants import VARIANTS

COMMANDS = [[], ["train"], ["eval"], ["compare"], ["sweep"], ["predict"], ["serve"], ["tasks"]]
COMMANDS += [["analyze"], ["analyze", "attention"], ["analyze", "instance-token"]]
HEAVY = ("torch", "transformers", "peft", "accelerate", "datasets")


def test_no_help_imports_torch_transformers_or_peft():
    """One process per command, as a user runs it; each reports the modules its --help left loaded."""
    code = (
        "import contextlib, io, json, sys\n"
        "from capt.recipes.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(sys.argv[1:] + ['--help'])\n"
        "print(json.dumps({'help': out.getvalue(), 'modules': sorted(sys.modules)}))\n"
    )
    for command in COMMANDS:
        done = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, check=True)
        report = json.loads(done.stdout)
        assert report["help"].startswith(f"usage: capt {' '.join(command)}".rstrip()), command
        assert not [m for m in report["modules"] if m.split(".")[0] in HEAVY], command


def _actions(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("capt",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


def test_every_flag_has_help_that_names_its_default():
    actions = list(_actions(_parser()))
    assert len(actions) > 100  # every command's flags are walked
    for command, action in actions:
        name = f"{command} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help.strip(), f"{name}: no help"
        informative = action.default not in (None, False, argparse.SUPPRESS) and not action.required
        run_flag = command in ("capt train", "capt compare", "capt sweep") and action.dest in FIELD_HELP
        if informative or run_flag:  # RunConfig flags default to None; their help shows RunConfig's default
            assert "default" in action.help, f"{name}: the help does not say its default"


def test_run_flags_take_their_help_default_and_choices_from_runconfig_and_the_registries():
    train = {a.dest: a for _, a in _actions(_parser()) if _ == "capt train"}
    assert set(FIELD_HELP) == {f for f in RunConfig.__dataclass_fields__}  # every field explained, none stale
    for field in FIELD_HELP:
        assert train[field].help == field_help(field)
        default = getattr(RunConfig, field, None)
        if default is not None and not isinstance(default, bool):
            assert f"default: {default}" in train[field].help
    for field, names in {
        "method": METHODS,
        "variant": VARIANTS,
        "task": builtin_tasks(),
        "model": NAMED_MODELS,
    }.items():
        listed = train[field].help.split(": ")[-1].rstrip(")").split(", ")
        assert listed == list(names), field
    assert train["task_type"].choices == KINDS


@pytest.mark.parametrize("field", ["method", "variant", "decoder_head", "optimizer", "prompt_bos"])
def test_the_choices_in_the_help_are_the_ones_runconfig_accepts(field):
    """Each listed name makes a RunConfig (so the help lists no stale name), and a name it leaves out does not."""
    listed = field_help(field).split("one of: ")[1].rstrip(")").split(", ")
    for name in listed:
        extra = {"method": "capt"} if field == "variant" else {}
        assert getattr(RunConfig(**{field: name, **extra}), field) == name
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        RunConfig(**{field: "not-a-" + field})
