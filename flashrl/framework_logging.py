"""How loud vLLM and Ray are in a run's console: their log level, and the known-harmless warnings dropped.

One setting, ``framework_log_level`` (reporting section; default ``"WARNING"``), decides:

- the driver's Ray logger (``ray.init(logging_level=...)``), unless ``RAY_LOGGER_LEVEL`` is set;
- every vLLM process the run starts (the EnvRunner actor hosting ``AsyncLLM``, its engine core and
  worker children): vLLM's ``LoggingConfig(log_level=...)`` engine argument, with a ``dictConfig``
  file (`vllm_logging_config`) that attaches `HarmlessLogFilter` to the loggers that emit the listed
  messages. An explicit ``VLLM_LOGGING_LEVEL`` (or ``VLLM_LOGGING_CONFIG_PATH``) in the actor's
  environment wins: flashrl then leaves vLLM's logging as vLLM configures it;
- at ``WARNING`` or above, the listed messages (`HARMLESS_LOG_RECORDS`, `HARMLESS_WARNINGS`) are
  dropped by exact-message filters, never by a blanket ignore; at ``INFO``/``DEBUG`` nothing is dropped.

``None`` leaves vLLM's and Ray's logging entirely as they configure it. docs/runtime.md ("The console")
lists each filtered message and why it is harmless.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The values ``framework_log_level`` takes (besides None)."""


@dataclass(frozen=True)
class Harmless:
    """One known-harmless message: where it comes from, the regex of its text, and why it may go."""

    source: str
    """A logger name (a log record) or a warning category's name (a Python warning)."""
    pattern: str
    """Regular expression matched (``re.match``) against the start of the message."""
    why: str
    """Why the message says nothing a user of flashrl must act on."""


HARMLESS_LOG_RECORDS: tuple[Harmless, ...] = (
    Harmless("vllm.triton_utils.importing", r"Triton is installed, but doesn't include CPU backend\. Disabling Triton\.$",
             "vLLM's CPU build runs without Triton; the package comes with torch."),
    Harmless("vllm.platforms.cpu", r"Triton is not installed\. triton-cpu is expected on x86 CPUs\.$",
             "the same fact, said again by the CPU platform."),
    Harmless("vllm.config.vllm", r"Model Runner V2 requires Triton; using the V1 model runner instead\.$",
             "the V1 model runner is the one the CPU build supports."),
    Harmless("vllm.engine.arg_utils", r"This model does not officially support disabling chunked prefill\.",
             "flashrl turns chunked prefill off on CPU on purpose (seeded requests; flashrl.engines.vllm_engine)."),
    Harmless("vllm.config.vllm", r"Enforce eager set, disabling torch\.compile, CUDAGraphs, and JIT kernel warmup\.",
             "flashrl sets enforce_eager on CPU on purpose (fast start)."),
    Harmless("vllm.config.vllm", r"Inductor compilation was disabled by user settings",
             "follows from enforce_eager."),
    Harmless("vllm.utils.ompmultiprocessing", r"VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement",
             "flashrl reserves no core on purpose so that the engine uses every core it may (cpu_thread_defaults)."),
    Harmless("vllm.v1.worker.cpu_worker", r"(libtcmalloc|libiomp) is not found in LD_PRELOAD\.",
             "a speed hint for a tuned install (LD_PRELOAD); results do not change."),
    Harmless("vllm.utils.torch_utils", r"OMP_NUM_THREADS=\d+ is set; leaving Torch threads at \d+ for serving\.",
             "a speed hint; flashrl binds vLLM's OpenMP threads to every core the actor may use on purpose."),
    Harmless("vllm.v1.engine.input_processor", r"Passing raw prompts to InputProcessor is deprecated",
             "flashrl passes token ids ({'prompt_token_ids': ...}), which vLLM 0.32 accepts; pinned vLLM."),
    Harmless("ray._private.authentication.authentication_token_setup",
             r"Token authentication is enabled for this Ray cluster\.",
             "says that the local cluster uses the secure default (its 'disabled' counterpart is kept)."),
)
"""Log records dropped at ``framework_log_level`` WARNING or above (seen when starting the tuned examples)."""

HARMLESS_WARNINGS: tuple[Harmless, ...] = (
    Harmless("FutureWarning", r"`torch\.distributed\.reduce_op` is deprecated, please use `torch\.distributed\.ReduceOp`",
             "raised inside vLLM's Triton dispatcher when it inspects torch.distributed; nothing of flashrl's."),
)
"""Python warnings dropped at ``framework_log_level`` WARNING or above."""

_PYTHONWARNINGS_TEXT = {
    r"`torch\.distributed\.reduce_op` is deprecated, please use `torch\.distributed\.ReduceOp`":
        "`torch.distributed.reduce_op` is deprecated",
}
"""Each Python warning's literal start, for ``PYTHONWARNINGS`` (vLLM's child processes start with it)."""


def valid_level(value: Any) -> bool:
    """Whether ``value`` is a ``framework_log_level``: None or a level name of `LEVELS` (any case)."""
    return value is None or (isinstance(value, str) and value.upper() in LEVELS)


