"""A sandbox for model-written Python code: bubblewrap, else Landlock + seccomp, never silently none.

Quick use::

    from flashrl.envs.sandbox import Sandbox, SandboxConfig
    result = Sandbox(SandboxConfig(wall_time_s=5)).run("print(2 ** 10)")
    result.stdout  # "1024\\n"
"""

from flashrl.envs.sandbox.config import SandboxConfig, SandboxResult
from flashrl.envs.sandbox.runner import (
    Sandbox,
    SandboxSetupError,
    SandboxUnavailableError,
    available_backends,
)

__all__ = [
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxSetupError",
    "SandboxUnavailableError",
    "available_backends",
]
