"""Streamed weights through the runners: coalescing fetches nothing it skips, a restart loads them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashrl.env_runners import EnvRunner, EnvRunnerGroup
from flashrl.learners.weight_gather import iter_weight_buckets, put_weight_buckets, weight_manifest
from flashrl.weight_sync.messages import LoadWeights
from flashrl.weight_sync.wire import WeightBuckets


def _model(path: str, shift: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.add_(shift)
    return model


def test_coalesced_versions_are_never_fetched(tiny_config) -> None:
    """v1 loads slowly; v2 and v3 arrive meanwhile: v3 loads next and v2's buckets are never asked for."""
    config = tiny_config(env="flashrl-test/Parity-v0")
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)
    fetched: dict[int, int] = {1: 0, 2: 0, 3: 0}

    def stream(version: int, delay_s: float) -> WeightBuckets:
        model = _model(config.model, float(version))
        manifest = weight_manifest(model, bucket_bytes=2**18)

        async def buckets():
            for bucket in iter_weight_buckets(model, manifest):
                fetched[version] += 1
                await asyncio.sleep(delay_s)
                yield bucket

        return WeightBuckets(manifest, buckets())

    async def scenario():
        await runner.setup()
        first = asyncio.create_task(runner.weight_sync(LoadWeights(1, stream(1, 0.2))))
        await asyncio.sleep(0.05)  # v1 is loading
        results = await asyncio.gather(first, runner.weight_sync(LoadWeights(2, stream(2, 0.0))),
                                       runner.weight_sync(LoadWeights(3, stream(3, 0.0))))  # fmt: skip
        norm = runner._engine.model.model.norm.weight.detach().clone()
        await runner.stop()
        return results, norm

    results, norm = asyncio.run(scenario())
    assert results[-1] == 3
    num_buckets = len(weight_manifest(_model(config.model, 0.0), bucket_bytes=2**18))
    assert fetched == {1: num_buckets, 2: 0, 3: num_buckets}
    assert torch.allclose(norm, _model(config.model, 3.0).model.norm.weight)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_restarted_runner_loads_the_streamed_weights_first(ray_session, tiny_config, replacement_versions) -> None:
    config = tiny_config(env="flashrl-test/Parity-v0", num_env_runners=1)
    stream = put_weight_buckets(_model(config.model, 0.5), bucket_bytes=2**18)  # object refs, one per bucket
    assert stream is not None and len(stream.buckets) >= 4
    group = EnvRunnerGroup(config.env_runner_spec(), model_path=config.model)
    try:
        group.setup()
        group.start_streaming()
        assert group.next_reports(30.0)
        group.broadcast_weights(5, stream)
        group.kill(0)
        versions = replacement_versions(group)
        assert group.num_restarts == 1
        assert len(versions) >= 8 and set(versions) == {5}
    finally:
        group.stop()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_check_alive_replaces_a_dead_runner_with_the_learners_weights(ray_session, tiny_config, replacement_versions) -> None:
    """What a push route relies on: a dead runner is found before a transfer, its replacement gets
    the learner's current weights from its weights source (nothing was broadcast), the generation moves."""
    config = tiny_config(env="flashrl-test/Parity-v0", num_env_runners=1)
    group = EnvRunnerGroup(config.env_runner_spec(), model_path=config.model)
    asked: list[int] = []

    def learner_weights():
        asked.append(7)
        return 7, put_weight_buckets(_model(config.model, 0.25), bucket_bytes=2**18)

    try:
        facts = group.setup()
        assert facts["weight_sync"] == "shm" and group.transfer_workers == [1]  # the torch engine pulls
        with pytest.raises(TypeError, match="expected a callable"):
            group.set_weights_source((7, None))  # type: ignore[arg-type]
        group.set_weights_source(learner_weights)
        group.start_streaming()
        assert group.next_reports(30.0)
        before = group.generation
        assert group.check_alive() == 0 and asked == [] and group.generation == before
        group.kill(0)
        assert group.check_alive() == 1
        # the dead runner leaves the transfer group (+1), its replacement joins it once placed (+1)
        assert group.generation == before + 2 and group.num_restarts == 1 and asked == [7]
        versions = replacement_versions(group)
        assert len(versions) >= 8 and set(versions) == {7}
    finally:
        group.stop()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_algorithm_sends_each_update_through_a_push_route(ray_session, tiny_config, monkeypatch) -> None:
    """With a push route, `step` pushes every new version (no object-store broadcast), and `stop` tears
    the group down. The torch engine pulls, so the route is set up as `route_for` does for a vLLM
    engine on a GPU, and vLLM's trainer engine is replaced at `start_push_transfer`."""
    from flashrl.weight_sync import push
    from flashrl.weight_sync.push import PushRoute
    from flashrl.weight_sync.shm import ShmRoute

    events: list = []

    class Engine:
        def __init__(self, client) -> None:
            self.client = client

        def send_weights(self) -> None:
            events.append(("send", self.client.version()))

        def shutdown(self) -> None:
            events.append(("shutdown",))

    monkeypatch.setattr(push, "start_push_transfer", lambda transport, weights, client, **kwargs: Engine(client))
    algo = tiny_config().build_algo()  # a local learner: the replaced engine runs in this process
    try:
        assert isinstance(algo._weight_sync, ShmRoute)  # the torch engine's route is the shm stream
        assert algo._weight_sync.wait_for_load is False  # async: the runners load while they sample
        algo._weight_sync = PushRoute("nccl")
        algo._weight_sync.setup(algo.learner_group, algo.env_runner_group)
        broadcasts: list = []
        monkeypatch.setattr(algo.env_runner_group, "broadcast_weights", lambda *a, **k: broadcasts.append(a) or 0.0)
        results = [algo.train() for _ in range(2)]
        assert events == [("send", 1), ("send", 2)] and broadcasts == []
        assert all(r["timers/weight_sync_s"] > 0 for r in results)
    finally:
        algo.stop()
    assert events[-1] == ("shutdown",)
