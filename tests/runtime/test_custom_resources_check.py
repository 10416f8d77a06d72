"""Custom resources no alive node could grant (`custom_resources_per_env_runner`, `custom_resources_per_learner`)
fail at setup, before any actor starts, with what the nodes do offer: not after the engine start timeout.

The problems from per-node resources as `ray.nodes()` gives them; the setup check on the suite's local Ray.
"""

from __future__ import annotations

import time

import pytest

from flashrl.algorithms.flash_reinforce import algorithm as algorithm_module
from flashrl.algorithms.flash_reinforce.config import ConfigError
from flashrl.ray_utils import custom_resource_problems

HEAD = {"CPU": 4.0, "memory": 1e9, "object_store_memory": 1e8, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0}
WORKERS = [{"CPU": 2.0, "rollout_node": 2.0, "node:10.0.0.2": 1.0}, {"CPU": 2.0, "rollout_node": 1.0, "learner_node": 1.0}]


def test_a_name_no_alive_node_offers_names_the_close_one_and_what_the_nodes_offer():
    problems = custom_resource_problems({"custom_resources_per_env_runner": (2, {"rollout_nod": 1})}, [HEAD, *WORKERS])
    assert problems == [
        ("custom_resources_per_env_runner: expected resource names an alive node offers, got 'rollout_nod', which "
        "no alive node offers (the nodes offer: learner_node=1 (largest node 1), rollout_node=3 (largest node 2)). "
        "Fix: rename it to 'rollout_node', or start a node with it (ray start ... --resources='{\"rollout_nod\": 1}'); "
        "otherwise Ray keeps the actor pending until the start timeout.")
    ]
    alone = custom_resource_problems({"custom_resources_per_learner": (1, {"gpu_box": 1})}, [HEAD])
    assert "(the nodes offer: no custom resources). Fix: correct the name" in alone[0]


def test_one_actor_more_than_any_node_offers_and_more_in_all_than_the_nodes_offer():
    too_big = custom_resource_problems({"custom_resources_per_learner": (1, {"learner_node": 2})}, [HEAD, *WORKERS])
    assert too_big == [("custom_resources_per_learner: one actor asks for learner_node=2 but the largest node offers 1. "
                       "Fix: ask for at most 1 per actor, or start a node that offers more.")]
    too_many = custom_resource_problems({"custom_resources_per_env_runner": (2, {"rollout_node": 1}),
                                         "custom_resources_per_learner": (1, {"rollout_node": 2})}, [HEAD, *WORKERS])
    assert too_many == [("rollout_node: the learners and env runners ask for 4 in all but the alive nodes offer 3 "
                        "together. Fix: lower the per-actor amount or the number of actors, or add a node with rollout_node.")]


def test_what_some_alive_node_offers_passes_in_use_or_not():
    requests = {"custom_resources_per_env_runner": (3, {"rollout_node": 1}),
                "custom_resources_per_learner": (1, {"learner_node": 0.5, "node:__internal_head__": 0.01})}
    assert custom_resource_problems(requests, [HEAD, *WORKERS]) == []
    # No actor (a local learner) or a zero amount asks for nothing: nothing to place.
    assert custom_resource_problems({"custom_resources_per_learner": (0, {"absent": 1}),
                                     "custom_resources_per_env_runner": (1, {"absent": 0})}, [HEAD]) == []


@pytest.mark.ray
def test_setup_fails_before_any_actor_starts_on_the_local_ray(ray_cluster, tiny_config, monkeypatch):
    def no_actor(*args, **kwargs):
        raise AssertionError("an actor was started before the custom resources were checked")

    monkeypatch.setattr(algorithm_module.FlashReinforce, "_new_learner_group", no_actor)
    monkeypatch.setattr(algorithm_module, "EnvRunnerGroup", no_actor)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        tiny_config(custom_resources_per_env_runner={"rollout_node": 1}).build_algo()
    assert time.perf_counter() - start < 120  # the setup's env check and Ray's join, not the 900 s start timeout
    text = str(caught.value)
    assert text.startswith("Custom resource requests the Ray cluster cannot grant:\n  - custom_resources_per_env_runner: "
                           "expected resource names an alive node offers, got 'rollout_node', which no alive node offers")
    # Pinning to the head node (Ray's own node resource) passes the check: the run goes on to start its actors.
    with pytest.raises(AssertionError, match="an actor was started"):
        tiny_config(num_learners=1, custom_resources_per_learner={"node:__internal_head__": 0.01}).build_algo()
