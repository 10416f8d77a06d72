"""Math tasks and where they come from: JSONL and Parquet files, Hugging Face datasets, lists.

Every source yields :class:`MathTask` objects. A finite source is a :class:`TaskList`; the offline
generators (:mod:`flashrl.envs.math.generators`) are infinite sources. Both satisfy
:class:`TaskSource`: ``sample(rng)`` draws one task with the environment's random generator.

Fields are configurable (``question_field``, ``answer_field``, ``id_field``, ``datasource_field``) and
may be dotted paths into nested records (``"reward_model.ground_truth"``). A row's benchmark name
(``data_source`` or ``datasource``: :data:`DATASOURCE_FIELDS`) is kept in
:attr:`MathTask.info`, so every episode of the task reports it (per-benchmark evaluation). A
malformed row raises :class:`DatasetError` naming the file and line (JSONL) or row (Parquet,
datasets), what was expected and what was found.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

AnswerFormat = Literal["plain", "gsm8k"]


class DatasetError(ValueError):
    """A dataset file or row does not have the expected shape."""


@dataclass(frozen=True)
class MathTask:
    """One question with its reference answer."""

    question: str
    """The question text shown to the model (before the prompt template is applied)."""
    answer: str
    """Reference answer, LaTeX or plain text, as math-verify parses it."""
    prompt_id: str
    """Stable key of the task (the same question always gets the same id)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Source-specific details (operands, template name, file and line)."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Fields every episode of the task reports in its info, e.g. its benchmark ``{"datasource": "gsm8k"}``."""


DATASOURCE_FIELDS = ("data_source", "datasource")
"""Row fields read as a task's benchmark when no ``datasource_field`` is given (verl's, then Molt's)."""


@runtime_checkable
class TaskSource(Protocol):
    """Anything that can draw a task with a NumPy random generator."""

    name: str

    def sample(self, rng: np.random.Generator) -> MathTask: ...


class TaskList(Sequence[MathTask]):
    """A finite, indexable list of tasks (a loaded dataset)."""

    def __init__(
        self, tasks: Iterable[MathTask], *, name: str = "tasks", allow_duplicate_ids: bool = False
    ) -> None:
        self.tasks: list[MathTask] = list(tasks)
        self.name = name
        if not self.tasks:
            raise DatasetError(f"Task source {name!r} is empty; expected at least one task.")
        first: dict[str, int] = {}
        for i, task in enumerate(self.tasks):
            if not isinstance(task, MathTask):
                raise TypeError(f"{name}: item {i} is a {type(task).__name__}, expected MathTask.")
            seen = first.setdefault(task.prompt_id, i)
            if seen != i and not allow_duplicate_ids:
                # A prompt id keys the task in the books and in per-prompt metrics: two tasks under
                # one id would be counted as one.
                raise DatasetError(
                    f"{name}: task id {task.prompt_id!r} appears twice ({_where(self.tasks[seen], seen)} and "
                    f"{_where(task, i)}); expected every id once. Fix the id field, or pass "
                    "allow_duplicate_ids=True if the repeats are deliberate."
                )

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, index: int) -> MathTask:  # type: ignore[override]
        return self.tasks[index]

    def sample(self, rng: np.random.Generator) -> MathTask:
        return self.tasks[int(rng.integers(len(self.tasks)))]

    def __repr__(self) -> str:
        return f"TaskList({self.name!r}, {len(self.tasks)} tasks)"


def _where(task: MathTask, index: int) -> str:
    return str(task.metadata.get("source", f"item {index}"))


