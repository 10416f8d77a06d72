"""The learner replays the routing the engine recorded (R3): episodes from the torch engine, a tiny Qwen3-MoE."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from flashrl.algorithms.flash_reinforce.learner_loss import FlashReinforceLossSpec
from flashrl.engines import SamplingConfig, engine_options_for_run, make_engine
from flashrl.episode import Episode
from flashrl.learners import Learner, LearnerSpec, TrainBatch
from flashrl.learners.packing import gather_rows, plan_micro_batches
from flashrl.models.routing_replay import NO_ROUTING
from flashrl.validation import SpecError

BUDGET = 24
"""Tokens per micro-batch: the six episodes take several passes."""


@pytest.fixture(scope="module")
def moe_batch(tiny_qwen3_moe_path: str) -> TrainBatch:
    """Six ragged episodes sampled (batched) by the torch engine, which recorded their routing."""
    engine = make_engine("torch", tiny_qwen3_moe_path, seed=0, record_routed_experts=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 4000, (3 + i % 3,), generator=gen).tolist() for i in range(6)]

    async def sample():
        return await asyncio.gather(*(
            engine.generate(p, SamplingConfig(max_tokens=4 + 2 * i, seed=i)) for i, p in enumerate(prompts)
        ))

    episodes = []
    for i, (prompt, completion) in enumerate(zip(prompts, asyncio.run(sample()))):
        n = len(prompt) + len(completion.token_ids)
        routed = np.full((n, 2, 2), NO_ROUTING, dtype=np.int16)
        routed[: n - 1] = completion.routed_experts  # the last token was never fed
        episodes.append(Episode(
            prompt_id=f"p{i}", token_ids=prompt + completion.token_ids,
            loss_mask=[False] * len(prompt) + [True] * len(completion.token_ids),
            behavior_logprobs=[0.0] * len(prompt) + completion.logprobs, reward=float(i % 3), routed_experts=routed,
        ))
    return TrainBatch.from_episodes(episodes, pad_token_id=0)


@contextlib.contextmanager
def experts_inputs(model: torch.nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """The expert indices each layer's experts computed with, per forward: ``{layer: [[N, k], ...]}``."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, i=i):
            seen.setdefault(i, []).append(args[1].detach().clone())

        handles.append(layer.mlp.experts.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _move_routers(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=gen) * w.std())


def _spec(path: str, **overrides) -> LearnerSpec:
    fields = {"model": path, "lr": 1e-2, "grad_clip": None, "device": "cpu", "routing_replay": True,
              "max_tokens_per_micro_batch": BUDGET, **overrides}
    return LearnerSpec(**fields, loss=FlashReinforceLossSpec(delta=1.0))


@pytest.mark.parametrize("options", [{"pack_sequences": False},
                                     {"pack_sequences": True, "gradient_checkpointing": True}])
def test_at_lag_0_the_replaying_learner_agrees_with_the_engine(tiny_qwen3_moe_path, moe_batch, options) -> None:
    metrics = Learner(_spec(tiny_qwen3_moe_path, **options)).update(moe_batch)
    assert metrics["applied"] == 1.0 and metrics["num_micro_batches"] >= 2
    assert metrics["drift_max"] < 1e-8  # float32 engine and learner, the same experts: the same log-probs


@pytest.mark.parametrize("pack", [False, True])
def test_the_learner_routes_to_the_recorded_experts_after_its_router_moved(tiny_qwen3_moe_path, moe_batch, pack):
    lengths = moe_batch.attention_mask.sum(-1)
    layout = plan_micro_batches(lengths, max_tokens_per_micro_batch=BUDGET)
    expected = []  # per pass: the recorded routing in the order the forward flattens the tokens
    for members in layout.for_rank(0).micro_batches:
        rows = gather_rows(moe_batch, members.indices)
        routed = rows.routed_experts[rows.attention_mask] if pack else rows.routed_experts.flatten(0, 1)
        expected.append(routed.long())  # [N, layers, k]
    recorded = torch.cat(expected)
    valid = (recorded >= 0).all(-1)  # [N, layers]: positions the engine fed (not the last, not padding)
    assert int(valid[:, 0].sum()) == int(lengths.sum()) - moe_batch.batch_size

    drift = {}
    for replay in (True, False):
        learner = Learner(_spec(tiny_qwen3_moe_path, pack_sequences=pack, routing_replay=replay))
        _move_routers(learner.model)  # the learner's router has moved since the engine sampled
        with experts_inputs(learner.model) as used:
            drift[replay] = learner.update(moe_batch)["drift_mean"]
        for layer in range(2):
            got = torch.cat(used[layer])  # [N, k]
            same = (got == recorded[:, layer]).all(-1)[valid[:, layer]]  # [tokens the engine routed]
            if replay:
                assert bool(same.all())  # every token, every layer: the engine's experts
            else:
                assert float(same.float().mean()) < 0.7  # unreplayed, the moved router routes elsewhere
    assert drift[True] < drift[False]


