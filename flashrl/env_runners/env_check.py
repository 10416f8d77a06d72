"""Checks of an environment's settings in the driver, before any actor starts.

A typo in ``env_config`` (``{"presset": 1}``) or a value of the wrong kind (``sandbox`` given as a
dict) is a deterministic error: inside an EnvRunner actor it would look like a crash and be
restarted over and over, each time starting an engine again. So the driver checks it first:

- ``env_config_problems``: every key of an ``env_config`` against the signature of the env's entry
  point (cheap; no env is built), with the closest valid name;
- ``build_env_once``: makes one env with the given ``env_config``, resets it once, steps it once with
  a throwaway reply (`CHECK_ACTION`) and closes it, each call within ``env_timeout_s`` as in the
  runners (a call that hangs is an ``EnvCheckError`` naming the call and the setting, not a setup
  that never returns), and turns any error into an ``EnvCheckError`` that
  names the env, the settings and the cause with the innermost frames of its traceback (a reward
  function that raises, or one given as a plain string to an env that expects a callable, fails
  here, not as thousands of dropped episodes in the runners);
- ``env_code_problems``: the user code of the env (its entry point; constructor arguments the env
  declares as code in ``code_arguments``, such as Math's ``reward_fn``) shipped and unpacked as the
  runners receive it (``runner_env_spec``, ``runner_spec``: paths imported in the driver, objects
  pickled by value, ``flashrl.user_code``), so a module the runners cannot import is no problem.

Both read the Gymnasium EnvSpec registered in this process (the runners make their envs from the
same spec), so the core never imports the env modules themselves.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym

from flashrl.env_runners.spec import EnvRunnerSpec
from flashrl.env_runners.user_env import entry_point as _entry_point
from flashrl.user_code import (
    UserCodeError,
    describe,
    import_path,
    is_description,
    is_path,
    is_user_module,
    roundtrip,
)

__all__ = ["EnvCheckError", "build_env_once", "env_code_problems", "env_config_problems", "runner_env_spec",
           "runner_spec"]


class EnvCheckError(ValueError):
    """An environment that cannot be built, reset or stepped with the run's settings."""


CHECK_ACTION = "0"
"""The reply `build_env_once` steps the env with: short, plain text that any env must score (a reward
of 0 is expected), so that a reward function or a tool that raises does so before the run starts."""


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


class _Hung(Exception):
    """An env call of the check ran past its time limit (it goes on in its daemon thread)."""


