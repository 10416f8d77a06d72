"""One rollout protocol: the kind an env declares picks the runner's `Rollout` once; an agent env's endpoint
and limits are the runner's settings (``agent_*``), which the spec alone decides, also from env_config."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from typing import Any

import gymnasium as gym
import pytest

import flashrl.envs  # noqa: F401  (registers flashrl/Agent-v0)
from flashrl.env_runners import EnvRunner, EnvRunnerSpec, Rollout, RolloutContext, register_rollout
from flashrl.env_runners.agent_rollout import AgentRollout, AgentTimeout
from flashrl.env_runners.rollout import GymRollout
from flashrl.env_runners.rollout_protocol import EnvError, EnvTimeout, declared_kind, failure_kind
from flashrl.env_runners.rollouts import ROLLOUTS, rollout_class
from flashrl.envs.agent_env import AgentEnv
from flashrl.validation import SpecError

from .conftest import PARITY_ENV, ParityEnv

TASKS = [{"id": "t0", "question": "2+3"}]


async def one_call(client: Any, task: dict[str, Any]) -> float:
    await client.chat.completions.create(model="m1", messages=[{"role": "user", "content": task["question"]}],
                                         max_tokens=2)
    return 1.0


def _agent_spec(**fields: Any) -> EnvRunnerSpec:
    fields.setdefault("env_config", {"tasks": TASKS, "agent": one_call})
    return EnvRunnerSpec(env="flashrl/Agent-v0", **fields)


# ------------------------------------------------------------------------------------------
# the env's declared kind, the registry, the failure kinds
# ------------------------------------------------------------------------------------------
class PortEnv(ParityEnv):
    """A stepped env with an argument named like an endpoint setting: it stays the env's."""

    def __init__(self, port: int = 0) -> None:
        super().__init__()
        self.port = port


class ReplayRollout(Rollout):
    async def play(self, ctx: RolloutContext) -> None:
        return None


class ReplayEnv(ParityEnv):
    rollout_kind = "replay-test"


class OwnRolloutEnv(ParityEnv):
    rollout_kind = ReplayRollout  # the class itself: it travels with the env class


class DuckAgentEnv(ParityEnv):
    """An env with the agent env's methods and no declared kind: played as an agent env."""

    reward_fn = None

    async def run_agent(self, base_url: str, api_key: str, *, model_name: str, wall_time_s: float) -> Any: ...

    def grade(self, transcript: list[Any]) -> Any: ...

    def success_info(self, reward: Any, success: bool | None) -> dict[str, bool]: ...


def test_an_env_class_declares_its_rollout_kind() -> None:
    assert [declared_kind(cls) for cls in (AgentEnv, ParityEnv, DuckAgentEnv, ReplayEnv)] == [
        "agent", "gym", "agent", "replay-test"]
    assert rollout_class("gym") is GymRollout and rollout_class("agent") is AgentRollout
    with pytest.raises(ValueError, match=r"env 'my/Env-v0' declares the rollout kind 'nope'; expected one of "
                                         r"\['agent', 'gym'.*Fix: register"):
        rollout_class("nope", "my/Env-v0")


def test_a_new_kind_is_one_class_and_one_registration() -> None:
    try:
        assert register_rollout("replay-test")(ReplayRollout) is ReplayRollout
        assert rollout_class(declared_kind(ReplayEnv)) is ReplayRollout
        assert rollout_class(declared_kind(OwnRolloutEnv)) is ReplayRollout  # no registration needed
        register_rollout("replay-test")(ReplayRollout)  # the same class again: no change
        with pytest.raises(ValueError, match="the kind is already ReplayRollout"):
            register_rollout("replay-test")(GymRollout)
        with pytest.raises(TypeError, match="expected a Rollout subclass"):
            register_rollout("other-test")(ParityEnv)  # type: ignore[arg-type]
    finally:
        ROLLOUTS.pop("replay-test", None)


def test_failures_map_to_the_outcome_kinds_in_one_place() -> None:
    from flashrl.engines import RequestError

    assert [failure_kind(err) for err in (EnvTimeout("t"), AgentTimeout("a"), EnvError("e"), RequestError("r"),
                                          RuntimeError("engine"), ValueError("v"))] == [
        "env_timeout", "env_timeout", "env_error", "request_error", None, None]
    assert (EnvTimeout.env_reusable, AgentTimeout.env_reusable) == (False, True)  # a cancelled agent holds no thread


def test_the_runner_chooses_its_rollout_once_from_its_first_env(tiny_config: Any) -> None:
    config = tiny_config(env=PARITY_ENV)
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)

    async def scenario() -> list[Any]:
        try:
            assert runner._rollout is None
            await runner.sample([0, 1])
            chosen = runner._rollout
            await runner.sample([2], evaluation=True)
            return [chosen, runner._rollout]
        finally:
            await runner.stop()

    first, later = asyncio.run(scenario())
    assert type(first) is GymRollout and later is first


