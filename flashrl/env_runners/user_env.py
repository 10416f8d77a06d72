"""The run's environment as the user gives it, made the same way in every process of the run.

``.environment(env=...)`` takes a Gymnasium id registered where the config is built, a
``gymnasium.Env`` subclass, or the subclass's ``"package.module:Class"`` path
(`flashrl.user_code.import_path`, with its refusals). The other processes of a run make the same env
without the user's script: a Ray Tune trial, which receives only the config's ``to_dict()``, and the
EnvRunner actors, which receive the driver's Gymnasium EnvSpec (``group._driver_env_spec``).

- `registered_id`: the Gymnasium id under which this process makes the env. An id comes back as it
  is; a class (a path's class) is registered under `class_env_id` (``module.Class``); an `EnvRef`'s
  EnvSpec is registered under its id. ``EnvRunnerSpec`` calls it when it is built, so everything past
  the config (the env checks, the runners) sees a registered id.
- `EnvRef`: what the config's ``to_dict()`` keeps for an id registered by user code, or for a path: a ``str``
  equal to what was given (it prints, compares and serializes as that text) that carries the
  driver's EnvSpec, its user-code entry point pickled by value (`flashrl.user_code.Shipped`). A Tune
  trial gets the env this way though ``gymnasium.register`` ran only in the user's script.
- `env_class`: the class of a class or a path, or `UserEnvError` saying expected, got and the fix;
  `env_problem`: the same as a problem line of a spec's checks (whether an id is registered is the
  config's to say: it knows flashrl's own ids).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, Self

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from flashrl.user_code import Shipped, UserCodeError, describe, import_path, is_path

__all__ = ["FORMS", "EnvRef", "UserEnvError", "class_env_id", "class_spec", "env_class", "env_problem",
           "is_flashrl_entry_point", "registered_id"]

FORMS = "a registered Gymnasium id (str), a gymnasium.Env subclass or its 'module:Class' path"
"""What the env setting takes, as error messages say it."""


class UserEnvError(ValueError):
    """An env setting that is neither a Gymnasium id nor an env class (or a path to one)."""


class EnvRef(str):
    """An env setting's text (a user-registered id, or a ``"module:Class"`` path) with the driver's EnvSpec.

    Equal to the text, and written as it in JSON and configs' text; pickled, it carries ``spec`` by value.
    """

    spec: EnvSpec

    def __new__(cls, text: str, spec: EnvSpec) -> Self:
        ref = super().__new__(cls, text)
        ref.spec = spec
        return ref

    def __reduce__(self) -> tuple[Any, tuple[str, Shipped]]:
        return _env_ref, (str(self), Shipped(self.spec))

    def __copy__(self) -> Self:
        return self  # immutable: a config's copy shares it, as it shares user code

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self


def _env_ref(text: str, spec: EnvSpec) -> EnvRef:
    return EnvRef(text, spec)


def class_env_id(cls: type) -> str:
    """The Gymnasium id an env class is registered under: ``module.Qualname`` (other characters as ``_``)."""
    return re.sub(r"[^\w.]", "_", f"{cls.__module__}.{cls.__qualname__}")


def class_spec(cls: type) -> EnvSpec:
    """The Gymnasium EnvSpec an env class is made from: id `class_env_id`, the class as its entry point."""
    return EnvSpec(id=class_env_id(cls), entry_point=cls)


def env_class(value: type | str) -> type[gym.Env]:
    """The env class ``value`` is or names (a ``"module:Class"`` path is imported); else `UserEnvError`."""
    where = ""
    if isinstance(value, str):
        try:
            target = import_path(value)
        except UserCodeError as err:
            raise UserEnvError(
                f"env: expected {FORMS}, got {value!r}, which is not a registered id and as a path fails: {err}. "
                "Fix: gymnasium.register the id before building the config, or give the path of an env class "
                "in a module of your own (or pass the class itself)"
            ) from err
        where = f" (the path {value!r})"
    else:
        target = value
    if not (isinstance(target, type) and issubclass(target, gym.Env)):
        raise UserEnvError(
            f"env: expected {FORMS}, got {describe(target)!r}{where}, which is not a gymnasium.Env subclass. Fix: "
            "pass a subclass of gymnasium.Env (e.g. of flashrl.envs.base.LanguageEnv), or its 'module:Class' path"
        )
    return target


def _names_class(env: Any) -> bool:
    """Whether ``env`` is given as a class or a class's path (not an id, not even one with a colon)."""
    return isinstance(env, type) or (isinstance(env, str) and not isinstance(env, EnvRef) and is_path(env)
                                     and env not in gym.registry)


def env_problem(env: Any) -> str | None:
    """What is wrong with the form of the env setting (expected, got, fix), or None."""
    if _names_class(env):
        try:
            env_class(env)
        except UserEnvError as err:
            return str(err)
        return None
    if isinstance(env, str) and env:
        return None
    return (f"env: expected {FORMS}, got {describe(env)!r}. Fix: call .environment('flashrl/Math-v0'), or "
            ".environment(MyEnv) with your env class")


def registered_id(env: Any) -> Any:
    """The Gymnasium id under which this process makes ``env``; registers a class, a path's class or an
    `EnvRef`'s spec here. An id (registered or not), None or any other value comes back as it is, for the
    config's checks to report; a path or class that is not an env class raises `UserEnvError`."""
    if isinstance(env, EnvRef):
        if env.spec.id not in gym.registry:  # a Tune trial: the id was registered in the user's script only
            gym.registry[env.spec.id] = env.spec
        return env.spec.id
    if _names_class(env):
        spec = class_spec(env_class(env))
        if gym.registry.get(spec.id) != spec:  # a class redefined under the same name replaces the old one
            gym.registry[spec.id] = spec
        return spec.id
    return env


def entry_point(env_id: str) -> Callable[..., Any] | None:
    """The registered entry point of ``env_id`` (a ``"module:name"`` path imported), or None when the id is
    not registered or its entry point does not load (reported where the id is checked, or by ``gym.make``)."""
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


def is_flashrl_entry_point(entry_point: Any) -> bool:
    """Whether a Gymnasium entry point (a ``"module:name"`` path or an object) is flashrl's own."""
    module = entry_point.partition(":")[0] if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")
    return module == "flashrl" or str(module).startswith("flashrl.")
