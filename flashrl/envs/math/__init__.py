"""Single-turn math: task sources, offline generators, prompt templates and the verifier."""

from flashrl.envs.math.env import PRESETS, MathEnv
from flashrl.envs.math.generators import ArithmeticGenerator, WordProblemGenerator
from flashrl.envs.math.tasks import (
    DATASOURCE_FIELDS,
    DatasetError,
    MathTask,
    TaskList,
    TaskSource,
    from_records,
    load_jsonl,
    load_parquet,
    load_tasks,
)
from flashrl.envs.math.templates import TEMPLATES, PromptTemplate
from flashrl.envs.math.verifier import VerifyResult, verifier_stats, verify_answer

__all__ = [
    "DATASOURCE_FIELDS",
    "PRESETS",
    "TEMPLATES",
    "ArithmeticGenerator",
    "DatasetError",
    "MathEnv",
    "MathTask",
    "PromptTemplate",
    "TaskList",
    "TaskSource",
    "VerifyResult",
    "WordProblemGenerator",
    "from_records",
    "load_jsonl",
    "load_parquet",
    "load_tasks",
    "verifier_stats",
    "verify_answer",
]
