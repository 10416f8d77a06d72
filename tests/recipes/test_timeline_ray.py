"""One timeline through the real recipe loop: the tiny model on the torch engine, a learner actor killed
after update 3 (the learner group restarts from the checkpoint at 2 and trains update 3 again), then the
driver stopped right after its checkpoint at 4 was saved, before update 4's row was written, and resumed
from that checkpoint. progress.jsonl holds every update once, labelled with the algorithm's iteration."""

from __future__ import annotations

import json

import pytest

from flashrl.algorithms.flash_reinforce.algorithm import FlashReinforce
from flashrl.recipes.preset import NodePlan, Preset
from flashrl.recipes.run import train

pytestmark = pytest.mark.ray

PRESET = Preset(name="timeline", description="tiny model, torch engine", success_metric="never/reached",
                success_threshold=float("inf"), stop_iters=5, node_plan=NodePlan(), needs_gpu=False)


class Killed(BaseException):
    """Stands in for SIGKILL of the driver: nothing of the recipe after the kill point runs."""


def test_rows_follow_the_algorithm_through_a_learner_restart_and_a_resume(
    ray_cluster, tiny_llama_path, tmp_path, monkeypatch
):
    from flashrl.algorithms import FlashReinforceConfig

    config = (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"preset": "easy_sums"})
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, engine="torch",
                     episodes_in_flight_per_env_runner=2, max_new_tokens=8, max_episode_tokens=128)
        .learners(num_learners=1, num_cpus_per_learner=0.5)
        .training(model=tiny_llama_path, train_batch_size=2, lr=1e-3)
        .reporting(tensorboard=False, console_every=0, results_dir=str(tmp_path / "results"))
        .checkpointing(checkpoint_frequency=2, checkpoint_export_policy=False)
        .resources(num_cpus_for_main_process=0.25)
    )
    report, periodic = FlashReinforce._report, FlashReinforce._periodic_checkpoint
    killed = []

    def report_then_kill_the_learner(self, metrics, *args, **kwargs):
        report(self, metrics, *args, **kwargs)
        if self.iteration + 1 == 3 and not killed:  # the next update finds the learner dead
            killed.append(True)
            self.learner_group.kill(0)

    def checkpoint_then_kill_the_driver(self, iteration, *args, **kwargs):
        periodic(self, iteration, *args, **kwargs)
        if iteration == 4:
            raise Killed

    monkeypatch.setattr(FlashReinforce, "_report", report_then_kill_the_learner)
    monkeypatch.setattr(FlashReinforce, "_periodic_checkpoint", checkpoint_then_kill_the_driver)
    out = tmp_path / "run"
    with pytest.raises(Killed):
        train(config, PRESET, stop_iters=5, stop_reward=float("inf"), output=str(out))
    monkeypatch.setattr(FlashReinforce, "_periodic_checkpoint", periodic)
    checkpoint = out / "checkpoints" / "checkpoint_000004"
    summary = train(config, PRESET, stop_iters=5, stop_reward=float("inf"), output=str(out), resume=str(checkpoint))

    rows = [json.loads(line) for line in (out / "progress.jsonl").read_text(encoding="utf-8").splitlines()]
    trained = [r for r in rows if "learners/version" in r]
    assert [(r["training_iteration"], r["learners/version"]) for r in trained] == [(i, i) for i in (1, 2, 3, 4, 5)]
    seams = [r for r in rows if "learners/version" not in r]
    assert seams == [{"learners_restarted_from_iteration": 2.0}, {"resumed_from_iteration": 4.0}]
    assert trained[2]["learners/num_restarts_lifetime"] == 1.0
    assert trained[2]["learners/num_lost_updates_lifetime"] == 1.0
    discarded = (out / "progress.discarded.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line).get("training_iteration") for line in discarded] == [None, 3.0]  # the abandoned 3
    assert summary.iterations == 5
    assert json.loads((out / "result.json").read_text(encoding="utf-8"))["iterations"] == 5