def _within(timeout_s: float | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread within ``timeout_s`` (None: no limit); raises `_Hung`
    past it, or what ``fn`` raised. A Python thread cannot be killed: a daemon one at least does not keep
    the process alive once the check has failed."""
    if timeout_s is None:
        return fn(*args, **kwargs)
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = err

    thread = threading.Thread(target=call, name="flashrl-env-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Hung
    if "error" in result:
        raise result["error"]
    return result.get("value")


def build_env_once(
    env_id: str, env_config: Mapping[str, Any], *, what: str = "env_config", seed: int = 0,
    timeout_s: float | None = None,
) -> int | None:
    """Make, reset, step (once, with `CHECK_ACTION`) and close one env; an error in any of them is an
    ``EnvCheckError`` quoting the cause's traceback (its innermost frames: the env's own code).

    ``timeout_s``: the time limit of each call (the run's ``env_timeout_s``; None: none); a call past it
    is an ``EnvCheckError`` too. Returns the env's finite task count (`finite_task_count`: what the data
    passes walk), or None.
    """
    from flashrl.env_runners.env_errors import EnvBoundary, user_traceback
    from flashrl.env_runners.rollout import finite_task_count

    def hung(call: str) -> EnvCheckError:
        return EnvCheckError(
            f"{what}: expected {env_id}'s {call} to return within env_timeout_s={timeout_s:g} s, got a call still "
            f"running (with {dict(env_config)!r}); the runners would drop every episode as env_timeout. Fix: find "
            f"where the env's {call} blocks (a lock, a network call, an endless loop), or raise env_timeout_s if "
            "it is only slow."
        )

    try:
        env = _within(timeout_s, gym.make, env_id, **dict(env_config))
    except _Hung:
        raise hung("constructor") from None
    except Exception as err:  # any constructor error is the user's setting to fix
        raise EnvCheckError(
            f"{what}: expected settings with which {env_id} can be built, got {dict(env_config)!r}; building it "
            f"raised {type(err).__name__}: {err}. Fix: correct {what} (the env's docstring lists its arguments)."
        ) from err
    env = EnvBoundary(env)  # text the runners' tokenizer cannot encode fails here too
    call, hanging = "reset", False
    try:
        _within(timeout_s, env.reset, seed=seed)
        count = finite_task_count(env)
        call = f"step({CHECK_ACTION!r})"
        _within(timeout_s, env.step, CHECK_ACTION)
        call = "close()"
        return count
    except _Hung:
        hanging = True  # the env is still in use by the hung call: no close (it could hang too)
        raise hung(call) from None
    except Exception as err:  # as above, for the first reset and step
        raise EnvCheckError(
            f"{what}: expected an env that resets and steps, got {env_id} with {dict(env_config)!r}, whose "
            f"{call} raised {type(err).__name__}: {err}\n{user_traceback(err)}\nFix: correct {what}, the env's "
            "code (e.g. its reward function) or its data."
        ) from err
    finally:
        if not hanging:
            try:
                _within(timeout_s, env.close)
            except _Hung:
                raise hung("close()") from None


def code_arguments(env_id: str) -> tuple[str, ...]:
    """The constructor arguments the env takes as user code (its class's ``code_arguments``)."""
    entry = _entry_point(env_id)
    return tuple(getattr(entry, "code_arguments", ()))


def _resolved(env_config: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``env_config`` with each code argument given as a ``"module:name"`` path imported (in the driver)."""
    return {key: import_path(value) if key in names and is_path(value) else value for key, value in env_config.items()}


def runner_spec(spec: EnvRunnerSpec) -> EnvRunnerSpec:
    """The spec the runners get: code arguments of every env config given as paths imported here.

    Wrapped in ``flashrl.user_code.Shipped`` it reaches the runners with that code by value.
    """
    names = code_arguments(spec.env) if spec.env else ()
    if not names:
        return spec
    return dataclasses.replace(
        spec,
        env_config=_resolved(spec.env_config, names),
        evaluation_env_config=_resolved(spec.evaluation_env_config, names),
        evaluation_splits={split: _resolved(overrides, names) for split, overrides in spec.evaluation_splits.items()},
    )


def runner_env_spec(env_id: str) -> Any:
    """The driver's Gymnasium EnvSpec of ``env_id`` with a user-code ``"module:Class"`` entry point imported.

    flashrl's own entry points stay strings (every runner imports flashrl); a user's is imported in the
    driver, so that, shipped by value, it makes the env where its module does not import. That includes
    ``"__main__:Class"`` (a script registering its own class by name): a runner's ``__main__`` is not the
    script, so the name would not resolve there.
    """
    env_spec = gym.spec(env_id)
    entry = env_spec.entry_point
    if isinstance(entry, str) and ":" in entry:
        module = entry.partition(":")[0]
        if not (module == "flashrl" or module.startswith("flashrl.")):
            loaded = import_path(entry)
            if module in ("__main__", "__mp_main__") or is_user_module(importlib.import_module(module)):
                return dataclasses.replace(env_spec, entry_point=loaded)
    return env_spec


def env_code_problems(spec: EnvRunnerSpec) -> list[str]:
    """The env's user code as the runners receive it: every problem as ``expected, got, Fix``."""
    if not spec.env:
        return []
    problems = []
    try:
        roundtrip(runner_env_spec(spec.env))
    except gym.error.Error:
        return []  # an unregistered id is reported where the id is checked
    except UserCodeError as err:
        problems.append(f"env: expected an entry point that the env runners can receive (imported in the driver "
                        f"and pickled by value), got {gym.spec(spec.env).entry_point!r}: {err}. Fix: register the "
                        "env with an importable 'module:Class' entry point or a class defined at module level")
    names = code_arguments(spec.env)
    configs = {"env_config": spec.env_config, "evaluation_env_config": spec.evaluation_env_config,
               **{f"evaluation_splits[{split!r}]": o for split, o in spec.evaluation_splits.items()}}
    for where, env_config in configs.items():
        for key in names:
            if key in env_config and env_config[key] is not None:
                problem = _code_problem(env_config[key])
                if problem:
                    problems.append(f"{where}[{key!r}]: expected a callable or its 'module:name' path (user code of "
                                    f"{spec.env}), got {describe(env_config[key])!r}: {problem}")
    return problems


def _code_problem(value: Any) -> str | None:
    if is_description(value):
        return ("the text to_dict() writes for an object, not the object. Fix: pass the function again (e.g. "
                "an override of from_checkpoint), or configure it by its 'module:name' path")
    try:
        target = import_path(value) if isinstance(value, str) else value
        if not callable(target):
            return "it is not callable. Fix: pass a function or a 'module:name' path to one"
        roundtrip(target)
    except UserCodeError as err:
        return f"{err}. Fix: pass a function defined at module level, or fix the path"
    return None