# --------------------------------------------------------------------------------------- rows
def _lookup(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(path)
        value = value[part]
    return value


def normalize_answer(raw: str, answer_format: AnswerFormat) -> str:
    """The reference answer from a raw answer field (``gsm8k``: the text after ``####``)."""
    if answer_format == "plain":
        return raw.strip()
    if answer_format == "gsm8k":
        if "####" not in raw:
            raise ValueError("expected a GSM8K-style answer ending in '#### <number>'")
        return raw.rsplit("####", 1)[1].strip().replace(",", "")
    raise ValueError(f"answer_format must be 'plain' or 'gsm8k'; got {answer_format!r}")


def task_from_row(
    row: Any,
    *,
    where: str,
    default_id: str,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    answer_format: AnswerFormat = "plain",
    datasource_field: str | None = None,
) -> MathTask:
    """Build a task from one record; ``where`` (``"file.jsonl:12"``) prefixes every error.

    ``datasource_field`` names the row's benchmark field (then every row must have it); None reads
    the first of :data:`DATASOURCE_FIELDS` the row has (not null), if any. It lands in
    ``MathTask.info`` under that field's name.
    """
    if not isinstance(row, Mapping):
        raise DatasetError(f"{where}: expected an object with fields, got {type(row).__name__}.")
    if datasource_field is None:
        datasource_field = next((name for name in DATASOURCE_FIELDS if row.get(name) is not None), None)
    values: dict[str, str] = {}
    for role, path in (("question", question_field), ("answer", answer_field), ("id", id_field),
                       ("datasource", datasource_field)):
        if path is not None:
            values[role] = _text_field(row, path, role, where)
    try:
        answer = normalize_answer(values["answer"], answer_format)
    except ValueError as exc:
        raise DatasetError(f"{where}: field {answer_field!r}: {exc}.") from None
    if not answer:
        raise DatasetError(f"{where}: field {answer_field!r} holds no answer after '####'.")
    return MathTask(
        question=values["question"],
        answer=answer,
        prompt_id=values.get("id", default_id),
        metadata={"source": where},
        info={datasource_field: values["datasource"]} if datasource_field is not None else {},
    )


def _text_field(row: Mapping[str, Any], path: str, role: str, where: str) -> str:
    """The non-empty text of field ``path`` (a string or a number) of ``row``."""
    try:
        value = _lookup(row, path)
    except KeyError:
        raise DatasetError(
            f"{where}: missing field {path!r} (the {role}); the row has fields {sorted(row)}. "
            f"Set {role}_field= to the right name."
        ) from None
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise DatasetError(
            f"{where}: field {path!r} (the {role}) must be a string or a number; got "
            f"{type(value).__name__}."
        )
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
        # JSON's NaN / Infinity (and Parquet's) would become the answer text 'nan' / 'inf'.
        raise DatasetError(
            f"{where}: field {path!r} (the {role}) is the number {value}; expected a finite number or text. "
            "Fix the row (a missing answer is often written as NaN), or drop it."
        )
    try:
        text = str(value).strip()
    except ValueError:  # an int longer than sys.get_int_max_str_digits() (a row built in Python)
        raise DatasetError(
            f"{where}: field {path!r} (the {role}) is an integer of more than {sys.get_int_max_str_digits()} "
            "digits, which Python does not write as text. Give it as a string."
        ) from None
    if not text:
        raise DatasetError(f"{where}: field {path!r} (the {role}) is empty.")
    return text


# --------------------------------------------------------------------------------------- loaders
def load_jsonl(
    path: str | os.PathLike[str],
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    answer_format: AnswerFormat = "plain",
    datasource_field: str | None = None,
    allow_duplicate_ids: bool = False,
) -> TaskList:
    """Tasks from a JSON Lines file, one object per line (blank lines are skipped)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    tasks = [
        task_from_row(
            row,
            where=where,
            default_id=f"{name}:{lineno}",
            question_field=question_field,
            answer_field=answer_field,
            id_field=id_field,
            answer_format=answer_format,
            datasource_field=datasource_field,
        )
        for where, lineno, row in jsonl_rows(path)
    ]
    return TaskList(tasks, name=name, allow_duplicate_ids=allow_duplicate_ids)


def jsonl_rows(path: str | os.PathLike[str]) -> Iterator[tuple[str, int, Any]]:
    """The rows of a JSON Lines file as ``(where, lineno, row)``, ``where`` being ``"path:lineno"``.

    Blank lines are skipped; a line that is not UTF-8 or not JSON raises `DatasetError` naming it.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:  # bytes, so that a decoding error can name its line
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{where}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}); expected a "
                    "UTF-8 JSON Lines file. Re-encode the file as UTF-8 (e.g. iconv -t UTF-8)."
                ) from None
            if line.strip():
                yield where, lineno, _json_row(line, where)