# ------------------------------------------------------------------------------------------
# the agent endpoint's settings: the runner's spec decides
# ------------------------------------------------------------------------------------------
def test_agent_settings_are_the_runners_and_env_config_keys_are_still_read() -> None:
    spec = _agent_spec(env_config={"tasks": TASKS, "agent": one_call, "max_calls": 2, "wall_time_s": 30,
                                   "model_name": "m1", "host": "127.0.0.2", "port": 0,
                                   "max_completion_tokens": 64},
                       evaluation_env_config={"max_calls": 2, "success_threshold": 1.0})
    assert (spec.agent_max_calls, spec.agent_wall_time_s, spec.agent_model_name, spec.agent_host, spec.agent_port,
            spec.agent_max_completion_tokens) == (2, 30, "m1", "127.0.0.2", 0, 64)
    assert set(spec.env_config) == {"tasks", "agent"}  # the env gets its tasks, agent and reward only
    assert spec.evaluation_env_config == {"success_threshold": 1.0}
    assert EnvRunnerSpec.from_dict(spec.to_dict()) == spec  # resolved once: a round trip finds nothing to move
    same = _agent_spec(agent_max_calls=2, agent_wall_time_s=30, agent_model_name="m1", agent_host="127.0.0.2",
                       agent_max_completion_tokens=64, evaluation_env_config={"success_threshold": 1.0})
    assert same == spec


def test_an_env_config_key_that_agrees_with_the_setting_is_accepted() -> None:
    spec = _agent_spec(agent_max_calls=2, env_config={"tasks": TASKS, "agent": one_call, "max_calls": 2})
    assert spec.agent_max_calls == 2 and "max_calls" not in spec.env_config


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"agent_max_calls": 4, "env_config": {"tasks": TASKS, "agent": one_call, "max_calls": 2}},
         (r"agent_max_calls: expected one value, got agent_max_calls = 4 and env_config\['max_calls'\] = 2 .*Fix: "
         r"keep \.env_runners\(agent_max_calls=\.\.\.\) and remove 'max_calls'")),
        ({"env_config": {"tasks": TASKS, "agent": one_call, "wall_time_s": 60},
          "evaluation_env_config": {"wall_time_s": 120}},
         (r"agent_wall_time_s: expected one value for training and evaluation .*got env_config\['wall_time_s'\] = 60 "
         r"and evaluation_env_config\['wall_time_s'\] = 120")),
        ({"evaluation_splits": {"held_out": {"max_calls": 3}}},
         (r"agent_max_calls: expected one value for training and evaluation .*got agent_max_calls = 16 and "
         r"evaluation_splits\['held_out'\]\['max_calls'\] = 3")),
        ({"env_config": {"tasks": TASKS, "agent": one_call, "port": 70000}}, r"agent_port"),
        ({"agent_model_name": ""}, r"agent_model_name: expected a non-empty str"),
        ({"agent_max_calls": 0}, r"agent_max_calls"),
    ],
)
def test_conflicting_or_bad_agent_settings_are_refused(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        _agent_spec(**fields)


def test_a_stepped_envs_config_keeps_keys_named_like_agent_settings() -> None:
    if "flashrl-test/Port-v0" not in gym.registry:
        gym.register("flashrl-test/Port-v0", entry_point=PortEnv)
    spec = EnvRunnerSpec(env="flashrl-test/Port-v0", env_config={"port": 8})
    assert spec.env_config == {"port": 8} and spec.agent_port == 0


def test_the_endpoint_serves_the_runners_model_name_and_limits(tiny_config: Any) -> None:
    command = [sys.executable, "-c", (
        "import json, os, sys\nfrom openai import OpenAI\ntask = json.load(sys.stdin)\n"
        "client = OpenAI(max_retries=0)\n"
        "for _ in range(2):\n"
        "    client.chat.completions.create(model=os.environ['FLASHRL_MODEL'], messages=[{'role': 'user', "
        "'content': task['question']}], max_tokens=2)\nprint(json.dumps(1.0))\n")]
    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, "command": command})
    config.env_runners(agent_model_name="m1", agent_max_calls=1)
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)

    async def scenario() -> Any:
        try:
            report = await runner.sample([0])
            return report, [server.model_name for server in runner._rollout.servers.values()]
        finally:
            await runner.stop()

    report, names = asyncio.run(scenario())
    assert names == ["m1"]  # the command's FLASHRL_MODEL: its first call was served
    assert report.skipped == Counter()
    (episode,) = report.episodes  # the second call was refused: truncated, 0 without a reward_fn
    assert (episode.truncated, episode.reward, episode.info["agent_limit"]) == (True, 0.0, "call_limit")
