"""Routing replay on episodes of several segments: each segment replays the routing the engine recorded for it.

The torch engine samples every segment from its own start (as an agent's model call that does not
extend the previous one) and records its routing; the episode is the segments one after another.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.engines import SamplingConfig, make_engine
from flashrl.episode import Episode
from flashrl.learners import Learner, LearnerSpec, TrainBatch
from flashrl.models.routing_replay import NO_ROUTING

SEGMENTS = [[3, 4], [5], [2, 3, 4], [4, 2]]
"""Per episode, the prompt length of each segment (segment k of episode i samples 3 + (i + k) % 3 tokens)."""


@pytest.fixture(scope="module")
def segmented_moe(tiny_qwen3_moe_path: str) -> tuple[TrainBatch, list[list[np.ndarray]]]:
    """Episodes of several segments sampled by the torch engine, which recorded each segment's routing."""
    engine = make_engine("torch", tiny_qwen3_moe_path, seed=0, record_routed_experts=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [[torch.randint(1, 4000, (p,), generator=gen).tolist() for p in layout] for layout in SEGMENTS]

    async def sample():
        return await asyncio.gather(*(
            asyncio.gather(*(engine.generate(p, SamplingConfig(max_tokens=3 + (i + k) % 3, seed=10 * i + k))
                             for k, p in enumerate(episode)))
            for i, episode in enumerate(prompts)
        ))

    episodes, routing = [], []
    for i, (episode, completions) in enumerate(zip(prompts, asyncio.run(sample()))):
        ids, mask, behavior, starts, routed = [], [], [], [], []
        for prompt, completion in zip(episode, completions):
            n = len(prompt) + len(completion.token_ids)
            seg_routing = np.full((n, 2, 2), NO_ROUTING, dtype=np.int16)
            seg_routing[: n - 1] = completion.routed_experts  # the segment's last token was never fed
            starts.append(len(ids))
            ids += prompt + completion.token_ids
            mask += [False] * len(prompt) + [True] * len(completion.token_ids)
            behavior += [0.0] * len(prompt) + completion.logprobs
            routed.append(seg_routing)
        episodes.append(Episode(prompt_id=f"p{i}", token_ids=ids, loss_mask=mask, behavior_logprobs=behavior,
                                reward=float(i % 3), routed_experts=np.concatenate(routed),
                                segment_starts=starts if len(starts) > 1 else None))
        routing.append(routed)
    return TrainBatch.from_episodes(episodes, pad_token_id=0), routing


def _spec(path: str, **overrides) -> LearnerSpec:
    fields = {"model": path, "lr": 1e-2, "grad_clip": None, "device": "cpu", "routing_replay": True, **overrides}
    return LearnerSpec(**fields, loss=FlashReinforceLossSpec(delta=1.0))


@pytest.mark.parametrize("options", [{"pack_sequences": False}, {"pack_sequences": True},
                                     {"pack_sequences": True, "max_tokens_per_micro_batch": 20}],
                         ids=["padded", "packed", "packed_micro"])
def test_at_lag_0_segments_replaying_their_routing_agree_with_the_engine(tiny_qwen3_moe_path, segmented_moe,
                                                                         options) -> None:
    batch, _ = segmented_moe
    assert batch.segment_positions is not None
    metrics = Learner(_spec(tiny_qwen3_moe_path, **options)).update(batch)
    assert metrics["applied"] == 1.0
    assert metrics["drift_max"] < 1e-8  # every segment scored as the engine sampled it, with its experts


def test_every_segment_token_routes_to_its_recorded_experts_padded(tiny_qwen3_moe_path, segmented_moe) -> None:
    # Padded, the forward sees one row per segment, right-padded to the longest segment, so the routing
    # is laid out the same way (padding: the live choice). Packed, the tokens keep their order.
    batch, routing = segmented_moe
    segments = [seg for episode in routing for seg in episode]  # [n_s, 2, 2] each, in batch order
    longest = max(len(s) for s in segments)
    pad = np.full((longest, 2, 2), NO_ROUTING, dtype=np.int16)
    rows = [np.concatenate([s, pad[: longest - len(s)]]) for s in segments]
    recorded = torch.from_numpy(np.concatenate(rows)).long()  # [S * Ts, layers, k]
    valid = (recorded >= 0).all(-1)  # [S * Ts, layers]

    learner = Learner(_spec(tiny_qwen3_moe_path, pack_sequences=False))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the learner's router has moved since the engine sampled
        for layer in learner.model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn(layer.mlp.gate.weight.shape, generator=gen) * 0.5)
    used: dict[int, list[torch.Tensor]] = {0: [], 1: []}  # per layer, the expert indices of every forward
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda _, args, i=i: used[i].append(args[1].clone()))
               for i, layer in enumerate(learner.model.model.layers)]
    learner.update(batch)
    for handle in handles:
        handle.remove()
    for layer in range(2):
        got = torch.cat(used[layer])  # [N, k]
        assert got.shape[0] == recorded.shape[0]
        assert bool((got == recorded[:, layer]).all(-1)[valid[:, layer]].all())