def _json_row(line: str, where: str) -> Any:
    """One JSON Lines row; `DatasetError` naming ``where`` (file:line) for anything Python's parser refuses."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}).") from None
    except ValueError as exc:  # an integer literal longer than sys.get_int_max_str_digits()
        raise DatasetError(
            f"{where}: a number Python does not read ({exc}); expected numbers of at most "
            f"{sys.get_int_max_str_digits()} digits. Write a longer number as a JSON string."
        ) from None
    except RecursionError:
        raise DatasetError(
            f"{where}: JSON nested deeper than Python's parser goes (its recursion limit, "
            f"{sys.getrecursionlimit()}); expected a row of fields. Fix or drop the row."
        ) from None


def load_parquet(
    path: str | os.PathLike[str],
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    answer_format: AnswerFormat = "plain",
    datasource_field: str | None = None,
    allow_duplicate_ids: bool = False,
) -> TaskList:
    """Tasks from a Parquet file (rows numbered from 1 in errors and default ids)."""
    import pyarrow.parquet as pq

    path = os.fspath(path)
    name = os.path.basename(path)
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for unreadable files
        raise DatasetError(f"{path}: not a readable Parquet file ({exc}).") from exc
    return from_records(rows, name=name, source=path, question_field=question_field, answer_field=answer_field,
                        id_field=id_field, answer_format=answer_format, datasource_field=datasource_field,
                        allow_duplicate_ids=allow_duplicate_ids)


def from_records(
    records: Iterable[Mapping[str, Any]],
    *,
    name: str = "dataset",
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    answer_format: AnswerFormat = "plain",
    datasource_field: str | None = None,
    allow_duplicate_ids: bool = False,
    source: str | None = None,
) -> TaskList:
    """Tasks from any iterable of dict rows, e.g. a Hugging Face ``datasets.Dataset`` split (errors name
    ``source``, e.g. the file, or else ``name``, and the row)."""
    return TaskList(
        (
            task_from_row(
                row,
                where=f"{source or name}: row {i}",
                default_id=f"{name}:{i}",
                question_field=question_field,
                answer_field=answer_field,
                id_field=id_field,
                answer_format=answer_format,
                datasource_field=datasource_field,
            )
            for i, row in enumerate(records, start=1)
        ),
        name=name,
        allow_duplicate_ids=allow_duplicate_ids,
    )


def blend_tasks(
    sources: Sequence[TaskList],
    probabilities: Sequence[float] | None = None,
    *,
    seed: int = 42,
    max_count: int | None = None,
    name: str | None = None,
) -> TaskList:
    """Several finite task lists as one, as Molt 0.2.1's ``blending_datasets`` (molt/datasets/utils.py)
    blends ``data.prompt_dataset`` by ``data.prompt_probs``.

    Each source is cut to its first ``max_count`` tasks; without ``probabilities`` the sources are concatenated; with them they are interleaved as
    Hugging Face's ``interleave_datasets(probabilities=..., seed=..., stopping_strategy="all_exhausted")``
    does: draw a source with those probabilities (``numpy.random.default_rng(seed)``, 1000 draws at a
    time), take its next task (a source that runs out starts over), stop once every source has run out
    at least once. So the blend holds every task of every source at least once, and the smaller sources'
    tasks repeated in proportion to their weight. The result is cut to its first ``max_count`` tasks (the
    runtime cuts the blend to ``data.max_samples``). Repeated tasks keep their ids (duplicates are allowed).
    """
    lists = [TaskList(source, name=getattr(source, "name", "tasks"), allow_duplicate_ids=True) for source in sources]
    if not lists:
        raise DatasetError("blend_tasks: expected at least one task source, got none.")
    if max_count is not None:
        if not (isinstance(max_count, int) and max_count >= 1):
            raise ValueError(f"blend_tasks: expected max_count None or an integer >= 1, got {max_count!r}.")
        lists = [TaskList(t.tasks[:max_count], name=t.name, allow_duplicate_ids=True) for t in lists]
    label = name or "+".join(t.name for t in lists)
    if probabilities is None:
        blended = [task for t in lists for task in t.tasks]
    else:
        probs = [float(p) for p in probabilities]
        if len(probs) != len(lists) or not all(math.isfinite(p) and p > 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
            raise DatasetError(
                f"blend_tasks: expected one probability > 0 per source ({len(lists)}), summing to 1, got {probs}. "
                "Fix: e.g. prompt_probs=[0.7, 0.3] for two sources"
            )
        blended = _interleave(lists, probs, seed)
    if max_count is not None:
        blended = blended[:max_count]
    return TaskList(blended, name=label, allow_duplicate_ids=True)


def _interleave(lists: Sequence[TaskList], probabilities: Sequence[float], seed: int) -> list[MathTask]:
    """Hugging Face's all_exhausted interleaving of map-style datasets (see `blend_tasks`)."""
    rng = np.random.default_rng(seed)
    position = [0] * len(lists)
    exhausted = [False] * len(lists)
    out: list[MathTask] = []
    while True:
        for source in rng.choice(len(lists), size=1000, p=probabilities):
            source = int(source)
            out.append(lists[source][position[source]])
            position[source] += 1
            if position[source] >= len(lists[source]):
                exhausted[source], position[source] = True, 0
            if all(exhausted):
                return out


