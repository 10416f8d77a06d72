"""User callbacks (RLlib's ``.callbacks(...)``) and the metrics logger they write to.

Subclass `FlashReinforceCallbacks` (alias `DefaultCallbacks`), override the hooks you need and pass
the class, or its import path ``"package.module:Class"``, to ``FlashReinforceConfig().callbacks(...)``.
Every process that fires hooks builds its own instance with ``callbacks_class()`` (no arguments),
so an instance's attributes are per process, never shared::

    class CountTools(FlashReinforceCallbacks):
        def on_episode_end(self, *, episode, metrics_logger, **kwargs):     # in each EnvRunner actor
            metrics_logger.log_value("tool_calls_max", episode.info.get("tool_calls", 0), reduce="max")

        def on_train_result(self, *, algorithm, result, **kwargs):         # in the algorithm's process
            if result["callbacks/tool_calls_max"] >= 3:
                result["should_stop"] = True

The hooks, with RLlib's names and keyword-only arguments, and the process each runs in:

================================  ===============================  =========================================
hook                              process                          when
================================  ===============================  =========================================
``on_algorithm_init``             the algorithm's (driver/trial)   end of ``FlashReinforce.setup()``
``on_episode_end``                each EnvRunner actor             an episode that will be delivered ended
``on_sample_end``                 each EnvRunner actor             a poll or ``sample()`` hands episodes out
``on_train_result``               the algorithm's                  end of each ``train()`` iteration
``on_evaluate_start``             the algorithm's                  start of ``FlashReinforce.evaluate()``
``on_evaluate_end``               the algorithm's                  end of ``FlashReinforce.evaluate()``
``on_checkpoint_loaded``          the algorithm's                  end of ``restore_from_path()`` (Tune's
                                                                   restore, ``from_checkpoint``)
================================  ===============================  =========================================

The EnvRunner hooks run on the runner's event loop, between generation requests: keep them quick
(a slow one stalls every episode of that runner). An exception in any hook is not swallowed: in an
EnvRunner it fails the runner (the group restarts it, and stops the run when the same error repeats),
in the algorithm's process it fails ``train()``.

Custom metrics: every hook gets a `MetricsLogger`. Values logged in an iteration (by the runners'
episodes received during it, ``on_sample_end``, ``on_algorithm_init`` before the first iteration,
``on_train_result``) are reduced once per iteration into the result as ``callbacks/<key>``; values
logged during an evaluation (its episodes' ``on_episode_end``, ``on_evaluate_start`` / ``_end``) go
into the evaluation's metrics as ``evaluation/callbacks/<key>``. ``on_train_result`` and
``on_evaluate_end`` may also edit ``result`` / ``evaluation_metrics`` in place.

Stopping: a hook that sets ``result["should_stop"] = True`` in ``on_train_result`` ends the run: the
algorithm also sets Tune's ``done`` flag (Tune stops the trial) and the recipe loop
(`flashrl.recipes.run.train`) stops after that iteration.

Shipping: a class defined outside flashrl is sent to the actors by value (its module is registered
with Ray's cloudpickle, `ship_by_value`), so a class from ``__main__``, a notebook or a test file
needs no import in the actors; an import path is imported where it is used.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

from flashrl.user_code import UserCodeError, import_path

__all__ = [
    "CALLBACK_PREFIX",
    "EVALUATION_CALLBACK_PREFIX",
    "REDUCTIONS",
    "SHOULD_STOP",
    "DefaultCallbacks",
    "FlashReinforceCallbacks",
    "MetricsLogger",
    "callbacks_class_path",
    "make_callbacks",
    "resolve_callbacks_class",
    "ship_by_value",
]

CALLBACK_PREFIX = "callbacks/"
"""Where a training iteration's callback metrics appear in its result."""
EVALUATION_CALLBACK_PREFIX = "evaluation/callbacks/"
"""Where an evaluation's callback metrics appear in its metrics."""
SHOULD_STOP = "should_stop"
"""Result key a callback sets True to end the run (see the module docstring)."""
REDUCTIONS = ("mean", "sum", "min", "max")
"""How `MetricsLogger.log_value` reduces a key's values of one iteration to one number."""


