"""LearnerGroup: local mode, Ray actors, 2 FSDP2-sharded learners == 1, actor death.

The two actors shard the policy with FSDP2 (gloo) and run micro-batches of packed sequences; the
single learner runs one padded pass. Equal updates check the sharded reduce-scatter, the global
normalisers across ranks and micro-batches, the global clipping norm, and the idle passes of a rank
with fewer micro-batches than the other (the 5-episode batch).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashrl.learners import Learner, LearnerGroup, LearnerGroupError
from flashrl.weight_sync.messages import PutBuckets

pytestmark = pytest.mark.ray

# Shards of the 6-episode batch are 3 + 3 rows, of the 5-episode batch 3 + 2: uneven shards are covered.
DP_OPTIONS = {
    "optimizer": "sgd",
    "lr": 1e-2,
    "grad_clip": 0.5,  # the clip must use the global norm
    "delta": 0.012,  # some trajectories rejected, some accepted
    "negative_token_fraction": 0.5,  # needs the global batch's success labels on every shard
}
COMPARED = (
    "loss", "grad_norm", "accepted_fraction", "num_rejected", "drift_mean", "drift_max", "ratio_mean",
    "ratio_max", "ratio_min", "advantage_mean", "advantage_std", "reward_mean", "entropy_mean",
    "tokens_valid", "tokens_kept", "tokens_total", "episodes", "version", "applied",
)


SHARDED_OPTIONS = {"max_tokens_per_micro_batch": 16, "pack_sequences": True}  # 3 + 3 and 3 + 2 passes


@pytest.fixture(scope="module")
def two_learners(ray_cluster, make_spec):
    spec = make_spec(**DP_OPTIONS, **SHARDED_OPTIONS)
    group = LearnerGroup(spec, num_learners=2, num_cpus_per_learner=1.0, timeout_s=240.0)
    yield group
    group.shutdown()


def _assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *,
                         atol: float = 1e-6) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0 if atol < 1e-6 else 1e-5, atol=atol, msg=name)


def test_two_learners_give_the_same_updates_as_one(two_learners, make_spec, batch, next_batch):
    from flashrl.learners.packing import plan_micro_batches

    plans = [plan_micro_batches(b.attention_mask.sum(-1), world_size=2, max_tokens_per_micro_batch=16)
             for b in (batch, next_batch)]
    counts = [[len(r.micro_batches) for r in plan.ranks] for plan in plans]
    assert any(len(set(c)) > 1 for c in counts), counts  # a rank runs an idle pass
    single = Learner(make_spec(**DP_OPTIONS))
    for b in (batch, next_batch):
        expected = single.update(b)
        metrics = two_learners.update(b)
        assert 0 < expected["accepted_fraction"] <= 1
        for key in COMPARED:
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        _assert_same_weights(two_learners.get_weights(), single.get_weights())
    assert two_learners.version == single.version == 2
    assert metrics["grad_norm"] > DP_OPTIONS["grad_clip"]  # clipping was active


def test_state_weight_stream_and_policy_through_actors(two_learners, make_spec, batch, tmp_path, ray_cluster):
    local = LearnerGroup(make_spec(**DP_OPTIONS), local=True)
    state = local.get_state()
    two_learners.set_state(state)  # both replicas
    assert two_learners.version == 0
    # The weight stream the runners fetch: buckets of object refs, every tensor once (tied ones once).
    buckets = two_learners.sync_weights(PutBuckets(bucket_bytes=64 * 1024))
    assert len(buckets.buckets) > 1
    streamed: dict[str, torch.Tensor] = {}
    for ref, metas in zip(buckets.buckets, buckets.manifest):
        bucket = ray_cluster.get(ref, timeout=60)
        assert list(bucket) == [m.name for m in metas]
        streamed.update(bucket)
    expected_weights = local.get_weights()
    _assert_same_weights(streamed, {n: expected_weights[n] for n in streamed})
    assert set(expected_weights) - set(streamed) <= {"lm_head.weight"}  # tied to the embedding
    expected = local.update(batch)
    metrics = two_learners.update(batch)
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    _assert_same_weights(two_learners.get_weights(), local.get_weights())
    path = two_learners.save_policy(tmp_path / "policy")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _assert_same_weights(loaded.state_dict(), local.get_weights())
    local.shutdown()
    with pytest.raises(LearnerGroupError, match="shut down"):
        local.update(batch)


def test_sharded_ranks_skip_a_non_finite_batch_together(two_learners, make_spec, batch):
    """NaN log-probs: each rank still runs its backward passes (zero loss), then all agree to skip."""
    state = LearnerGroup(make_spec(**DP_OPTIONS), local=True).get_state()
    broken = {**state, "model": {**state["model"], "model.norm.weight": state["model"]["model.norm.weight"].clone()}}
    broken["model"]["model.norm.weight"][0] = float("nan")
    two_learners.set_state(broken)
    before = two_learners.get_weights()
    metrics = two_learners.update(batch)
    assert (metrics["applied"], metrics["skipped/non_finite_logprobs"]) == (0.0, 1.0)
    after = two_learners.get_weights()
    for name, value in before.items():  # nothing stepped: the NaN weight included, bit for bit
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, equal_nan=True, msg=name)
    two_learners.set_state(state)  # the group goes on: a finite batch updates again
    assert two_learners.update(batch)["applied"] == 1.0 and two_learners.version == 1


def test_bad_requests_are_refused_clearly(two_learners, make_spec, batch):
    with pytest.raises(ValueError, match="cannot be split over 2 learners"):
        two_learners.update(batch.rows(slice(0, 1)))
    with pytest.raises(ValueError, match="local=True runs exactly one"):
        LearnerGroup(make_spec(), num_learners=2, local=True)
    with pytest.raises(ValueError, match="device='cpu'"):
        LearnerGroup(make_spec(device="cpu"), num_gpus_per_learner=1.0)
    with pytest.raises(ValueError, match="whole GPU per rank"):
        LearnerGroup(make_spec(device="auto"), num_learners=2, num_gpus_per_learner=0.5)


def test_sharded_adamw_state_moves_to_one_learner_and_back(ray_cluster, make_spec, batch, next_batch, tmp_path):
    # float64: AdamW divides tiny gradient entries by their own tiny moments, which turns float32
    # summation-order noise into 1% of a step; in float64 the two paths agree to 1e-10.
    options = {**DP_OPTIONS, "optimizer": "adamw", "lr": 1e-3, "dtype": "float64"}
    # The shards also checkpoint their activations and keep parameters and optimizer state in host memory.
    sharded = {**SHARDED_OPTIONS, "gradient_checkpointing": True, "optimizer_offload": True}
    group = LearnerGroup(make_spec(**options, **sharded), num_learners=2, num_cpus_per_learner=0.5,
                         timeout_s=240.0)
    try:
        single, untouched = Learner(make_spec(**options)), Learner(make_spec(**options))
        single.set_state(group.get_state())  # a fresh state: reading it must not touch the optimizer
        for learner in (single, untouched, group):
            learner.update(batch)
        _assert_same_weights(group.get_weights(), untouched.get_weights(), atol=1e-10)
        _assert_same_weights(single.get_weights(), untouched.get_weights(), atol=1e-10)
        single.set_state(group.get_state())  # gathered from the shards: full tensors by name
        assert single.version == 1 and len(single.optimizer.state) > 0
        expected = single.update(next_batch)
        metrics = group.update(next_batch)  # both continue from the same AdamW moments
        for key in COMPARED:
            assert metrics[key] == pytest.approx(expected[key], rel=1e-10, abs=1e-12), key
        _assert_same_weights(group.get_weights(), single.get_weights(), atol=1e-10)

        single.update(batch)
        group.set_state(single.get_state())  # and back: each rank keeps its shards of the moments
        expected, metrics = single.update(next_batch), group.update(next_batch)
        assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-10)
        _assert_same_weights(group.get_weights(), single.get_weights(), atol=1e-10)
        assert group.version == single.version == 4

        # DCP: each rank writes its own shards; loading them back rewinds to that exact state.
        folder = group.save_state(tmp_path / "sharded")
        assert sorted(p.name for p in Path(folder).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        expected = group.update(batch)
        weights = group.get_weights()
        group.update(next_batch)
        group.load_state(folder)
        assert group.version == 4
        again = group.update(batch)
        assert {k: again[k] for k in COMPARED} == {k: expected[k] for k in COMPARED}
        _assert_same_weights(group.get_weights(), weights, atol=0.0)

        fresh = Learner(make_spec(**options))
        group.set_state(fresh.get_state())  # version 0: the optimizer has not stepped
        group.load_state(group.save_state(tmp_path / "fresh"))
        fresh.update(batch)
        group.update(batch)
        _assert_same_weights(group.get_weights(), fresh.get_weights(), atol=1e-10)
    finally:
        group.shutdown()


def test_actor_death_is_a_clear_error_never_swallowed(two_learners, ray_cluster, batch):
    # Runs last in this module: it breaks the shared group on purpose.
    two_learners.kill(1)  # returns once the actor is dead (ray.kill alone may land after the next call starts)
    with pytest.raises(LearnerGroupError, match=r"learner actor rank 1 died during 'update'"):
        two_learners.update(batch)
    with pytest.raises(LearnerGroupError, match="cannot be used"):
        two_learners.get_weights()


def test_a_learner_actor_takes_the_runs_log_level(make_spec, monkeypatch):
    """The debugging section's log_level reaches the learners' processes, as it reaches the env runners'."""
    import logging

    from flashrl.algorithms.flash_reinforce import FlashReinforceConfig
    from flashrl.learners.group import LearnerActor

    config = FlashReinforceConfig().debugging(log_level="DEBUG")
    assert config.learner_spec().log_level == "DEBUG"
    logger = logging.getLogger("flashrl")
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    LearnerActor(make_spec(log_level="DEBUG"), 0, 1)
    assert logger.level == logging.DEBUG
    LearnerActor(make_spec(), 0, 1)
    assert logger.level == logging.WARNING
