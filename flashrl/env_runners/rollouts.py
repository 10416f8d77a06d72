"""The rollout kinds an EnvRunner knows, by name: the registry of `Rollout` classes.

A new kind is one new module with a `Rollout` subclass, plus one line here (a built-in kind) or
``@register_rollout("name")`` on the class (a user's kind, registered when its module is imported); an
env class selects it with ``rollout_kind = "name"`` (`declared_kind`). A user's env may also name the
class itself, ``rollout_kind = MyRollout``: it then reaches the runner actors with the env class (by
value), where a registration made in the driver's script does not. The runner looks its kind up once,
when it makes its first env.
"""

from __future__ import annotations

from collections.abc import Callable

from flashrl.env_runners.agent_rollout import AgentRollout
from flashrl.env_runners.rollout import GymRollout
from flashrl.env_runners.rollout_protocol import Rollout

__all__ = ["ROLLOUTS", "register_rollout", "rollout_class"]

ROLLOUTS: dict[str, type[Rollout]] = {
    "gym": GymRollout,
    "agent": AgentRollout,
}
"""Rollout kind -> its class."""


def register_rollout(name: str) -> Callable[[type[Rollout]], type[Rollout]]:
    """Class decorator: register a `Rollout` subclass as the kind ``name`` (verl's ``@register``)."""

    def register(cls: type[Rollout]) -> type[Rollout]:
        if not (isinstance(cls, type) and issubclass(cls, Rollout)):
            raise TypeError(f"register_rollout({name!r}): expected a Rollout subclass, got {cls!r}.")
        known = ROLLOUTS.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"register_rollout({name!r}): the kind is already {known.__qualname__}; expected a new "
                             "name. Fix: pick another name for the kind")
        ROLLOUTS[name] = cls
        return cls

    return register


def rollout_class(kind: str | type[Rollout], env_id: object = None) -> type[Rollout]:
    """The class of the rollout kind ``kind`` (an env's declared kind, played for ``env_id``)."""
    if isinstance(kind, type):
        return kind
    try:
        return ROLLOUTS[kind]
    except KeyError:
        raise ValueError(
            f"env {env_id!r} declares the rollout kind {kind!r}; expected one of {sorted(ROLLOUTS)}. Fix: register "
            "its Rollout class with @flashrl.env_runners.rollouts.register_rollout, in a module the runners import"
        ) from None
