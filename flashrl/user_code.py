"""User code in a run: components given as objects or ``"package.module:name"`` paths, shipped by value.

A run's pluggable pieces (a loss component, a reward function, an environment class) are configured
in the driver but run in other processes: the learner actors, the EnvRunner actors. Ray pickles a
function or class defined in ``__main__`` *by value* (its code travels) and one defined in any other
module *by reference* (the other process imports the module), so a component written in a user's
own module (a test file, a script's helper module, a notebook's file) would only work where that
module is importable. This module applies Ray's ``__main__`` convention to every module of user
code, as Ray's own ``cloudpickle`` does for modules registered with ``register_pickle_by_value``:

- :func:`import_path` resolves ``"package.module:name"`` (``name`` may be dotted: ``Class.attr``), with
  an error that says what did not import; a path into the standard library is refused (below);
- :func:`dumps` pickles with cloudpickle, every module of user code in ``sys.modules`` pickled by
  value for the duration of the call: its functions and classes travel as code, and everything they
  use from flashrl, the standard library or installed packages is imported at the other end;
- :class:`Shipped` wraps an object so that pickling it (as Ray does for an actor's arguments) ships
  it by value, and unpickling gives back the object itself;
- :func:`describe` is the plain-text form of a value for configs and checkpoints: a name or a path as
  it is, an object as ``"<object module:qualname>"`` (the object itself cannot be stored as text).

"User code" is any module that is not part of flashrl, not in the standard library and not installed
under the interpreter's ``site-packages``; such installed packages are assumed importable in the
actors (they run in the same environment), as Ray assumes.

**What a path may name.** A path is text, and text may come from someone else (a config file, a
checkpoint's ``config.json``, a Tune search space), so it may only name code that the user chose to run
(``docs/extending.md``, "What a path may name"). :func:`import_path` resolves a path to an object that is
*defined* (its ``__module__``; for an instance, its class's) in

1. flashrl itself, or
2. a module of user code (:func:`is_user_module`: a file that is neither standard library nor installed
   in ``site-packages``; ``__main__`` too),

and to an object of an installed third-party package only when the user's *code* opts in
(:func:`trust_installed`: ``trust_installed("sympy")``, for the process; or ``import_path(...,
trusted=("sympy",))``), never a setting, so no config text can widen it; or when the path is exactly
the entry point of an env registered with Gymnasium (registered by code, a package's or the user's; a
config may name that env by its id anyway, which makes the same class). The standard library is never
reachable by a path. An object passed itself (``reward_fn=sympy.expand``) is always accepted: the code
that passes it is the user's. Otherwise ``reward_fn="sympy:expand"`` would evaluate each model reply as
Python in the EnvRunner, outside the sandbox, and ``"os:system"`` would run it in a shell.

The check is on where an object is defined, not where the path finds it, so a re-export is refused
(``"mymod:expand"`` after ``from sympy import expand`` in ``mymod``), and so is a dotted walk through a
module that is not allowed (``"mymod:sympy.expand"``, ``"flashrl.user_code:os.system"``) or through a
dunder attribute (``"mymod:f.__globals__"``). An installed package is refused *before* it is imported
(its top-level name is located, not run), so a path cannot run a package's import-time code either.
A user's own function that calls the standard library or sympy is user code like any other.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import sysconfig
import threading
import types
from collections.abc import Collection
from typing import Any, Literal

__all__ = ["Shipped", "UserCodeError", "describe", "dumps", "import_path", "is_description", "is_path",
           "is_user_module", "loads", "roundtrip", "trust_installed"]

OBJECT_PREFIX = "<object "


class UserCodeError(ValueError):
    """A path that does not import, or an object that cannot be shipped to the actors."""


def is_path(value: Any) -> bool:
    """Whether ``value`` is written as an import path ``"package.module:name"``."""
    return isinstance(value, str) and ":" in value and not is_description(value)


def is_description(value: Any) -> bool:
    """Whether ``value`` is the ``"<object module:qualname>"`` text :func:`describe` writes for an object."""
    return isinstance(value, str) and value.startswith(OBJECT_PREFIX) and value.endswith(">")


_TRUSTED: set[str] = set()
"""Top-level names of installed packages that paths may name in this process (`trust_installed`)."""


def trust_installed(*packages: str) -> None:
    """Let ``"module:name"`` paths in this process name objects of these installed packages (top-level names).

    Call it in your own code (a script, a notebook), never from a setting: a config's text cannot opt in.
    The driver resolves paths before it ships them, so one call in the driver script is enough::

        trust_installed("sympy")   # now reward_fn="my_rewards:score" may be sympy's, if you mean it
    """
    for package in packages:
        if not isinstance(package, str) or not package.isidentifier():
            raise UserCodeError(f"trust_installed: expected the top-level name of an installed package (e.g. "
                                f"'sympy'), got {package!r}. Fix: pass the name as imported, without dots")
        if package in sys.stdlib_module_names or package == "flashrl":
            raise UserCodeError(f"trust_installed: expected an installed third-party package, got {package!r}, "
                                "which is the standard library or flashrl. Fix: paths never name the standard "
                                "library; pass the object itself, or write a function of your own that calls it")
        _TRUSTED.add(package)


def import_path(path: str, *, trusted: Collection[str] = ()) -> Any:
    """The object at ``"package.module:name"`` (``name`` may be dotted); `UserCodeError` if it does not
    import or names code a path may not name (the module docstring: flashrl's or the user's own code;
    an installed package only when in ``trusted`` or :func:`trust_installed`)."""
    module_name, _, attribute = path.partition(":")
    parts = attribute.split(".")
    if not module_name or not all(p.isidentifier() for p in module_name.split(".") + parts):
        raise UserCodeError(f"expected an import path 'package.module:name', got {path!r}")
    allowed = _TRUSTED.union(trusted)
    if _registered_entry_point(path):
        allowed.add(module_name.partition(".")[0])
    _check_origin(module_name, _located_origin(module_name.partition(".")[0]), path, allowed)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # any import error is the path's to fix
        raise UserCodeError(f"the module {module_name!r} of {path!r} does not import ({type(err).__name__}: "
                            f"{err})") from err
    _check_origin(module_name, _module_origin(target), path, allowed)
    for i, part in enumerate(parts):
        where = ".".join([module_name, *parts[:i]])
        if part.startswith("__"):
            raise UserCodeError(f"the path {path!r} walks through {part!r}: expected public or _private names of "
                                "user code, got a dunder or mangled attribute, which can reach any module's "
                                "globals. Fix: name the function or class itself")
        if not hasattr(target, part):
            raise UserCodeError(f"{where!r} has no attribute {part!r} (from the path {path!r})")
        target = getattr(target, part)
        if isinstance(target, types.ModuleType):
            _check_origin(target.__name__, _module_origin(target), path, allowed)
    if not isinstance(target, types.ModuleType):
        defined_in = _defined_in(target)
        _check_origin(defined_in or "?", _origin(defined_in), path, allowed)
    return target


def _registered_entry_point(path: str) -> bool:
    """Whether ``path`` is the entry point of an env registered with Gymnasium (by code: a package's or the
    user's). A config may name that env by its id anyway, which makes the same class; gymnasium is not
    imported here (no registry, no entry points, when nothing imported it)."""
    registry = getattr(sys.modules.get("gymnasium"), "registry", None)
    return isinstance(registry, dict) and any(getattr(spec, "entry_point", None) == path for spec in registry.values())


Origin = Literal["flashrl", "user", "stdlib", "installed", "unknown"]
"""Where a module comes from; a path may lead to "flashrl" and "user" modules, and to trusted "installed" ones."""


def _check_origin(module_name: str, origin: Origin, path: str, allowed: set[str]) -> None:
    top = module_name.partition(".")[0]
    if origin in ("flashrl", "user") or (origin == "installed" and top in allowed):
        return
    if origin == "stdlib":
        raise UserCodeError(
            f"the path {path!r} leads into the standard library (module {module_name!r}), which is refused: a "
            "path names a function or class defined in your own code or in flashrl (write the function in a "
            "module of your own and give its 'module:name' path, or pass the object itself)"
        )
    if origin == "installed":
        raise UserCodeError(
            f"the path {path!r} leads into the installed package {top!r} (module {module_name!r}), which a path may "
            "name only when your code trusts it: expected a function or class defined in your own code or in "
            f"flashrl. Fix: pass the object itself, write a function of your own that calls it, or call "
            f"flashrl.user_code.trust_installed({top!r}) in your script if config text may name its code"
        )
    raise UserCodeError(
        f"the path {path!r} leads to module {module_name!r}, which is neither flashrl, a file of user code nor an "
        "installed package (a module made at run time, or an object that does not say where it is defined): a "
        "path names a function or class defined in your own code or in flashrl. Fix: pass the object itself"
    )


def _defined_in(obj: Any) -> str | None:
    """The module that defines ``obj``: a class's or function's ``__module__``, an instance's class's."""
    if isinstance(obj, types.MethodType):
        return _defined_in(obj.__func__)
    if isinstance(obj, functools.partial):  # the user's partial of a function: where the function is
        return _defined_in(obj.func)
    if isinstance(obj, types.BuiltinFunctionType):  # C functions and the bound methods of C objects
        owner = obj.__self__
        if isinstance(owner, types.ModuleType):
            return owner.__name__
        return obj.__module__ if owner is None else _defined_in(type(owner))
    named = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
    module = getattr(named, "__module__", None)
    return module if isinstance(module, str) else None


def _origin(module_name: str | None) -> Origin:
    if not module_name:
        return "unknown"
    top = module_name.partition(".")[0]
    if top == "flashrl":
        return "flashrl"
    if top in sys.stdlib_module_names:
        return "stdlib"
    module = sys.modules.get(module_name)
    return _module_origin(module) if isinstance(module, types.ModuleType) else "unknown"


def _module_origin(module: types.ModuleType) -> Origin:
    name = module.__name__
    top = name.partition(".")[0]
    if top == "flashrl":
        return "flashrl"
    if name in ("__main__", "__mp_main__"):
        return "user"
    if top in sys.stdlib_module_names:
        return "stdlib"
    file = getattr(module, "__file__", None)
    locations = [file] if isinstance(file, str) else list(getattr(module, "__path__", None) or ())
    return _files_origin(locations)


def _located_origin(top: str) -> Origin:
    """Where the top-level module ``top`` would be imported from, without running it."""
    if top == "flashrl":
        return "flashrl"
    if top in sys.stdlib_module_names:
        return "stdlib"
    if isinstance(sys.modules.get(top), types.ModuleType):
        return _module_origin(sys.modules[top])
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "user"  # it does not import: import_module says so, with its own error
    origin = spec.origin if spec.has_location else None
    locations = [origin] if isinstance(origin, str) else list(spec.submodule_search_locations or ())
    return _files_origin(locations)


def _files_origin(locations: list[str]) -> Origin:
    if not locations:
        return "unknown"  # built-in or made at run time
    installed = [_installed_file(str(location)) for location in locations]
    return "installed" if all(installed) else "user" if not any(installed) else "unknown"


def describe(value: Any) -> Any:
    """A value as plain data: None, a name or a path as it is; an object as ``"<object module:qualname>"``.

    A class or function is described by itself, an instance by its class.
    """
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    named = value if isinstance(value, (type, types.FunctionType)) else type(value)
    module = getattr(named, "__module__", None) or "?"
    return f"{OBJECT_PREFIX}{module}:{getattr(named, '__qualname__', repr(named))}>"


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    return tuple(os.path.realpath(root) + os.sep for root in roots)


_INSTALLED = _installed_roots()


def is_user_module(module: types.ModuleType) -> bool:
    """A module of user code: not flashrl, not the standard library, not installed in site-packages."""
    name = module.__name__
    if name == "flashrl" or name.startswith("flashrl.") or name in ("__main__", "__mp_main__"):
        return False  # flashrl is imported by name; __main__ is pickled by value by cloudpickle itself
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return False  # built-in, frozen or namespace packages
    return not _installed_file(file)


@functools.cache
def _installed_file(file: str) -> bool:
    return os.path.realpath(file).startswith(_INSTALLED)


_DUMPS_LOCK = threading.RLock()
"""cloudpickle's by-value registry is process-wide: one dumps at a time registers and unregisters
(re-entrant: a Shipped inside a shipped object pickles itself with a nested dumps)."""


def dumps(obj: Any) -> bytes:
    """cloudpickle ``obj`` with every module of user code pickled by value (`UserCodeError` if it cannot be).

    Ray's own copy of cloudpickle (``ray.cloudpickle``), imported here: the loss modules import without Ray.
    """
    from ray import cloudpickle

    with _DUMPS_LOCK:
        return _dumps(obj, cloudpickle)


def _dumps(obj: Any, cloudpickle: Any) -> bytes:
    registered = []
    already = cloudpickle.list_registry_pickle_by_value()
    for key, module in list(sys.modules.items()):
        if (isinstance(module, types.ModuleType) and module.__name__ == key and key not in already
                and is_user_module(module)):
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
    try:
        return cloudpickle.dumps(obj)
    except Exception as err:  # pickling errors come in many types
        raise UserCodeError(f"it cannot be pickled to ship it to the actors ({type(err).__name__}: "
                            f"{err})") from err
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def loads(data: bytes) -> Any:
    """The object :func:`dumps` pickled (cloudpickle's output loads with the standard unpickler)."""
    import pickle

    return pickle.loads(data)


def roundtrip(obj: Any) -> Any:
    """``obj`` shipped and unpacked as an actor will: `UserCodeError` when either step fails."""
    data = dumps(obj)
    try:
        return loads(data)
    except Exception as err:  # as in dumps
        raise UserCodeError(f"it was pickled but does not unpickle ({type(err).__name__}: {err})") from err


class Shipped:
    """``obj``, pickled by value (:func:`dumps`): unpickling a ``Shipped`` gives back the object itself.

    Wrap an actor's argument (or a field of one) in it so that Ray ships user code by value::

        actor_cls.remote(Shipped(spec))   # the actor receives `spec`, not a Shipped
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return loads, (dumps(self.obj),)

    def __repr__(self) -> str:
        return f"Shipped({self.obj!r})"