def filters_on(level: str | None) -> bool:
    """Whether the listed messages are dropped at this level (WARNING or above)."""
    return level is not None and logging.getLevelName(level.upper()) >= logging.WARNING


class HarmlessLogFilter(logging.Filter):
    """Drops the log records of `HARMLESS_LOG_RECORDS` (below ERROR; any other record passes)."""

    def __init__(self, records: tuple[Harmless, ...] = HARMLESS_LOG_RECORDS) -> None:
        super().__init__()
        self._patterns: dict[str, list[re.Pattern[str]]] = {}
        for item in records:
            self._patterns.setdefault(item.source, []).append(re.compile(item.pattern))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        patterns = self._patterns.get(record.name, ())
        return not any(p.match(record.getMessage()) for p in patterns)


def install_filters() -> None:
    """Drop the listed log records and Python warnings in this process (idempotent)."""
    log_filter = HarmlessLogFilter()
    for name in {item.source for item in HARMLESS_LOG_RECORDS}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, HarmlessLogFilter) for f in logger.filters):
            logger.addFilter(log_filter)
    for item in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=item.pattern, category=_category(item.source))


def child_pythonwarnings(current: str | None) -> str:
    """``PYTHONWARNINGS`` for processes started from this one: ``current`` plus the listed warnings."""
    entries = [f"ignore:{_PYTHONWARNINGS_TEXT[item.pattern]}:{item.source}" for item in HARMLESS_WARNINGS]
    kept = [entry for entry in (current or "").split(",") if entry and entry not in entries]
    return ",".join(kept + entries)


def _category(name: str) -> type[Warning]:
    category = getattr(builtins, name, None)
    if not (isinstance(category, type) and issubclass(category, Warning)):
        raise TypeError(f"HARMLESS_WARNINGS: expected a built-in Warning class name, got {name!r}")
    return category


def ray_logging_level(level: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """``ray.init(logging_level=...)`` for the driver: None when the user set ``RAY_LOGGER_LEVEL`` or level is None."""
    if level is None or "RAY_LOGGER_LEVEL" in environ:
        return None
    return level.upper()


def configure_driver(level: str | None) -> None:
    """The driver's side: filters (at WARNING or above) and the Ray logger's level."""
    if filters_on(level):
        install_filters()
    ray_level = ray_logging_level(level)
    if ray_level is not None:
        logging.getLogger("ray").setLevel(ray_level)


def vllm_logging_config(level: str) -> dict[str, Any]:
    """vLLM's default ``dictConfig`` at ``level``, with `HarmlessLogFilter` on the listed vLLM loggers
    when `filters_on` (what vLLM applies in every process it starts)."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    level = level.upper()
    config = json.loads(json.dumps(DEFAULT_LOGGING_CONFIG))
    for formatter in config["formatters"].values():
        formatter["log_level"] = level
    config["handlers"]["vllm"]["level"] = level
    config["loggers"]["vllm"]["level"] = level
    if filters_on(level):
        config["filters"] = {"flashrl_harmless": {"()": f"{__name__}.HarmlessLogFilter"}}
        for name in sorted({item.source for item in HARMLESS_LOG_RECORDS if item.source.startswith("vllm.")}):
            config["loggers"][name] = {"filters": ["flashrl_harmless"]}
    return config


def vllm_level(level: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """vLLM's level in a process with ``environ``: an explicit ``VLLM_LOGGING_LEVEL`` wins over ``level``;
    None (flashrl leaves vLLM's logging alone) when ``level`` is None or ``VLLM_LOGGING_CONFIG_PATH`` is set."""
    if level is None or "VLLM_LOGGING_CONFIG_PATH" in environ:
        return None
    return environ.get("VLLM_LOGGING_LEVEL", level).upper()


def vllm_logging_args(level: str | None, environ: MutableMapping[str, str] = os.environ) -> dict[str, Any]:
    """The engine arguments (``logging_config``) that set vLLM's logging; ``{}`` to leave it as vLLM does.

    The level is `vllm_level`'s. At WARNING or above the filters are installed in this process first
    (some messages come while vLLM is imported), and ``PYTHONWARNINGS`` in ``environ`` gains the listed
    Python warnings (vLLM's child processes start with it). The ``dictConfig`` is written once per
    level to a file in the temporary folder: vLLM's child processes read it by path.
    """
    level = vllm_level(level, environ)
    if level is None:
        return {}
    if filters_on(level):
        install_filters()
        environ["PYTHONWARNINGS"] = child_pythonwarnings(environ.get("PYTHONWARNINGS"))
    from vllm.config.logging import LoggingConfig

    text = json.dumps(vllm_logging_config(level), indent=1, sort_keys=True)
    path = Path(tempfile.gettempdir()) / f"flashrl-vllm-logging-{level.lower()}-{os.getuid()}.json"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        fd, staging = tempfile.mkstemp(dir=path.parent, suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(staging, path)  # atomic: another runner on this node may read it meanwhile
    args: dict[str, Any] = {"logging_config": LoggingConfig(log_level=level, pylogging_config_file=str(path))}
    if filters_on(level):
        args["use_tqdm_on_load"] = False  # the checkpoint-loading progress bar, a tqdm of its own
    return args
