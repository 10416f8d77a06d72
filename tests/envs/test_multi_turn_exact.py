"""Token-exact multi-turn episodes of the shipped multi-turn envs, with both engines, through the runner's path.

Each episode is played by ``play_episode`` (what an EnvRunner runs) with the tiny random Llama on the
real engine, wrapped only to record what the engine was asked and what it answered. Checked, turn after
turn, for 3+ turn episodes of ``flashrl/PythonTool-v0`` (fenced code and native tool calls) and
``flashrl/ALFWorld-v0``:

* every turn's prompt is exactly the episode's tokens up to there (earlier turns are never
  re-tokenised: the chat template is applied incrementally), and the engine's sampled ids follow it;
* the loss mask is True exactly on the sampled ids (environment and template tokens are masked out),
  and the behavior log-probs there are the engine's;
* the learner's recomputation of the WHOLE conversations, packed into one row as the learner packs a
  micro-batch (``compute_packed_token_logprobs``), matches the recorded behavior log-probs of every
  model turn to the single-turn agreement tolerance of ``tests/engines`` (docs/engines.md,
  "Train/inference agreement"): mean Bernoulli-KL drift < 1e-5 and max |delta log p| < 1e-3.

The random model rarely ends a turn or the task on its own: each turn is cut at ``MAX_TOKENS`` and the
envs keep the episode going until their turn limit (a reply without code or command gets the env's
reminder or "Nothing happens."), so each episode has ``TURNS`` model turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
import torch

import flashrl.envs  # noqa: F401  (registers the ids)
from flashrl.engines.agreement import bernoulli_kl
from flashrl.env_runners.rollout import play_episode
from flashrl.episode import Episode

TURNS = 3
MAX_TOKENS = 6
CONTEXT = 2048
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": MAX_TOKENS}


class Recording:
    """The real engine, with every request and completion kept."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.calls: list[tuple[list[int], Any]] = []

    async def generate(self, prompt: list[int], sampling: Any) -> Any:
        completion = await self.engine.generate(prompt, sampling)
        self.calls.append((list(prompt), completion))
        return completion


def _envs(alfworld_cache: Path) -> dict[str, dict[str, Any]]:
    return {
        "python_tool_fenced": {"id": "flashrl/PythonTool-v0", "max_turns": TURNS},
        "python_tool_hermes": {"id": "flashrl/PythonTool-v0", "max_turns": TURNS, "tool_format": "hermes"},
        "alfworld": {"id": "flashrl/ALFWorld-v0", "max_turns": TURNS, "num_games": 1, "seed": 0,
                     "cache_dir": str(alfworld_cache)},
    }


ENV_NAMES = [
    "python_tool_fenced",
    "python_tool_hermes",
    pytest.param("alfworld", marks=pytest.mark.alfworld),
]


@pytest.fixture(scope="module")
def alfworld_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("alfworld_games"))


