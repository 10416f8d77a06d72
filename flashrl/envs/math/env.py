"""``flashrl/Math-v0``: single-turn math questions checked with math-verify."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flashrl.envs.base import LanguageEnv, Messages, StepResult
from flashrl.envs.math.generators import ArithmeticGenerator, WordProblemGenerator
from flashrl.envs.math.tasks import (
    DATASOURCE_FIELDS,
    AnswerFormat,
    MathTask,
    TaskList,
    TaskSource,
    blend_tasks,
    load_tasks,
)
from flashrl.envs.math.templates import PromptTemplate, resolve_template
from flashrl.envs.math.verifier import VerifyResult, verify_answer
from flashrl.envs.task_order import EpochCursor, Order, check_order
from flashrl.user_code import import_path

#: Built-in task presets: name -> (task source factory, default template name).
PRESETS: dict[str, tuple[Any, str]] = {
    # The default CPU training task: "What is a + b?" with a, b in 1..30; reward = the last number
    # of the reply (or its boxed answer) equals a + b. SmolLM2-135M-Instruct answers about half.
    "easy_sums": (lambda: ArithmeticGenerator(), "plain"),
    "arithmetic": (lambda: ArithmeticGenerator.from_difficulty(3), "boxed"),
    "word_problems": (lambda: WordProblemGenerator(), "step_by_step"),
}


class MathEnv(LanguageEnv):
    r"""Single-turn math: the model answers a question and is rewarded when the answer is right.

    ## Description
    Each episode is one question. The task source is a built-in offline generator (``preset``:
    ``easy_sums``, ``arithmetic``, ``word_problems``; or ``difficulty=1..5`` for arithmetic), a
    JSONL/Parquet file with configurable fields, a ``datasets.Dataset`` (or any iterable of dict
    rows), a list of :class:`~flashrl.envs.math.tasks.MathTask`, or any
    :class:`~flashrl.envs.math.tasks.TaskSource`.

    ## Observation space
    :class:`~flashrl.envs.spaces.ChatMessages`. ``reset`` returns the prompt: an optional system
    message and the user message made by the prompt template. ``step`` returns ``[]`` (nothing
    follows the answer).

    ## Action space
    :class:`~flashrl.envs.spaces.UnicodeText`: the model's reply text.

    ## Reward
    ``1.0`` when :func:`~flashrl.envs.math.verifier.verify_answer` finds the reply's answer (its
    last ``\boxed{}``, else its last number) equal to the reference, ``0.0`` otherwise; plus
    ``format_reward`` when the answer was given in a complete ``\boxed{}``. A verification timeout or
    crash gives ``0.0``; the reason is in ``info["reason"]`` and ``self.verifier_failures`` counts it.

    ``reward_fn`` replaces the verifier: a function ``reward_fn(reply, task) -> float | VerifyResult``
    (``task`` a :class:`~flashrl.envs.math.tasks.MathTask`) or its ``"module:name"`` path. A float is
    the reward (``correct`` and ``success`` are then reward > 0, ``extracted`` None); a
    :class:`~flashrl.envs.math.verifier.VerifyResult` is used as the verifier's is. It runs in the env
    runners' threads, so it must be thread-safe; defined in the user's script or in a module the
    runners cannot import, it reaches them by value (``code_arguments``).

    ## Threads
    Thread-safe across instances: answers are compared in the verifier's worker processes, a pool shared
    by the process behind a lock and a semaphore (:mod:`flashrl.envs.math.verifier`), so many envs may
    step from many threads at once (checked by ``benchmarks/env_concurrency.py``: 16 threads, every
    right answer rewarded); one instance serves one thread at a time.

    ## Episode end
    Terminates after one step. ``step`` after that raises
    :class:`~flashrl.envs.base.EpisodeEndedError` until the next ``reset``.

    ## Info
    ``reset``: ``prompt_id`` (stable task key), ``question``, ``answer``, ``task_index`` (finite
    sources). ``step``: ``prompt_id``, ``answer``, ``extracted``, ``correct``, ``success`` (=
    ``correct``; a format bonus is not a success), ``boxed``, ``reason``, ``verifier_failed``, ``turn``.
    Both also carry the task's :attr:`~flashrl.envs.math.tasks.MathTask.info`: a row's benchmark
    under its field name (``data_source`` or ``datasource``, or ``datasource_field``), which the
    evaluation reports by (``evaluation_datasource_key``, e.g. ``evaluation/aime25/avg@4``).

    ## Reset options
    ``{"task_index": i}`` picks task ``i`` of a finite source; ``{"task": {"question": ...,
    "answer": ...}}`` (or a ``MathTask``; a dict's ``data_source`` / ``datasource`` is kept as its
    benchmark) plays the given task.

    ## Arguments
    ``tasks``, ``preset`` (default ``"easy_sums"`` when ``tasks`` is None), ``difficulty``,
    ``question_field``/``answer_field``/``id_field``/``answer_format`` (file and row sources),
    ``datasource_field`` (the rows' benchmark field; None = ``data_source`` or ``datasource`` where a
    row has one),
    ``template`` (name in ``TEMPLATES``, a format string with ``{question}``, or a
    ``PromptTemplate``), ``system_prompt`` (overrides the template's), ``format_reward``,
    ``verify_timeout_s``, ``reward_fn`` (see Reward), ``order`` (finite sources reset without a ``task_index``: ``shuffle`` each
    epoch, ``random`` with replacement, or ``sequential``; an EnvRunner's training stream picks the task
    itself, in seeded passes: `flashrl.env_runners.data_passes`), ``render_mode`` (``None`` or ``"ansi"``).
    Several datasets: ``tasks=[a, b, ...]`` (paths or task lists) are blended by
    :func:`~flashrl.envs.math.tasks.blend_tasks` (whose docstring names the runtime it follows):
    concatenated, or with ``prompt_probs=[p_a, p_b, ...]`` interleaved by those weights (``blend_seed``);
    ``max_samples_per_source`` cuts each source, and the blend, to its first that many tasks.

    ## Version history
    * v0: initial version.
    """

    code_arguments = ("reward_fn",)

    def __init__(
        self,
        tasks: str | os.PathLike[str] | TaskSource | Sequence[MathTask] | Any | None = None,
        *,
        preset: str | None = None,
        difficulty: int | None = None,
        question_field: str = "question",
        answer_field: str = "answer",
        id_field: str | None = None,
        answer_format: AnswerFormat = "plain",
        datasource_field: str | None = None,
        template: PromptTemplate | str | None = None,
        system_prompt: str | None = None,
        format_reward: float = 0.0,
        verify_timeout_s: float = 5.0,
        reward_fn: Callable[[str, MathTask], float | VerifyResult] | str | None = None,
        order: Order = "shuffle",
        render_mode: str | None = None,
        prompt_probs: Sequence[float] | None = None,
        blend_seed: int = 42,
        max_samples_per_source: int | None = None,
    ) -> None:
        super().__init__(max_turns=1, render_mode=render_mode)
        chosen = [
            name
            for name, v in (("tasks", tasks), ("preset", preset), ("difficulty", difficulty))
            if v is not None
        ]
        if len(chosen) > 1:
            raise ValueError(f"Give at most one of tasks, preset and difficulty; got {chosen}.")
        default_template = "boxed"
        blending = _is_source_list(tasks) or prompt_probs is not None or max_samples_per_source is not None
        if blending and tasks is None:
            raise ValueError("prompt_probs / max_samples_per_source need tasks= (a dataset or a list of them).")
        if tasks is not None:
            loaded = [
                load_tasks(source, question_field=question_field, answer_field=answer_field, id_field=id_field,
                           answer_format=answer_format, datasource_field=datasource_field)
                for source in (list(tasks) if _is_source_list(tasks) else [tasks])
            ]
            if blending:
                infinite = [getattr(t, "name", repr(t)) for t in loaded if not isinstance(t, TaskList)]
                if infinite:
                    raise ValueError(f"Blending needs finite datasets; {infinite} draw tasks from a generator.")
                self.tasks = blend_tasks(loaded, prompt_probs, seed=blend_seed, max_count=max_samples_per_source)
            else:
                self.tasks = loaded[0]
        elif difficulty is not None:
            self.tasks = ArithmeticGenerator.from_difficulty(difficulty)
        else:
            preset = preset or "easy_sums"
            if preset not in PRESETS:
                raise ValueError(f"Unknown preset {preset!r}; expected one of {sorted(PRESETS)}.")
            factory, default_template = PRESETS[preset]
            self.tasks = factory()
        self.template = resolve_template(template, default_template)
        if system_prompt is not None:
            self.template = PromptTemplate(self.template.user, system_prompt)
        check_order(order)
        if not verify_timeout_s > 0:
            raise ValueError(f"verify_timeout_s must be > 0; got {verify_timeout_s}.")
        if format_reward < 0:
            raise ValueError(f"format_reward must be >= 0; got {format_reward}.")
        if isinstance(reward_fn, str):
            reward_fn = import_path(reward_fn)
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError(f"reward_fn must be a callable (reply, task) -> float or its 'module:name' path; got "
                            f"{reward_fn!r}.")
        self.reward_fn = reward_fn
        self.order = order
        self.format_reward = float(format_reward)
        self.verify_timeout_s = float(verify_timeout_s)
        self.verifier_failures = 0
        """Number of steps whose verification timed out or crashed (reward 0 was given)."""
        self.task: MathTask | None = None
        self._epoch = EpochCursor()

    @property
    def finite(self) -> bool:
        """Whether the task source is a finite, indexable dataset."""
        return hasattr(self.tasks, "__len__") and hasattr(self.tasks, "__getitem__")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Messages, dict[str, Any]]:
        if seed is not None:
            self._epoch.restart()  # a new seed restarts the epoch order
        return super().reset(seed=seed, options=options)

    def _reset_task(self, options: dict[str, Any]) -> tuple[Messages, dict[str, Any]]:
        unknown = set(options) - {"task", "task_index"}
        if unknown:
            raise ValueError(
                f"Unknown reset options {sorted(unknown)}; MathEnv accepts 'task' and 'task_index'."
            )
        index: int | None = None
        if "task" in options:
            self.task = _as_task(options["task"])
        elif "task_index" in options:
            if not self.finite:
                raise ValueError("reset(options={'task_index': ...}) needs a finite task source (a dataset).")
            index = int(options["task_index"])
            if not 0 <= index < len(self.tasks):  # type: ignore[arg-type]
                raise IndexError(f"task_index {index} is out of range for {len(self.tasks)} tasks.")  # type: ignore[arg-type]
            self.task = self.tasks[index]  # type: ignore[index]
        elif self.finite:
            index = self._next_index()
            self.task = self.tasks[index]  # type: ignore[index]
        else:
            self.task = self.tasks.sample(self.np_random)
        info: dict[str, Any] = {
            **self.task.info,
            "prompt_id": self.task.prompt_id,
            "question": self.task.question,
            "answer": self.task.answer,
        }
        if index is not None:
            info["task_index"] = index
        return self.template.messages(self.task), info

    def _next_index(self) -> int:
        return self._epoch.next_index(len(self.tasks), self.order, self.np_random)  # type: ignore[arg-type]

    def _step_action(self, action: str) -> StepResult:
        assert self.task is not None
        if self.reward_fn is None:
            result = verify_answer(action, self.task.answer, timeout_s=self.verify_timeout_s)
        else:
            result = _user_result(self.reward_fn(action, self.task))
        if result.failed:
            self.verifier_failures += 1
        reward = result.reward + (self.format_reward if result.boxed else 0.0)
        info = {
            **self.task.info,
            "prompt_id": self.task.prompt_id,
            "answer": self.task.answer,
            "extracted": result.extracted,
            "correct": result.correct,
            "success": bool(result.correct),  # the env contract's success signal (flashrl.envs.base)
            "boxed": result.boxed,
            "reason": result.reason,
            "verifier_failed": result.failed,
        }
        return [], reward, True, False, info


def _user_result(value: Any) -> VerifyResult:
    """A user reward function's return value as the verifier's result (a float: success = reward > 0)."""
    if isinstance(value, VerifyResult):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"reward_fn must return a float or a VerifyResult; got {value!r:.200}.")
    reward = float(value)
    return VerifyResult(reward=reward, correct=reward > 0, extracted=None, reason="reward_fn")


def _is_source_list(tasks: Any) -> bool:
    """Whether ``tasks`` is a list of datasets (paths or task lists) to blend, not one list of tasks."""
    return (
        isinstance(tasks, (list, tuple))
        and bool(tasks)
        and all(isinstance(t, (str, os.PathLike, TaskList)) for t in tasks)
    )


def _as_task(task: Any) -> MathTask:
    if isinstance(task, MathTask):
        return task
    if isinstance(task, dict) and isinstance(task.get("question"), str) and "answer" in task:
        answer = str(task["answer"])
        return MathTask(
            question=task["question"],
            answer=answer,
            prompt_id=str(task.get("prompt_id", f"custom:{task['question']}")),
            info={key: str(task[key]) for key in DATASOURCE_FIELDS if task.get(key) is not None},
        )
    raise TypeError(
        "reset(options={'task': ...}) expects a MathTask or a dict with 'question' (str) and "
        f"'answer'; got {task!r:.200}."
    )
