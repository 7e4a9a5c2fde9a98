"""The task layer: a task is data (`TaskSpec`, read from YAML), not code.

spec.py        TaskSpec: kind, source, fields, labels, templates per backbone family, metrics
builtin/       the eight SuperGLUE tasks as task files
preprocess.py  the named Python functions a task file may call for what data cannot say
render.py      an example as each family's strings, from the templates
readers.py     examples from the official SuperGLUE loader or a user's files, and the splits
registry.py    task names -> specs: built-ins, task files, run folders' task.yaml
"""

from .readers import parse_task_record, read_rows, resolved_spec, task_splits
from .registry import (
    TASK_FILE_NAME,
    builtin_tasks,
    get_task,
    is_task_file,
    read_task_file,
    register_task,
    task_names,
    write_task_file,
)
from .spec import KINDS, METRIC_DIRECTIONS, TaskSpec, TaskSpecError

__all__ = [
    "KINDS",
    "METRIC_DIRECTIONS",
    "TASK_FILE_NAME",
    "TaskSpec",
    "TaskSpecError",
    "builtin_tasks",
    "get_task",
    "is_task_file",
    "parse_task_record",
    "read_rows",
    "read_task_file",
    "register_task",
    "resolved_spec",
    "task_names",
    "task_splits",
    "write_task_file",
]
