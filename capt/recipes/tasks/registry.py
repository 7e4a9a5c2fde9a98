"""Where task specs come from: the built-in task files, a user's YAML file, or a spec built from flags.

A task is named everywhere else (RunConfig.task, run folders, results tables) by its spec's name; this registry
turns the name back into the spec. User specs enter it when read (a YAML file, a run folder's task.yaml).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml

from .spec import TaskSpec, TaskSpecError, close_name

BUILTIN_DIR = Path(__file__).parent / "builtin"
TASK_FILE_NAME = "task.yaml"  # the resolved spec, in a run folder
_USER_TASKS: dict[str, TaskSpec] = {}


@cache
def builtin_tasks() -> dict[str, TaskSpec]:
    """The built-in tasks (the eight SuperGLUE tasks), by name, in file-name order."""
    return {path.stem: read_task_file(path) for path in sorted(BUILTIN_DIR.glob("*.yaml"))}


def read_task_file(path: str | Path) -> TaskSpec:
    """A spec from a YAML file; relative source paths are read from the file's folder.

    Example:
        >>> read_task_file(BUILTIN_DIR / "cb.yaml").labels
        ('entailment', 'contradiction', 'neutral')
    """
    path = Path(path)
    if not path.is_file():
        raise TaskSpecError(f"--task {path}: no such task file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise TaskSpecError(f"{path} is not a valid task file: {' '.join(str(err).split())}") from err
    return TaskSpec.from_dict(data, str(path)).with_source_relative_to(path.parent.resolve())


def write_task_file(spec: TaskSpec, path: str | Path) -> None:
    """Write `spec` as YAML (atomically); `read_task_file` reads back an equal spec."""
    from ...saving import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(spec.to_dict(), sort_keys=False, allow_unicode=True))


def register_task(spec: TaskSpec) -> TaskSpec:
    """Make a user spec known by its name (a later spec of the same name replaces it); built-in names are refused."""
    if spec.name in builtin_tasks() and builtin_tasks()[spec.name] != spec:
        raise TaskSpecError(f"task name {spec.name!r} is a built-in task; give your task another name")
    _USER_TASKS[spec.name] = spec
    return spec


def is_task_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml"))


def get_task(name: str) -> TaskSpec:
    """The spec of a built-in or registered task, or of a task YAML file (which is registered)."""
    if is_task_file(name):
        return register_task(read_task_file(name))
    spec = builtin_tasks().get(name.lower()) or _USER_TASKS.get(name)
    if spec is None:
        known = [*builtin_tasks(), *_USER_TASKS]
        raise TaskSpecError(
            f"unknown task {name!r}{close_name(name, known)}; built-in tasks: {', '.join(builtin_tasks())} "
            "(`capt tasks`), or give a task YAML file, or --train-file"
        )
    return spec


def task_names() -> tuple[str, ...]:
    """Every task name known now: the built-ins, then the registered user tasks."""
    return (*builtin_tasks(), *_USER_TASKS)
