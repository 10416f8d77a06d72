"""A run on a Ray cluster of several nodes (all on this machine, `ray.cluster_utils.Cluster`): the learner and
the env runners are pinned to different nodes by custom resources, train, checkpoint to a folder every node
reads, lose a worker node (the run goes on with fewer runners, counted), get a node back (the missing runner
starts again, no restart), and resume from the checkpoint with the roles of the nodes swapped.

Slow (four Ray nodes at once on a 2-core machine: 84 s here): run it with ``pytest -m slow tests/runtime/test_multi_node.py``
each session that touches the runtime. The bookkeeping alone is tests/runtime/test_elastic_runners.py.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import pytest
import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster

from flashrl.env_runners import group as group_module

pytestmark = [pytest.mark.ray, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the node probe below reaches the actors by value


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=120)


@pytest.fixture
def cluster(local_ray_options):
    """A head (no custom resource) and three worker nodes: one for the learner, two for the env runners.

    The session's local cluster, when a test before started it, is shut down for this one and started
    again after it.
    """
    was_up = ray.is_initialized()
    ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes.learner = nodes.add_node(num_cpus=1, resources={"learner_node": 1})
        nodes.rollout = [nodes.add_node(num_cpus=1, resources={"rollout_node": 1}) for _ in range(2)]
        ray.init(address=nodes.address, log_to_driver=False, runtime_env=local_ray_options["runtime_env"])
        nodes.wait_for_nodes()
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if was_up:
            ray.init(**local_ray_options)


@pytest.mark.timeout(900)
def test_learner_and_runners_on_their_nodes_survive_a_node_loss_and_resume_elsewhere(
    cluster, tiny_config, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(group_module, "PLACEMENT_WAIT_S", 1.0)  # say it at once: the node is gone for good
    placed = {"num_learners": 1, "num_cpus_per_learner": 0.5, "num_env_runners": 2, "tensorboard": False}
    algo = tiny_config(**placed, custom_resources_per_learner={"learner_node": 1},
                       custom_resources_per_env_runner={"rollout_node": 1}).build_algo()
    try:
        first = algo.train()
        assert (first["env_runners/num_healthy"], first["env_runners/num_configured"]) == (2.0, 2.0)
        assert _node_of(algo.learner_group._actors[0]) == cluster.learner.node_id
        runner_nodes = [_node_of(actor) for actor in algo.env_runner_group.actors]
        assert sorted(runner_nodes) == sorted(node.node_id for node in cluster.rollout)

        # A worker node leaves: its runner dies, and no other node has a free rollout_node for the replacement.
        cluster.remove_node(cluster.rollout[1])
        with caplog.at_level(logging.WARNING, logger="flashrl.env_runners"):
            deadline = time.monotonic() + 120  # the death shows once Ray reports it (the GCS's node health check)
            while (result := algo.train())["env_runners/num_healthy"] != 1.0 and time.monotonic() < deadline:
                pass
            # trains on with the runner it has, at least until the wait for a node was said (PLACEMENT_WAIT_S above:
            # on a fast machine three updates take less than that)
            degraded, deadline = [result], time.monotonic() + 60
            while len(degraded) < 3 or (not _said_cannot_be_placed(caplog) and time.monotonic() < deadline):
                degraded.append(algo.train())
        assert {r["env_runners/num_healthy"] for r in degraded} == {1.0}
        assert degraded[-1]["env_runners/num_configured"] == 2.0
        assert degraded[-1]["env_runners/num_restarts_lifetime"] == 1.0
        assert _said_cannot_be_placed(caplog)

        # A node with room joins: the waiting runner starts there, without a restart of the run.
        back = cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
        cluster.wait_for_nodes()
        deadline = time.monotonic() + 120  # by time, not updates: a fast machine's updates outrun the actor's start
        while (result := algo.train())["env_runners/num_healthy"] != 2.0 and time.monotonic() < deadline:
            pass
        assert result["env_runners/num_healthy"] == 2.0
        assert result["env_runners/num_restarts_lifetime"] == 1.0  # the same replacement, started late
        assert back.node_id in {_node_of(actor) for actor in algo.env_runner_group.actors}
        checkpoint = algo.save_to_path(str(tmp_path / "checkpoint"), export_policy=False)  # every node reads it
        saved_iteration = result["training_iteration"]
    finally:
        algo.stop()

    # Resume with the roles swapped: the learner on a rollout node, both runners on the learner node.
    resumed = tiny_config(**placed, custom_resources_per_learner={"rollout_node": 1},
                          custom_resources_per_env_runner={"learner_node": 0.5}).build_algo()
    try:
        resumed.restore_from_path(checkpoint)
        after = resumed.train()
        assert after["training_iteration"] == saved_iteration + 1
        assert after["env_runners/num_healthy"] == 2.0
        assert _node_of(resumed.learner_group._actors[0]) in {cluster.rollout[0].node_id, back.node_id}
        assert {_node_of(actor) for actor in resumed.env_runner_group.actors} == {cluster.learner.node_id}
    finally:
        resumed.stop()


def _said_cannot_be_placed(caplog: Any) -> bool:
    return any("cannot be placed" in r.getMessage() and "1 of 2 env runners" in r.getMessage() for r in caplog.records)
