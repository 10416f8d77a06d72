"""The limits that matter for agents, through ``play_episode`` (the runner's path) with the torch engine.

Maximum turns (the runner's own and the env's), the context budget, the per-observation token limit,
and a model that never answers. A truncated episode is trained (``skip_reason`` is None), with the
reward the env gave so far, as Molt's ``StepEnvRunner`` does (``molt/agents/base.py``); only an episode
without a sampled token is dropped (``empty``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gymnasium as gym
import pytest

import flashrl.envs  # noqa: F401  (registers the ids)
from flashrl.conversation import TokenizedConversation
from flashrl.env_runners import EnvRunnerSpec
from flashrl.env_runners.rollout import play_episode, skip_reason
from flashrl.envs import LanguageEnv

IM_END, NEWLINE = 2, 198
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 5}


class EndlessEnv(LanguageEnv):
    """Never ends on its own; each reply gets ``observation`` back (a long one by default)."""

    def __init__(self, observation: str = " x" * 50) -> None:
        super().__init__()
        self.observation = observation

    def _reset_task(self, options: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return [{"role": "user", "content": "Keep going."}], {"prompt_id": "endless"}

    def _step_action(self, action: str):
        return [{"role": "user", "content": self.observation}], 0.0, False, False, {"success": False}


@pytest.fixture(scope="module")
def engine(tiny_llama_path: str) -> Iterator[Any]:
    from flashrl.engines import make_engine

    engine = make_engine("torch", tiny_llama_path, seed=0)
    yield engine
    engine.close()


def play(env: gym.Env, engine: Any, *, max_episode_tokens: int = 1024, sampling: dict[str, Any] = SAMPLING,
         **limits: Any):
    with ThreadPoolExecutor(1) as executor:
        return asyncio.run(play_episode(
            env, engine, reset_seed=0, sampling_seed=lambda turn: turn, sampling=sampling,
            max_episode_tokens=max_episode_tokens, executor=executor, **limits,
        ))


def test_the_runner_turn_limit_truncates_an_env_without_one(engine: Any) -> None:
    episode = play(EndlessEnv(), engine, max_turns=3)
    assert episode.info["num_model_turns"] == 3 and episode.truncated and not episode.terminated
    assert episode.info["runner_turn_limit_reached"] is True
    assert skip_reason(episode, max_episode_tokens=1024) is None  # trained, not dropped
    # The env's reply to the last turn is not appended: the episode ends with the last model turn
    # (and the end-of-turn text it did not sample, masked).
    last_model = max(i for i, m in enumerate(episode.loss_mask) if m)
    assert episode.token_ids[last_model + 1 :] in ([], [NEWLINE], [IM_END, NEWLINE])
    assert not any(episode.loss_mask[last_model + 1 :])


def test_the_env_turn_limit(engine: Any) -> None:
    env = gym.make("flashrl/PythonTool-v0", max_turns=2)
    episode = play(env, engine)
    assert episode.info["num_model_turns"] == 2 and episode.truncated and episode.info["turn_limit_reached"]
    assert episode.reward == 0.0 and skip_reason(episode, max_episode_tokens=1024) is None
    # The runner's limit and the env's: the smaller wins.
    assert play(gym.make("flashrl/PythonTool-v0", max_turns=4), engine, max_turns=1).info["num_model_turns"] == 1


def test_the_context_budget_ends_the_episode_truncated_and_it_is_trained(engine: Any) -> None:
    prompt = TokenizedConversation(engine.tokenizer, [{"role": "user", "content": "Keep going."}]).prompt_length
    budget = prompt + 5 + 40  # room for the first turn and some of the first (long) observation: not all
    episode = play(EndlessEnv(), engine, max_episode_tokens=budget)
    assert len(episode.token_ids) <= budget
    assert episode.truncated and episode.info["context_budget_exceeded"]
    assert episode.info["num_model_turns"] == 1  # the observation did not fit: not appended
    assert skip_reason(episode, max_episode_tokens=budget) is None
    # A prompt that alone fills the budget: no sampled token, dropped as 'empty'.
    empty = play(EndlessEnv(), engine, max_episode_tokens=prompt)
    assert empty.num_generated_tokens == 0 and skip_reason(empty, max_episode_tokens=prompt) == "empty"


def test_an_observation_is_cut_to_its_token_limit_with_a_marker(engine: Any, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    assert tok(" x" * 50, add_special_tokens=False)["input_ids"] == tok(" x", add_special_tokens=False)["input_ids"] * 50
    conv = TokenizedConversation(tok, [{"role": "user", "content": "hi"}], prompt_id="p", max_observation_tokens=10)
    conv.add_model_turn([28, IM_END], [-0.1, -0.1], 0)
    conv.add_env_messages([{"role": "user", "content": " x" * 50}, {"role": "user", "content": "short"}])
    assert conv.messages[-2:] == [
        {"role": "user", "content": " x" * 10 + "\n[... 40 more tokens cut]"},
        {"role": "user", "content": "short"},
    ]
    # A character split across tokens is kept whole or not at all.
    emoji = "\U0001f600" * 5
    per_char = len(tok("\U0001f600", add_special_tokens=False)["input_ids"])
    assert per_char > 1
    conv = TokenizedConversation(tok, [{"role": "user", "content": "hi"}], prompt_id="p",
                                 max_observation_tokens=per_char + 1)
    conv.add_model_turn([28, IM_END], [-0.1, -0.1], 0)
    conv.add_env_messages([{"role": "user", "content": emoji}])
    assert conv.messages[-1]["content"] == "\U0001f600" + f"\n[... {per_char * 4} more tokens cut]"
    # Through the runner: every observation is cut, the episode goes on.
    episode = play(EndlessEnv(), engine, max_turns=3, max_observation_tokens=10)
    assert episode.info["observations_cut"] == 2 and episode.info["num_model_turns"] == 3
    assert tok.decode(episode.token_ids).count(" x" * 10 + "\n[... 40 more tokens cut]<|im_end|>") == 2
    with pytest.raises(ValueError, match="max_observation_tokens must be None or >= 1"):
        TokenizedConversation(tok, [{"role": "user", "content": "hi"}], max_observation_tokens=0)


def test_a_model_that_never_answers(engine: Any, smollm2_tokenizer: Any) -> None:
    """Every turn cut by max_tokens and no code or answer: the env gets each cut reply, reminds the model,
    and the episode ends at the turn limit, truncated, reward 0, trained; no end token is trained on."""
    env = gym.make("flashrl/PythonTool-v0", max_turns=3)
    episode = play(env, engine, sampling={**SAMPLING, "max_tokens": 3})
    assert episode.info["finish_reasons"] == ["length"] * 3
    assert episode.truncated and episode.reward == 0.0 and episode.success is False
    assert skip_reason(episode, max_episode_tokens=1024) is None
    assert IM_END not in [t for t, m in zip(episode.token_ids, episode.loss_mask) if m]
    text = smollm2_tokenizer.decode(episode.token_ids)
    assert text.count("No ```python code block and no final answer found.") == 2  # after turns 1 and 2


def test_the_limits_are_checked_in_the_spec() -> None:
    with pytest.raises(ValueError, match=r"max_turns: expected None or an integer >= 1, got 0\. Fix:"):
        EnvRunnerSpec(env="flashrl/Math-v0", max_turns=0)
    with pytest.raises(ValueError, match=r"max_observation_tokens: expected None or an integer >= 1, got 2\.5"):
        EnvRunnerSpec(env="flashrl/Math-v0", max_observation_tokens=2.5)
    spec = EnvRunnerSpec(env="flashrl/Math-v0", max_turns=8, max_observation_tokens=512)
    assert (spec.max_turns, spec.max_observation_tokens) == (8, 512)
