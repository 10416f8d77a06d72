"""Fixtures for the runtime tests: one Ray cluster per session and a tiny, fast run config."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, ClassVar

import gymnasium as gym
import pytest
from ray import cloudpickle

from flashrl.envs.base import LanguageEnv

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PARITY_ENV = "flashrl-test/Parity-v0"


class ParityEnv(LanguageEnv):
    """Single turn: reward 1 if the reply has an odd number of characters, else 0.

    Random-weight models earn mixed rewards here (unlike arithmetic), so updates have real
    gradients. Registered with a class entry point, so it reaches the actors as the driver's spec.
    """

    def __init__(self, num_tasks: int = 1000) -> None:
        super().__init__(max_turns=1)
        self.num_tasks = num_tasks

    def _reset_task(self, options: dict[str, Any]):
        task = int(self.np_random.integers(self.num_tasks))
        return [{"role": "user", "content": f"Task {task}: write anything."}], {"prompt_id": f"parity-{task}"}

    def _step_action(self, action: str):
        return [], float(len(action) % 2), True, False, {}


class NanRewardEnv(ParityEnv):
    """Like ParityEnv, but every reward is NaN (the runner must drop and count the episodes)."""

    def _step_action(self, action: str):
        return [], float("nan"), True, False, {}


class BrokenEnv(ParityEnv):
    """Like ParityEnv, but step raises (the runner must drop and count the episodes, and go on)."""

    def _step_action(self, action: str):
        raise RuntimeError("simulated environment failure")


class SourcesEnv(LanguageEnv):
    """A finite task list per ``split``; each task has a ``data_source`` and a fixed reward (any reply).

    Evaluation metrics over it can be computed by hand: they do not depend on what the model says.
    """

    TASKS: ClassVar[dict[str, list[tuple[str, float]]]] = {
        "a": [("gsm", 1.0), ("gsm", 0.0), ("math", 1.0)],
        "b": [("math", 0.0), ("math", 0.5)],
    }

    def __init__(self, split: str = "a") -> None:
        super().__init__(max_turns=1)
        self.split = split
        self.tasks = self.TASKS[split]
        self.finite = True
        self._index = 0

    def _reset_task(self, options: dict[str, Any]):
        self._index = int(options.get("task_index", self.np_random.integers(len(self.tasks))))
        source = self.tasks[self._index][0]
        info = {"prompt_id": f"{self.split}-{self._index}", "data_source": source}
        return [{"role": "user", "content": f"Task {self.split}{self._index}: say anything."}], info

    def _step_action(self, action: str):
        return [], self.tasks[self._index][1], True, False, {}


TEST_ENVS = {
    PARITY_ENV: ParityEnv,
    "flashrl-test/Sources-v0": SourcesEnv,
    "flashrl-test/NanReward-v0": NanRewardEnv,
    "flashrl-test/Broken-v0": BrokenEnv,
}
for _env_id, _cls in TEST_ENVS.items():
    if _env_id not in gym.registry:
        gym.register(_env_id, entry_point=_cls)
# Ray pickles this module's classes by value, so the actors need not import the tests folder.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def exact_sync_group() -> dict[str, Any]:
    """tiny_config overrides under which a run is exact on CPU (sync_group, one episode at a time on the
    torch engine, mixed rewards): the same checkpoint and data cursors give the same next update, to the bit."""
    return {
        "env": PARITY_ENV,
        "rollout_mode": "sync_group",
        "group_size": 1,
        "baseline": "batch_mean",
        "episodes_in_flight_per_env_runner": 1,
        "tensorboard": False,
        "lr": 1e-2,
    }


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """The session's Ray cluster (see tests/conftest.py)."""
    return ray_cluster


@pytest.fixture
def tiny_config(tiny_llama_path: str, tmp_path) -> Callable[..., object]:
    """A FlashReinforceConfig on the tiny model, the torch engine and easy sums; override any field."""
    from flashrl.algorithms import FlashReinforceConfig

    def factory(**overrides):
        config = (
            FlashReinforceConfig()
            .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
            .env_runners(
                num_env_runners=1,
                num_cpus_per_env_runner=0.5,
                engine="torch",
                episodes_in_flight_per_env_runner=4,
                max_new_tokens=8,
                max_episode_tokens=256,
                sample_timeout_s=120.0,
            )
            .learners(num_learners=0)
            .training(model=tiny_llama_path, train_batch_size=4, lr=1e-3, delta=1.0, grad_clip=1.0)
            .reporting(log_dir=str(tmp_path / "tb"), console_every=1)
            .resources(num_cpus_for_main_process=0.25)
            .debugging(seed=0)
        )
        if "env" in overrides:
            overrides.setdefault("env_config", {})
        return config.update_from_dict(overrides)

    return factory


def _replacement_versions(group, *, min_versions: int = 8, max_polls: int = 60) -> list[int]:
    """Policy versions of the episodes a restarted runner delivers (after ``group.kill(i)``).

    Polls until the group has restarted the runner and its replacement delivered ``min_versions``
    model turns; polls answered before the restart are not counted.
    """
    versions: list[int] = []
    for _ in range(max_polls):
        restarted = group.num_restarts
        for report in group.next_reports(5.0):
            if restarted:  # polls sent to the replacement
                versions += [v for ep in report.episodes for v in ep.policy_versions]
        if restarted and len(versions) >= min_versions:
            break
    return versions


@pytest.fixture
def replacement_versions() -> Callable[..., list[int]]:
    """``replacement_versions(group)``: versions sampled by a restarted runner (see the helper)."""
    return _replacement_versions
