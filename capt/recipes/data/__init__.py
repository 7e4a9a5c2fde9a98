"""SuperGLUE data: loaders, the paper's splits, and per-backbone text templates."""

from .superglue import (
    HUB_DATASET,
    SPLITS,
    TASKS,
    DataFormatError,
    DataNotFoundError,
    Example,
    TaskInfo,
    load_split,
    paper_splits,
    parse_record,
    resolve_data_dir,
)
from .templates import (
    encoder_choices,
    encoder_text,
    is_choice_task,
    lm_choices,
    lm_prompt,
    t5_input,
    t5_label_words,
)

__all__ = [
    "HUB_DATASET",
    "SPLITS",
    "TASKS",
    "DataFormatError",
    "DataNotFoundError",
    "Example",
    "TaskInfo",
    "encoder_choices",
    "encoder_text",
    "is_choice_task",
    "lm_choices",
    "lm_prompt",
    "load_split",
    "paper_splits",
    "parse_record",
    "resolve_data_dir",
    "t5_input",
    "t5_label_words",
]
