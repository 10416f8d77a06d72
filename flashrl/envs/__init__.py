"""Gymnasium language environments for flashrl (imported as ``flashrl.envs``).

Importing this package registers the environment ids below with Gymnasium; the environment modules
themselves (and heavy optional dependencies such as ``alfworld`` or the sandbox) load only when an
environment is made::

    import gymnasium as gym
    import flashrl.envs  # noqa: F401  (registers the ids)

    env = gym.make("flashrl/Math-v0", preset="easy_sums")
    messages, info = env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("The answer is \\boxed{42}.")

========================  ==========================================  ===========================
id                        entry point                                 task
========================  ==========================================  ===========================
``flashrl/Math-v0``       ``flashrl.envs.math:MathEnv``               single-turn math, verified
``flashrl/PythonTool-v0`` ``flashrl.envs.python_tool:PythonToolEnv``  multi-turn code execution
``flashrl/ALFWorld-v0``   ``flashrl.envs.alfworld:ALFWorldEnv``       multi-turn text household
``flashrl/Tool-v0``       ``flashrl.envs.tool_env:ToolEnv``           your tasks, your functions
``flashrl/Agent-v0``      ``flashrl.envs.agent_env:AgentEnv``         your tasks, your agent program
========================  ==========================================  ===========================
"""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium as gym

from flashrl.envs.base import ChatMessage, EpisodeEndedError, LanguageEnv
from flashrl.envs.spaces import ChatMessages, UnicodeText

#: Registered environment id -> entry point (``module:Class``), loaded lazily by ``gymnasium.make``.
ENV_IDS: dict[str, str] = {
    "flashrl/Math-v0": "flashrl.envs.math:MathEnv",
    "flashrl/PythonTool-v0": "flashrl.envs.python_tool:PythonToolEnv",
    "flashrl/ALFWorld-v0": "flashrl.envs.alfworld:ALFWorldEnv",
    "flashrl/Tool-v0": "flashrl.envs.tool_env:ToolEnv",
    "flashrl/Agent-v0": "flashrl.envs.agent_env:AgentEnv",
}


def register_envs() -> None:
    """Register every id in :data:`ENV_IDS` with Gymnasium (idempotent)."""
    for env_id, entry_point in ENV_IDS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point)


register_envs()

_LAZY = {
    "MathEnv": "flashrl.envs.math",
    "PythonToolEnv": "flashrl.envs.python_tool",
    "ALFWorldEnv": "flashrl.envs.alfworld",
    "ToolEnv": "flashrl.envs.tool_env",
    "Tool": "flashrl.envs.tool_env",
    "AgentEnv": "flashrl.envs.agent_env",
    "TokenizedConversation": "flashrl.conversation",
    "verify_answer": "flashrl.envs.math.verifier",
    "VerifyResult": "flashrl.envs.math.verifier",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flashrl.envs' has no attribute {name!r}")


__all__ = [
    "ENV_IDS",
    "ALFWorldEnv",
    "AgentEnv",
    "ChatMessage",
    "ChatMessages",
    "EpisodeEndedError",
    "LanguageEnv",
    "MathEnv",
    "PythonToolEnv",
    "TokenizedConversation",
    "Tool",
    "ToolEnv",
    "UnicodeText",
    "VerifyResult",
    "register_envs",
    "verify_answer",
]
