"""The Ray cluster a benchmark runs on: the one connected, the one at `RAY_ADDRESS`, or a local one."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def connect_ray(extra_runtime_env: Mapping[str, Any] | None = None, *, own_cluster: bool = False) -> bool:
    """Use a connected Ray, else join `RAY_ADDRESS`, else start a local cluster; True = we connected.

    `extra_runtime_env`: more of the job's ``runtime_env`` (its ``env_vars`` join ours), e.g. evidence-3's
    pinning hook (`_pinning.runtime_env`). `own_cluster`: always start a new local cluster (Ray's
    ``address="local"``), never join one another process started on this machine.
    """
    import ray

    from flashrl.ray_utils import init_or_join

    if ray.is_initialized():
        return False
    extra = dict(extra_runtime_env or {})
    runtime_env = {**extra, "env_vars": {"TOKENIZERS_PARALLELISM": "false", **extra.get("env_vars", {})}}
    if os.environ.get("RAY_ADDRESS"):
        init_or_join(runtime_env=runtime_env, log_to_driver=False)
    else:  # logical CPUs above the 2 cores: the actors ask for fractions deliberately
        ray.init(
            address="local" if own_cluster else None,
            num_cpus=max(4, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=False,
            runtime_env=runtime_env,
        )
    return True