def test_batches_carry_the_routing_aligned_with_the_tokens(moe_batch: TrainBatch) -> None:
    episodes = [Episode(prompt_id="a", token_ids=[1, 2, 3], loss_mask=[False, True, True],
                        behavior_logprobs=[0.0, -1.0, -1.0], reward=0.0,
                        routed_experts=np.array([[[0, 1]], [[2, 3]], [[-1, -1]]], dtype=np.int16)),
                Episode(prompt_id="b", token_ids=[4, 5, 6, 7], loss_mask=[False, True, True, True],
                        behavior_logprobs=[0.0, -1.0, -1.0, -1.0], reward=1.0)]  # recorded none
    batch = TrainBatch.from_episodes(episodes, pad_token_id=0)
    expected = torch.full((2, 4, 1, 2), -1, dtype=torch.int16)
    expected[0, :2, 0] = torch.tensor([[0, 1], [2, 3]])
    assert torch.equal(batch.routed_experts, expected)  # padding and the episode without routing: -1
    assert torch.equal(gather_rows(batch, [0]).routed_experts, expected[:1, :3])
    assert torch.equal(batch.rows(slice(1, 2)).routed_experts, expected[1:])
    assert TrainBatch.from_episodes(episodes[1:], pad_token_id=0).routed_experts is None
    with pytest.raises(ValueError, match="different \\(layers, top_k\\) shapes"):
        TrainBatch.from_episodes([episodes[0], Episode(
            prompt_id="c", token_ids=[1, 2], loss_mask=[False, True], behavior_logprobs=[0.0, -1.0], reward=0.0,
            routed_experts=np.zeros((2, 2, 2), dtype=np.int16))], pad_token_id=0)
    with pytest.raises(ValueError, match="routed_experts must be None or an integer array \\[3, layers, top_k\\]"):
        Episode(prompt_id="d", token_ids=[1, 2, 3], loss_mask=[False, True, True], behavior_logprobs=[0.0] * 3,
                reward=0.0, routed_experts=np.zeros((2, 1, 2), dtype=np.int16))
    with pytest.raises(ValueError, match="TrainBatch.routed_experts must be None or \\[2, 4, layers, top_k\\]"):
        batch.derived(routed_experts=None).__class__(**{**vars(batch), "routed_experts": expected.long()})


def test_routing_replay_is_refused_where_it_cannot_work(tiny_llama_path, tiny_qwen3_moe_path, moe_batch) -> None:
    with pytest.raises(SpecError, match="routing_replay: expected False for this model, or a mixture-of-experts"):
        _spec(tiny_llama_path)
    learner = Learner(_spec(tiny_qwen3_moe_path))
    with pytest.raises(ValueError, match="no episode of the batch recorded its routed experts"):
        learner.update(moe_batch.derived(routed_experts=None))
    with pytest.raises(ValueError, match="expected \\[\\.\\.\\., 2, 2\\]"):
        learner.update(moe_batch.derived(routed_experts=moe_batch.routed_experts[..., :1]))
    assert learner.version == 0


def test_the_config_asks_the_engines_to_record_and_refuses_a_dense_model(tiny_qwen3_moe_path: str) -> None:
    from flashrl.algorithms import FlashReinforceConfig
    from flashrl.algorithms.flash_reinforce.config import ConfigError

    config = FlashReinforceConfig().environment("flashrl/Math-v0").training(model=tiny_qwen3_moe_path,
                                                                              routing_replay=True)
    config.validate()
    assert config.env_runner_spec().routing_replay is True  # the engines record
    assert config.learner_spec(model=tiny_qwen3_moe_path).routing_replay is True  # the learners replay
    assert FlashReinforceConfig().learner_spec(model=tiny_qwen3_moe_path).routing_replay is False
    with pytest.raises(ConfigError, match="routing_replay: expected False for this model.*'smollm2-135m-instruct' "
                                          "is a dense model"):
        config.training(model="smollm2-135m-instruct").validate()
    options = engine_options_for_run("torch", {}, max_model_len=64, num_seqs=2, record_routed_experts=True)
    assert options["record_routed_experts"] is True
    with pytest.raises(ValueError, match="engine_options sets record_routed_experts=False"):
        engine_options_for_run("vllm", {"record_routed_experts": False}, max_model_len=64, num_seqs=2,
                               record_routed_experts=True)
