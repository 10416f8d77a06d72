"""Checks of an environment's settings in the driver, before any actor starts.

A typo in ``env_config`` (``{"presset": 1}``) or a value of the wrong kind (``sandbox`` given as a
dict) is a deterministic error: inside an EnvRunner actor it would look like a crash and be
restarted over and over, each time starting an engine again. So the driver checks it first:

- ``env_config_problems``: every key of an ``env_config`` against the signature of the env's entry
  point (cheap; no env is built), with the closest valid name;
- ``build_env_once``: makes one env with the given ``env_config``, resets it once and closes it, and
  turns any error into an ``EnvCheckError`` that names the env, the settings and the cause.

Both read the Gymnasium EnvSpec registered in this process (the runners make their envs from the
same spec), so the core never imports the env modules themselves.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym

__all__ = ["EnvCheckError", "build_env_once", "env_config_problems"]


class EnvCheckError(ValueError):
    """An environment that cannot be built or reset with the run's settings."""


def _entry_point(env_id: str) -> Callable[..., Any] | None:
    try:
        spec = gym.spec(env_id)
    except gym.error.Error:
        return None  # an unregistered id is reported where the id is checked
    entry = spec.entry_point
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None  # an entry point that does not load fails in build_env_once with its own error
    return entry


def env_config_problems(env_id: str, env_config: Mapping[str, Any], *, name: str = "env_config") -> list[str]:
    """Keys of ``env_config`` the env's constructor does not take, each with the closest one it does."""
    entry = _entry_point(env_id)
    if entry is None:
        return []
    target = entry.__init__ if inspect.isclass(entry) else entry
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []  # the constructor takes any keyword
    accepted = [k for k, p in parameters.items() if k != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    problems = []
    for key in env_config:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(
                f"{name}: expected keyword arguments of {env_id}'s constructor ({', '.join(sorted(accepted))}), got "
                f"{key!r}. Fix: {hint}rename or remove it"
            )
    return problems


def build_env_once(
    env_id: str, env_config: Mapping[str, Any], *, what: str = "env_config", seed: int = 0
) -> int | None:
    """Make, reset and close one env; an error in any of them is an ``EnvCheckError``.

    Returns the env's finite task count (`finite_task_count`: what the data passes walk), or None.
    """
    from flashrl.env_runners.rollout import finite_task_count

    try:
        env = gym.make(env_id, **dict(env_config))
    except Exception as err:  # noqa: BLE001 - any constructor error is the user's setting to fix
        raise EnvCheckError(
            f"{what}: expected settings with which {env_id} can be built, got {dict(env_config)!r}; building it "
            f"raised {type(err).__name__}: {err}. Fix: correct {what} (the env's docstring lists its arguments)."
        ) from err
    try:
        env.reset(seed=seed)
        return finite_task_count(env)
    except Exception as err:  # noqa: BLE001 - as above, for the first reset
        raise EnvCheckError(
            f"{what}: expected an env that resets, got {env_id} with {dict(env_config)!r}, whose reset raised "
            f"{type(err).__name__}: {err}. Fix: correct {what} or the env's data."
        ) from err
    finally:
        env.close()
