"""A checkpoint's config is data: the settings in it that name code, refused unless passed again or trusted.

A checkpoint folder may come from someone else (``docs/agents.md``, "Security"), and its ``config.json``
is text anyone can write. Some settings hold code, not only data: a ``"module:name"`` path (a loss
component, a reward function, an agent, an env class, the callbacks class) is imported, an Agent-v0
``command`` is run, vLLM's ``engine_args`` import class paths. Restoring such a value would run what the
file names, so restoring (``FlashReinforce.from_checkpoint``, ``flashrl eval <checkpoint>``) brings none
back: the user passes the setting again (their own code, like Hugging Face's ``trust_remote_code``
default), or opts in for a checkpoint they trust, and otherwise `UntrustedCodeError` names each one.

Which settings hold code is declared where each setting is, ``setting(..., code=<kind>)``
(``flashrl.validation.CODE_KINDS`` says how each kind names code), and an env declares its own
code-bearing constructor arguments (``LanguageEnv.code_arguments`` and ``command_arguments``), so a new
one cannot be forgotten here. Nothing is imported to decide: a stored env given as a path is code
itself, and only an env registered in this process (by code) or passed again is asked what it declares.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flashrl.checkpoints.files import CheckpointError
from flashrl.user_code import is_description, is_path
from flashrl.validation import CODE

__all__ = ["StoredCode", "UntrustedCodeError", "find_stored_code", "refuse_stored_code"]

IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""A ``"package.module:name"`` path as ``flashrl.user_code.import_path`` takes it (in keyword arguments,
where other text with a colon, a URL or ``file.jsonl:3``, is data)."""
SHOWN_CHARS = 200
"""How much of a stored value the error quotes (its repr: control characters escaped)."""


@dataclass(frozen=True)
class StoredCode:
    """One stored value that names code: where it is (``env_config['command']``) and what it is."""

    setting: str
    value: Any

    def __str__(self) -> str:
        shown = repr(self.value)
        return f"{self.setting} = {shown[:SHOWN_CHARS]}{' ...' if len(shown) > SHOWN_CHARS else ''}"


class UntrustedCodeError(CheckpointError):
    """A checkpoint's config names code that restoring would run or import; ``found`` lists each value."""

    def __init__(self, path: str, found: list[StoredCode], fix: str) -> None:
        self.path = path
        self.found = found
        lines = "".join(f"\n  - {item}" for item in found)
        super().__init__(
            f"{path}: expected a checkpoint config of plain data, got {len(found)} stored value(s) in its "
            f"config.json that name code, which restoring never runs or imports on its own (a checkpoint folder may come from "
            f"someone else):{lines}\nFix: {fix}"
        )


def find_stored_code(stored: Mapping[str, Any], spec_classes: Iterable[type], *, env: Any = None) -> list[StoredCode]:
    """Every value of ``stored`` (settings by name) that names code, by the ``code`` marking of the fields of
    ``spec_classes`` that declare them; ``env`` is the env the run will make (judges ``env_config`` keys)."""
    found: list[StoredCode] = []
    for cls in spec_classes:
        for f in dataclasses.fields(cls):
            kind = f.metadata.get(CODE)
            if not kind or f.name not in stored:
                continue
            found += _FINDERS[kind](f.name, stored[f.name], env)
    return found


def refuse_stored_code(path: str, stored: Mapping[str, Any], spec_classes: Iterable[type], *, env: Any,
                       fix: str) -> None:
    """`UntrustedCodeError` naming each code-bearing value of ``stored`` (`find_stored_code`), if any."""
    found = find_stored_code(stored, spec_classes, env=env)
    if found:
        raise UntrustedCodeError(path, found, fix)


def _paths(name: str, value: Any, *, strict: bool = False) -> list[StoredCode]:
    """Every ``"module:name"`` string in ``value`` (nested lists and dicts walked), labelled by where it is."""
    if isinstance(value, str):
        named = IMPORT_PATH.fullmatch(value) if strict else is_path(value)
        return [StoredCode(name, value)] if named else []
    if isinstance(value, Mapping):
        return [item for key, v in value.items() for item in _paths(f"{name}[{key!r}]", v, strict=strict)]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in _paths(f"{name}[{i}]", v, strict=strict)]
    return []


def _path(name: str, value: Any, env: Any) -> list[StoredCode]:
    return _paths(name, value)


def _import(name: str, value: Any, env: Any) -> list[StoredCode]:
    return [StoredCode(name, value)] if isinstance(value, str) and value and not is_description(value) else []


def _env_config(name: str, value: Any, env: Any) -> list[StoredCode]:
    if not isinstance(value, Mapping):
        return []
    declared = _declared_arguments(env)
    found = []
    for key, v in value.items():
        if key in declared and v is not None and not is_description(v):
            found.append(StoredCode(f"{name}[{key!r}]", v))  # a command, a function's path
        else:
            found += _paths(f"{name}[{key!r}]", v, strict=True)
    return found


def _env_configs(name: str, value: Any, env: Any) -> list[StoredCode]:
    if not isinstance(value, Mapping):
        return []
    return [item for key, v in value.items() for item in _env_config(f"{name}[{key!r}]", v, env)]


def _engine_options(name: str, value: Any, env: Any) -> list[StoredCode]:
    args = value.get("engine_args") if isinstance(value, Mapping) else None
    return [StoredCode(f"{name}['engine_args']", args)] if args else []


def _passthrough(name: str, value: Any, env: Any) -> list[StoredCode]:
    return [StoredCode(name, value)] if value else []


_FINDERS = {"path": _path, "import": _import, "env_config": _env_config, "env_configs": _env_configs,
            "engine_options": _engine_options, "passthrough": _passthrough}
"""``code`` kind (``flashrl.validation.CODE_KINDS``) -> the values of such a setting that name code."""


def _declared_arguments(env: Any) -> tuple[str, ...]:
    """The constructor arguments ``env`` declares as code (``code_arguments``, ``command_arguments``).

    ``env`` is a class, an id registered in this process (by code: its entry point is imported as making
    the env would), or anything else (a stored class path, which is code itself and is not imported; an
    unknown id): no declared arguments, and only ``"module:name"`` strings count.
    """
    entry = env
    if isinstance(env, str):
        import gymnasium

        spec = gymnasium.registry.get(env)
        entry = spec.entry_point if spec is not None else None
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            try:
                entry = getattr(importlib.import_module(module), attribute)
            except (ImportError, AttributeError):
                entry = None  # making the env fails with its own error
    return (*getattr(entry, "code_arguments", ()), *getattr(entry, "command_arguments", ()))