class MetricsLogger:
    """Numbers logged under keys, reduced to one value per key (``reduce``) and cleared by `reduce()`.

    A key keeps the reduction it was first logged with; logging it again with another is an error.
    Values must be finite numbers (bools count as 0/1): anything else raises at the call that logged it.
    """

    def __init__(self) -> None:
        self._values: dict[str, tuple[str, list[float]]] = {}

    def log_value(self, key: str, value: Any, *, reduce: str = "mean") -> None:
        """Add ``value`` to ``key`` (reduced with ``reduce``, one of `REDUCTIONS`)."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"MetricsLogger.log_value: expected a non-empty str key, got {key!r}.")
        if reduce not in REDUCTIONS:
            raise ValueError(
                f"MetricsLogger.log_value({key!r}): expected reduce in {REDUCTIONS}, got {reduce!r}. "
                "Fix: use one of them."
            )
        number = _finite_number(key, value)
        kind, values = self._values.setdefault(key, (reduce, []))
        if kind != reduce:
            raise ValueError(
                f"MetricsLogger.log_value({key!r}): expected reduce={kind!r} (the key's first reduction), "
                f"got {reduce!r}. Fix: log it with one reduction, or use another key."
            )
        values.append(number)

    def log_dict(self, values: Mapping[str, Any], *, reduce: str = "mean") -> None:
        """`log_value` for each item of ``values``."""
        for key, value in values.items():
            self.log_value(key, value, reduce=reduce)

    def peek(self, key: str) -> float:
        """The reduced value of ``key`` now (not cleared); KeyError if nothing was logged under it."""
        kind, values = self._values[key]
        return _reduce(kind, values)

    def __len__(self) -> int:
        return len(self._values)

    def state(self) -> dict[str, tuple[str, list[float]]]:
        """The raw values (key -> (reduction, values)), for sending to another process; not cleared."""
        return {key: (kind, list(values)) for key, (kind, values) in self._values.items()}

    def merge(self, state: Mapping[str, tuple[str, list[float]]]) -> None:
        """Add another logger's `state()` (an EnvRunner's, received with its report)."""
        for key, (kind, values) in state.items():
            for value in values:
                self.log_value(key, value, reduce=kind)

    def reduce(self, prefix: str = "") -> dict[str, float]:
        """One value per key (``prefix + key``), and the logger starts empty again."""
        out = {prefix + key: _reduce(kind, values) for key, (kind, values) in self._values.items()}
        self._values.clear()
        return out


def _finite_number(key: str, value: Any) -> float:
    try:
        import numpy as np

        if isinstance(value, np.generic):
            value = value.item()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"MetricsLogger.log_value({key!r}): expected a finite number, got {value!r}. Fix: log a number "
            "(skip the value, or count the non-finite ones under their own key)."
        )
    return float(value)


def _reduce(kind: str, values: list[float]) -> float:
    if kind == "mean":
        return sum(values) / len(values)
    if kind == "sum":
        return float(sum(values))
    return float(min(values) if kind == "min" else max(values))


class FlashReinforceCallbacks:
    """Base class of user callbacks: every hook is a no-op. See the module docstring for when each runs.

    Hooks take keyword arguments only and must accept ``**kwargs`` (arguments may be added later).
    """

    # --- the algorithm's process --------------------------------------------------------------
    def on_algorithm_init(self, *, algorithm: Any, metrics_logger: MetricsLogger, **kwargs: Any) -> None:
        """The algorithm finished `setup()` (actors started); values logged here join iteration 1."""

    def on_train_result(
        self, *, algorithm: Any, metrics_logger: MetricsLogger, result: dict[str, Any], **kwargs: Any
    ) -> None:
        """An iteration's ``result`` is complete (TensorBoard and the console come after); edit it in
        place, set ``result["should_stop"] = True`` to stop. Also gets ``iteration`` (counted from 1)
        and ``episodes`` (the batch the learner trained on)."""

    def on_evaluate_start(self, *, algorithm: Any, metrics_logger: MetricsLogger, **kwargs: Any) -> None:
        """An evaluation begins (``metrics_logger`` is the evaluation's)."""

    def on_evaluate_end(
        self,
        *,
        algorithm: Any,
        metrics_logger: MetricsLogger,
        evaluation_metrics: dict[str, Any],
        **kwargs: Any,
    ) -> None:
        """An evaluation ended; ``evaluation_metrics`` may be edited in place. Also gets ``reports``
        (per split, the runners' reports: every scored episode)."""

    def on_checkpoint_loaded(self, *, algorithm: Any, **kwargs: Any) -> None:
        """The algorithm loaded a checkpoint (its learner state, cursors and books); gets ``path``."""

    # --- each EnvRunner actor -----------------------------------------------------------------
    def on_episode_end(
        self,
        *,
        episode: Any,
        env_runner: Any,
        metrics_logger: MetricsLogger,
        env: Any,
        env_index: int,
        **kwargs: Any,
    ) -> None:
        """An episode ended and passed the runner's checks (dropped ones are counted under
        ``env_runners/num_skipped_*`` instead). ``episode`` is the `flashrl.episode.Episode` (its
        ``info`` the last step's, plus the runner's ``episode_index``, ``replica``, ``runner_index``,
        ``duration_s``), ``env`` the env that played it, ``env_index`` its prompt index. Also gets
        ``is_evaluation`` and ``split`` (the evaluation split, None for training)."""

    def on_sample_end(
        self, *, env_runner: Any, metrics_logger: MetricsLogger, samples: list[Any], **kwargs: Any
    ) -> None:
        """The runner hands ``samples`` (finished episodes, mutable) to the algorithm: once per poll
        that delivers episodes (async mode) and once per ``sample()`` call (sync_group, evaluation).
        Also gets ``is_evaluation``."""


DefaultCallbacks = FlashReinforceCallbacks
"""RLlib's name of the no-op base class."""


def resolve_callbacks_class(value: Any) -> type[FlashReinforceCallbacks]:
    """The callbacks class of a setting: None (the no-op base), a subclass, or its import path.

    An import path is ``"package.module:Class"`` (or ``"package.module.Class"``). Raises TypeError /
    ValueError with the expected value and the fix.
    """
    if value is None:
        return FlashReinforceCallbacks
    cls = value
    if isinstance(value, str):
        cls = _import(value)
    if not (isinstance(cls, type) and issubclass(cls, FlashReinforceCallbacks)):
        raise TypeError(
            f"callbacks_class: expected None, a subclass of flashrl.callbacks.FlashReinforceCallbacks or its "
            f"import path 'package.module:Class', got {value!r}. Fix: subclass FlashReinforceCallbacks "
            "(alias DefaultCallbacks) and pass the class itself."
        )
    return cls


def _import(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"callbacks_class: expected an import path 'package.module:Class', got {path!r}. Fix: name the "
            "module and the class."
        )
    try:  # what a path may name: flashrl's and the user's own code (flashrl.user_code)
        return import_path(f"{module_name}:{attr}")
    except UserCodeError as err:
        raise ValueError(f"callbacks_class: expected the import path of your callbacks class, got {path!r}: {err}. "
                         "Fix: check the path, or pass the class itself.") from err


def make_callbacks(value: Any) -> FlashReinforceCallbacks:
    """An instance of the setting's callbacks class (`resolve_callbacks_class`), built with no arguments."""
    return resolve_callbacks_class(value)()


def callbacks_class_path(value: Any) -> str | None:
    """The setting as an import path (what a checkpoint's JSON config keeps), None for None.

    A class from ``__main__`` keeps the path ``"__main__:Class"``. A checkpoint's config is data: restoring
    imports no stored path (``flashrl.checkpoints.stored_code``), so pass the class again to
    `FlashReinforce.from_checkpoint(path, callbacks_class=...)` (or ``trust_config_code=True``).
    """
    if value is None or isinstance(value, str):
        return value
    return f"{value.__module__}:{value.__qualname__}"


def ship_by_value(value: Any) -> None:
    """Make Ray pickle the class's module by value, so actors and Tune trials need not import it.

    Ray's cloudpickle already sends ``__main__`` (and modules it cannot find) by value; a class of an
    importable module outside flashrl (a test file, a user's package not installed on the workers) is
    registered with ``ray.cloudpickle.register_pickle_by_value``. flashrl's own classes and import
    paths travel by reference. Idempotent.
    """
    if not isinstance(value, type):
        return
    name = value.__module__
    if name == "__main__" or name == "flashrl" or name.startswith("flashrl."):
        return
    module = sys.modules.get(name)
    if module is None:
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
