"""A hung env.reset / env.step is cut off by the runner's time limit, dropped and counted as env_timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import gymnasium as gym
import pytest

from flashrl.env_runners import EnvRunner
from flashrl.env_runners.rollout_protocol import EnvTimeout, in_thread
from flashrl.env_runners.types import RUNNER_SKIP_REASONS, SKIP_REASONS

from .conftest import ParityEnv

HANG_S = 3.0
RELEASE = threading.Event()  # set at the end so the "hung" threads finish and the test process can exit


class HangingStepEnv(ParityEnv):
    """Like ParityEnv, but step blocks far past the test's time limit."""

    def _step_action(self, action: str):
        RELEASE.wait(HANG_S)
        return super()._step_action(action)


class HangingResetEnv(ParityEnv):
    def _reset_task(self, options):
        RELEASE.wait(HANG_S)
        return super()._reset_task(options)


for _id, _cls in {"flashrl-test/HangingStep-v0": HangingStepEnv,
                  "flashrl-test/HangingReset-v0": HangingResetEnv}.items():
    if _id not in gym.registry:
        gym.register(_id, entry_point=_cls)


def test_env_timeout_is_a_runner_skip_reason() -> None:
    assert "env_timeout" in RUNNER_SKIP_REASONS and "env_timeout" in SKIP_REASONS


def test_a_call_past_the_limit_raises_env_timeout_and_the_thread_goes_on() -> None:
    from concurrent.futures import ThreadPoolExecutor

    finished = threading.Event()

    def hang() -> str:
        time.sleep(0.5)
        finished.set()
        return "late"

    async def scenario() -> float:
        with ThreadPoolExecutor(1) as pool:
            began = time.monotonic()
            with pytest.raises(EnvTimeout, match=r"hang did not return within 0\.1 s \(env_timeout_s\)"):
                await in_thread(pool, 0.1, hang)
            waited = time.monotonic() - began
            assert await in_thread(pool, None, lambda: "no limit") == "no limit"  # after the hung call
            return waited

    waited = asyncio.run(scenario())
    assert waited < 0.5  # cut off at the limit, not when the call returned
    assert finished.is_set()  # the thread itself could not be stopped: it ran to its end


@pytest.mark.parametrize("env", ["flashrl-test/HangingStep-v0", "flashrl-test/HangingReset-v0"])
def test_hung_episodes_are_dropped_counted_and_not_reused(tiny_config, env: str) -> None:
    config = tiny_config(env=env, env_timeout_s=0.3)  # the setting reaches the runner through its spec
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)
    assert runner.spec.env_timeout_s == 0.3

    async def scenario():
        report = await runner.sample([0, 1], group_size=1)
        pooled = sum(len(pool) for pool in runner._pools.values())
        await runner.stop()
        return report, pooled

    try:
        report, pooled = asyncio.run(scenario())
    finally:
        RELEASE.set()
    assert report.episodes == []
    assert report.skipped == {"env_timeout": 2}
    assert pooled == 0  # a hung env is never handed to another episode
    RELEASE.clear()


def test_the_time_limit_is_a_checked_setting_with_the_old_default() -> None:
    from flashrl.algorithms import FlashReinforceConfig
    from flashrl.algorithms.flash_reinforce.config import ConfigError
    from flashrl.env_runners import EnvRunnerSpec

    assert EnvRunnerSpec(env="flashrl/Math-v0").env_timeout_s == 300.0
    assert EnvRunnerSpec(env="flashrl/Math-v0", env_timeout_s=None).env_timeout_s is None
    assert "env_timeout_s" in FlashReinforceConfig.setting_names()
    config = FlashReinforceConfig().environment("flashrl/Math-v0").training(model="m")
    assert config.env_runners(env_timeout_s=12.5).env_runner_spec().env_timeout_s == 12.5
    for bad in (0, -1.0, float("inf"), "300"):
        with pytest.raises(ConfigError, match=r"env_timeout_s: expected None \(no limit\) or a finite number > 0, got "
                           rf"{bad!r}\. Fix: use None for no limit, or the default 300\.0"):
            config.env_runners(env_timeout_s=bad).validate()
