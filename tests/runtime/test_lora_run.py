"""A LoRA run end to end on the torch engine: the plan's lora route carries the adapter to the runners, the
checkpoint holds the adapter (its policy folder loads in peft), a resume gives the same next update and
`flashrl eval` scores the checkpoint (its adapter merged into the config's model). With one learner in the
driver and with two FSDP2-sharded learner actors (gloo)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from flashrl.algorithms import FlashReinforce


@pytest.mark.parametrize("num_learners", [0, 2])
def test_a_lora_run_pushes_its_adapter_checkpoints_it_and_resumes_exactly(ray_session, tiny_config,
                                                                        exact_sync_group, tmp_path, capsys,
                                                                        num_learners):
    config = tiny_config(**exact_sync_group, lora_rank=8, lora_alpha=16.0, num_learners=num_learners,
                         num_cpus_per_learner=0.5)
    algo = config.build_algo()
    try:
        assert algo.plan.weight_sync == "lora"
        before = algo.learner_group.get_weights()
        algo.train()
        algo.train()
        path = algo.save_to_path(str(tmp_path / "ckpt"))
        expected = algo.train()
        expected_weights = algo.learner_group.get_weights()
    finally:
        algo.stop()
    assert expected["env_runners/policy_lag_max"] == 0  # sync_group: the runners sampled the pushed adapter
    adapter = [k for k in before if ".lora_" in k]
    assert adapter and any(not torch.equal(before[k], expected_weights[k]) for k in adapter)
    assert all(torch.equal(before[k], expected_weights[k]) for k in before if ".lora_" not in k)  # frozen base
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(os.path.join(path, "policy")))

    resumed = FlashReinforce.from_checkpoint(path)
    try:
        got = resumed.train()
        got_weights = resumed.learner_group.get_weights()
    finally:
        resumed.stop()
    assert got["learners/loss"] == expected["learners/loss"]
    for name in adapter:
        assert torch.equal(got_weights[name], expected_weights[name]), name

    from flashrl.cli import main

    capsys.readouterr()
    assert main(["eval", path, "--num-episodes", "2", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["evaluation/num_episodes"] == 2.0