def load_tasks(
    source: Any,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    answer_format: AnswerFormat = "plain",
    datasource_field: str | None = None,
    allow_duplicate_ids: bool = False,
) -> TaskSource:
    """Any supported source as a :class:`TaskSource`.

    ``source`` may be a ``.jsonl``/``.parquet`` path, a :class:`TaskSource` (returned as is), a
    sequence of :class:`MathTask`, a pandas ``DataFrame``, or an iterable of dict rows such as a
    ``datasets.Dataset``. Two tasks with one id are a `DatasetError` unless ``allow_duplicate_ids``.
    """
    fields = {
        "question_field": question_field,
        "answer_field": answer_field,
        "id_field": id_field,
        "answer_format": answer_format,
        "datasource_field": datasource_field,
        "allow_duplicate_ids": allow_duplicate_ids,
    }
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Math task file {path!r} does not exist.")
        if path.endswith((".jsonl", ".jsonl.txt", ".ndjson")):
            return load_jsonl(path, **fields)  # type: ignore[arg-type]
        if path.endswith((".parquet", ".pq")):
            return load_parquet(path, **fields)  # type: ignore[arg-type]
        raise DatasetError(
            f"Math task file {path!r}: expected a .jsonl or .parquet file; load other formats "
            "yourself and pass a list of MathTask or dict rows."
        )
    if isinstance(source, TaskSource):
        return source
    if isinstance(source, Sequence) and source and all(isinstance(t, MathTask) for t in source):
        return TaskList(source, allow_duplicate_ids=allow_duplicate_ids)
    if hasattr(source, "columns") and hasattr(source, "to_dict"):  # a pandas DataFrame
        return from_records(source.to_dict("records"), name="dataframe", **fields)  # type: ignore[arg-type]
    if isinstance(source, Iterable) and not isinstance(source, Mapping):
        name = str(getattr(source, "info", None) and getattr(source.info, "dataset_name", None) or "dataset")
        return from_records(source, name=name, **fields)  # type: ignore[arg-type]
    raise TypeError(
        "tasks must be a .jsonl/.parquet path, a TaskSource, a list of MathTask or an iterable of "
        f"dict rows (e.g. a datasets.Dataset); got {type(source).__name__}."
    )