@pytest.fixture(scope="module")
def learner_model(tiny_llama_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One loop for the module: vLLM's async engine stays bound to the loop that first used it."""
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # e.g. vLLM's output handler, cancelled by engine.close()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def torch_engine(tiny_llama_path: str) -> Iterator[Any]:
    from flashrl.engines import make_engine

    engine = make_engine("torch", tiny_llama_path, seed=0, max_model_len=CONTEXT)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def vllm_engine(tiny_llama_path: str, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    from flashrl.engines import make_engine

    engine = make_engine("vllm", tiny_llama_path, seed=0, max_model_len=CONTEXT)
    yield engine
    engine.close()


def _play(engine: Any, env_name: str, alfworld_cache: Path, loop: asyncio.AbstractEventLoop, seeds: range
          ) -> list[tuple[Episode, list[tuple[list[int], Any]]]]:
    config = dict(_envs(alfworld_cache)[env_name])
    env = gym.make(config.pop("id"), **config)
    out = []
    try:
        with ThreadPoolExecutor(2) as executor:
            for seed in seeds:
                recording = Recording(engine)
                episode = loop.run_until_complete(play_episode(
                    env, recording, reset_seed=seed, sampling_seed=lambda turn, s=seed: 1000 * s + turn,
                    sampling=SAMPLING, max_episode_tokens=CONTEXT, executor=executor,
                ))
                out.append((episode, recording.calls))
    finally:
        env.close()
    return out


def _check_token_exact(episode: Episode, calls: list[tuple[list[int], Any]]) -> None:
    assert len(calls) == episode.info["num_model_turns"] >= TURNS
    sampled = [False] * len(episode.token_ids)
    for prompt, completion in calls:
        end = len(prompt) + len(completion.token_ids)
        assert episode.token_ids[: len(prompt)] == prompt  # what the engine saw is the episode's prefix
        assert episode.token_ids[len(prompt) : end] == list(completion.token_ids)
        assert episode.behavior_logprobs[len(prompt) : end] == list(completion.logprobs)
        sampled[len(prompt) : end] = [True] * len(completion.token_ids)
    assert episode.loss_mask == sampled  # env, template and prompt tokens are masked out
    assert all(lp == 0.0 for lp, m in zip(episode.behavior_logprobs, sampled) if not m)


def _check_learner_agreement(model: torch.nn.Module, episodes: list[Episode]) -> None:
    """The learner's packed recomputation of whole conversations against the recorded log-probs."""
    from flashrl.learners.packing import pack_rows, unpack_rows
    from flashrl.models import compute_packed_token_logprobs

    width = max(len(e.token_ids) for e in episodes)
    ids = torch.zeros(len(episodes), width, dtype=torch.long)
    mask = torch.zeros(len(episodes), width, dtype=torch.bool)
    for row, e in enumerate(episodes):
        ids[row, : len(e.token_ids)] = torch.tensor(e.token_ids)
        mask[row, : len(e.token_ids)] = True
    packed = pack_rows(ids, mask)
    with torch.no_grad():
        logprobs, _ = compute_packed_token_logprobs(
            model, packed.input_ids, packed.position_ids, temperature=SAMPLING["temperature"], with_entropy=False
        )
    current = unpack_rows(logprobs, packed).double()  # [S, T]
    diffs, drifts = [], []
    for row, e in enumerate(episodes):
        loss = torch.tensor(e.loss_mask)
        recomputed = current[row, : len(e.token_ids)][loss]
        recorded = torch.tensor(e.behavior_logprobs, dtype=torch.float64)[loss]
        diffs.append((recorded - recomputed).abs())
        drifts.append(float(bernoulli_kl(recorded, recomputed).mean()))
    every = torch.cat(diffs)
    assert every.numel() >= TURNS * len(episodes)
    assert float(every.max()) < 1e-3, f"max |delta log p| {float(every.max()):.3g}"
    assert sum(drifts) / len(drifts) < 1e-5, f"mean drift {sum(drifts) / len(drifts):.3g}"


@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_torch_engine_episodes_are_token_exact(
    env_name: str, torch_engine: Any, learner_model: torch.nn.Module, alfworld_cache: Path,
    loop: asyncio.AbstractEventLoop,
) -> None:
    played = _play(torch_engine, env_name, alfworld_cache, loop, range(2))
    for episode, calls in played:
        _check_token_exact(episode, calls)
        assert episode.truncated and episode.info.get("turn_limit_reached")  # the env kept it going
        if env_name == "python_tool_hermes":  # SmolLM2's template ignores tools: they are in the system turn
            prompt = torch_engine.tokenizer.decode(calls[0][0])
            assert prompt.startswith("<|im_start|>system\n") and '<tools>\n{"type": "function"' in prompt
    _check_learner_agreement(learner_model, [e for e, _ in played])


@pytest.mark.vllm
@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_vllm_engine_episodes_are_token_exact(
    env_name: str, vllm_engine: Any, learner_model: torch.nn.Module, alfworld_cache: Path,
    loop: asyncio.AbstractEventLoop,
) -> None:
    played = _play(vllm_engine, env_name, alfworld_cache, loop, range(2))
    for episode, calls in played:
        _check_token_exact(episode, calls)
    _check_learner_agreement(learner_model, [e for e, _ in played])
