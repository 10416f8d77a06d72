"""Fixtures for the learner tests: episodes scored by the tiny model, and one Ray cluster per session."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.episode import Episode
from flashrl.learners import LearnerSpec, TrainBatch

PAD = 0


def make_episodes(
    model_path: str,
    *,
    num: int,
    seed: int = 0,
    behavior_noise: float = 0.0,
    rewards: list[float] | None = None,
) -> list[Episode]:
    """``num`` ragged episodes: a random 4-token prompt, then tokens sampled from the tiny model.

    The recorded behavior log-probs are the model's exact log-probs of the sampled tokens, so drift is
    0; ``behavior_noise = s`` mixes trajectory ``i``'s recorded probabilities towards 1/2 with weight
    ``i * s``, so drift grows with ``i``. All episodes are sampled together, one position at a time.
    """
    from transformers import AutoModelForCausalLM

    from flashrl.models import compute_token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    p = 4  # prompt length (rows sample in step); the responses have different lengths
    response_lens = [4 + (3 * i) % 7 for i in range(num)]
    ids = torch.randint(1, model.config.vocab_size, (num, p + max(response_lens)), generator=gen)  # [B, T]
    with torch.no_grad():
        for t in range(p, ids.shape[1]):
            probs = torch.softmax(model(ids[:, :t]).logits[:, -1].float(), dim=-1)  # [B, V]
            ids[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # [B]
        logprobs, _ = compute_token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))  # [B, T]
    episodes = []
    for i in range(num):
        r = response_lens[i]
        w = min(i * behavior_noise, 0.9)  # behavior = (1 - w) * current + w * 1/2, per token
        recorded = logprobs[i, p : p + r]  # [r]
        mixed = torch.log((1 - w) * recorded.exp() + w * 0.5) if w > 0 else recorded  # [r]
        behavior = [0.0] * p + mixed.tolist()
        episodes.append(
            Episode(
                prompt_id=f"prompt-{seed}-{i}",
                token_ids=ids[i, : p + r].tolist(),
                loss_mask=[False] * p + [True] * r,
                behavior_logprobs=behavior,
                reward=rewards[i] if rewards is not None else float((i * 7) % 3 == 0),
                policy_versions=[i % 2],
                info={"success": i % 2 == 0},  # explicit labels, deliberately unrelated to the rewards
            )
        )
    return episodes


@pytest.fixture(scope="session")
def episode_maker() -> Callable[..., list[Episode]]:
    """``make_episodes`` for tests that score episodes with a model of their own."""
    return make_episodes


@pytest.fixture(scope="session")
def episodes(tiny_llama_path: str) -> list[Episode]:
    """Six ragged on-policy episodes with mixed rewards, drift rising with the index."""
    return make_episodes(tiny_llama_path, num=6, seed=1, behavior_noise=0.02)


@pytest.fixture(scope="session")
def next_episodes(tiny_llama_path: str) -> list[Episode]:
    """A second, different batch of five episodes."""
    return make_episodes(tiny_llama_path, num=5, seed=2, behavior_noise=0.0, rewards=[1.0, 0.0, 0.5, 0.0, 1.0])


@pytest.fixture(scope="session")
def batch(episodes: list[Episode]) -> TrainBatch:
    return TrainBatch.from_episodes(episodes, pad_token_id=PAD)


@pytest.fixture(scope="session")
def next_batch(next_episodes: list[Episode]) -> TrainBatch:
    return TrainBatch.from_episodes(next_episodes, pad_token_id=PAD)


LOSS_FIELDS = {f.name for f in dataclasses.fields(FlashReinforceLossSpec)}


def spec_for(model: str, **overrides) -> LearnerSpec:
    """A CPU LearnerSpec with FlashREINFORCE's loss; loss settings (delta, ...) go to FlashReinforceLossSpec."""
    loss = {"delta": 0.05, **{k: v for k, v in overrides.items() if k in LOSS_FIELDS}}
    fields = {"model": model, "lr": 1e-2, "grad_clip": None, "device": "cpu"}
    fields.update({k: v for k, v in overrides.items() if k not in LOSS_FIELDS})
    return LearnerSpec(**fields, loss=FlashReinforceLossSpec(**loss))


@pytest.fixture(scope="session")
def make_spec(tiny_llama_path: str) -> Callable[..., LearnerSpec]:
    def factory(**overrides) -> LearnerSpec:
        return spec_for(tiny_llama_path, **overrides)

    return factory

