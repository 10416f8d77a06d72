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

**Paths never name the standard library.** A component given by path is a function or class of the
user's own module (or of flashrl, or of an installed package); none is in the standard library, whose
paths are how a config's text would run other code (``reward_fn="os:system"`` calls a shell with the
model's reply). :func:`import_path` refuses a path whose module is in ``sys.stdlib_module_names``
(``builtins``, ``os``, ``subprocess`` and every other standard module, by its top-level name), a
dotted name that walks through such a module (``"mymod:os.system"``), and a function or class that
such a module defines (``"mymod:system"`` after ``from os import system`` in ``mymod``). A user's own
function that calls the standard library is user code like any other: a config is code, and one from
an untrusted source must be read as such.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import sysconfig
import threading
import types
from typing import Any

__all__ = ["Shipped", "UserCodeError", "describe", "dumps", "import_path", "is_description", "is_path",
           "is_user_module", "loads", "roundtrip"]

OBJECT_PREFIX = "<object "


class UserCodeError(ValueError):
    """A path that does not import, or an object that cannot be shipped to the actors."""


def is_path(value: Any) -> bool:
    """Whether ``value`` is written as an import path ``"package.module:name"``."""
    return isinstance(value, str) and ":" in value and not is_description(value)


def is_description(value: Any) -> bool:
    """Whether ``value`` is the ``"<object module:qualname>"`` text :func:`describe` writes for an object."""
    return isinstance(value, str) and value.startswith(OBJECT_PREFIX) and value.endswith(">")


def import_path(path: str) -> Any:
    """The object at ``"package.module:name"`` (``name`` may be dotted); `UserCodeError` if it does not."""
    module_name, _, attribute = path.partition(":")
    parts = attribute.split(".")
    if not module_name or not all(p.isidentifier() for p in module_name.split(".") + parts):
        raise UserCodeError(f"expected an import path 'package.module:name', got {path!r}")
    _refuse_standard_library(module_name, path)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # any import error is the path's to fix
        raise UserCodeError(f"the module {module_name!r} of {path!r} does not import ({type(err).__name__}: "
                            f"{err})") from err
    for i, part in enumerate(parts):
        if not hasattr(target, part):
            where = ".".join([module_name, *parts[:i]])
            raise UserCodeError(f"{where!r} has no attribute {part!r} (from the path {path!r})")
        target = getattr(target, part)
        if isinstance(target, types.ModuleType):
            _refuse_standard_library(target.__name__, path)
    if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        _refuse_standard_library(getattr(target, "__module__", None) or "", path)
    return target


def _refuse_standard_library(module_name: str, path: str) -> None:
    if module_name.partition(".")[0] in sys.stdlib_module_names:
        raise UserCodeError(
            f"the path {path!r} leads into the standard library (module {module_name!r}), which is refused: a "
            "path names user code, a function or class of your own module, of flashrl or of an installed "
            "package (write the function in a module of your own and give its 'module:name' path)"
        )


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
