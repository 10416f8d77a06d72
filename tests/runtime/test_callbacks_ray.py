"""Callbacks through real Ray actors (the tiny model, the torch engine): every hook fires in its process
the right number of times, callback metrics reach the result, a callback stops the recipe loop and a
Tune trial, rollout dumps are written and `flashrl show` prints them, evaluations reach the console."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from flashrl.callbacks import FlashReinforceCallbacks

pytestmark = pytest.mark.ray

B = 4


class Recorder(FlashReinforceCallbacks):
    """Appends one JSON line per hook call (process id, Ray actor id) to `log_path`; logs metrics."""

    log_path = ""
    stop_at = 2

    def _record(self, hook: str, **fields) -> None:
        import ray

        actor = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"hook": hook, "pid": os.getpid(), "actor": actor, **fields}) + "\n")

    def on_algorithm_init(self, *, algorithm, metrics_logger, **kwargs):
        self._record("on_algorithm_init")
        metrics_logger.log_value("init", 1.0)

    def on_episode_end(self, *, episode, env_runner, metrics_logger, env, env_index, is_evaluation, split,
                       **kwargs):
        self._record("on_episode_end", evaluation=is_evaluation, index=env_index, runner=env_runner.runner_index,
                     has_env=env is not None, turns=len(episode.policy_versions))
        metrics_logger.log_value("ended", 1, reduce="sum")

    def on_sample_end(self, *, env_runner, metrics_logger, samples, is_evaluation, **kwargs):
        self._record("on_sample_end", evaluation=is_evaluation, n=len(samples))
        metrics_logger.log_value("sampled", len(samples), reduce="sum")

    def on_train_result(self, *, algorithm, metrics_logger, result, iteration, episodes, **kwargs):
        self._record("on_train_result", iteration=iteration, saw_sampled="callbacks/sampled" in result)
        metrics_logger.log_value("iteration_seen", iteration, reduce="max")
        result["my/batch_size"] = len(episodes)
        if iteration >= self.stop_at:
            result["should_stop"] = True

    def on_evaluate_start(self, *, algorithm, metrics_logger, **kwargs):
        self._record("on_evaluate_start", version=algorithm.learner_group.version)

    def on_evaluate_end(self, *, algorithm, metrics_logger, evaluation_metrics, reports, **kwargs):
        self._record("on_evaluate_end", n=evaluation_metrics["evaluation/num_episodes"])
        evaluation_metrics["my/evaluated"] = 1.0

    def on_checkpoint_loaded(self, *, algorithm, path, **kwargs):
        self._record("on_checkpoint_loaded", path=path)


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_every_hook_fires_in_its_process_and_metrics_stops_dumps_and_show(ray_session, tiny_config, tmp_path,
                                                                           capsys):
    from flashrl.cli import main as cli
    from flashrl.recipes.run import _train_loop

    Recorder.log_path = str(tmp_path / "events.jsonl")
    config = tiny_config(evaluation_interval=2, evaluation_at_start=True, evaluation_num_episodes=2,
                         rollout_dump_every=1, rollout_dump_count=2, tensorboard=True)
    config.callbacks(Recorder)
    algo = config.build_algo()
    try:
        history, latest = [], {}
        iterations = _train_loop(algo, "evaluation/episode_return_mean", 5, math.inf, tmp_path, history, latest)
        assert iterations == 2  # Recorder.stop_at: the loop stopped at the callback's request
        runner_actors = {actor._actor_id.hex() for actor in algo.env_runner_group.actors}
        checkpoint = algo.save_to_path(str(tmp_path / "checkpoint"))
        algo.restore_from_path(checkpoint)
    finally:
        algo.stop()
    driver = os.getpid()
    events = _events(tmp_path / "events.jsonl")
    by_hook: dict[str, list[dict]] = {}
    for event in events:
        by_hook.setdefault(event["hook"], []).append(event)

    # The algorithm's hooks: in this process, as often as their events happened.
    assert len(by_hook["on_algorithm_init"]) == 1
    assert [e["iteration"] for e in by_hook["on_train_result"]] == [1, 2]
    assert all(e["saw_sampled"] for e in by_hook["on_train_result"])  # runner metrics arrive before it
    assert [e["version"] for e in by_hook["on_evaluate_start"]] == [0, 2]  # at start, after update 2
    assert [e["n"] for e in by_hook["on_evaluate_end"]] == [2.0, 2.0]
    assert [e["path"] for e in by_hook["on_checkpoint_loaded"]] == [checkpoint]
    for hook in ("on_algorithm_init", "on_train_result", "on_evaluate_start", "on_evaluate_end",
                 "on_checkpoint_loaded"):
        assert {e["pid"] for e in by_hook[hook]} == {driver}, hook

    # The EnvRunner hooks: in the runner actor (before the restore replaced it), never here.
    runner_events = by_hook["on_episode_end"] + by_hook["on_sample_end"]
    assert driver not in {e["pid"] for e in runner_events}
    assert {e["actor"] for e in runner_events} == runner_actors  # the one runner's actor id
    assert all(e["has_env"] and e["turns"] == 1 for e in by_hook["on_episode_end"])
    evaluation_ends = [e for e in by_hook["on_episode_end"] if e["evaluation"]]
    assert sorted(e["index"] for e in evaluation_ends) == [0, 0, 1, 1]  # 2 evaluations x 2 prompts
    assert len([e for e in by_hook["on_sample_end"] if e["evaluation"]]) == 2  # one sample() per evaluation

    # The metrics: per iteration under callbacks/, evaluation's under evaluation/callbacks/.
    first, second = history
    assert first["callbacks/init"] == 1.0 and "callbacks/init" not in second  # reduced once, then cleared
    assert first["callbacks/iteration_seen"] == 1.0 and second["callbacks/iteration_seen"] == 2.0
    assert first["my/batch_size"] == second["my/batch_size"] == B and second["my/evaluated"] == 1.0
    assert first["evaluation/callbacks/ended"] == second["evaluation/callbacks/ended"] == 2.0
    delivered = sum(row["callbacks/sampled"] for row in history)
    assert second["env_runners/num_skipped_stale_lifetime"] == second["env_runners/num_skipped_pending_overflow_lifetime"] == 0
    # Every episode the runners handed over was trained on or waits for a later batch.
    assert delivered == second["env_runners/num_episodes_lifetime"] + second["env_runners/num_pending_episodes"]
    # ... and each of them ended (on_episode_end) before a poll handed it out (on_sample_end).
    assert len([e for e in by_hook["on_episode_end"] if not e["evaluation"]]) >= delivered
    assert sum(e["n"] for e in by_hook["on_sample_end"] if not e["evaluation"]) >= delivered
    assert json.loads((Path(checkpoint) / "config.json").read_text())["callbacks_class"] == f"{__name__}:Recorder"

    # Evaluations reach the console when they are taken; the console shows the episode metrics.
    out = capsys.readouterr().out
    assert "eval v0 | return" in out and "eval v2 | return" in out
    assert "a callback set should_stop after iteration 2: stopping." in out

    # Rollout dumps: every iteration, the batch's first 2 episodes, with the learner's drift and decision.
    dumps = sorted((tmp_path / "tb" / "rollouts").glob("*.jsonl"))
    assert [p.name for p in dumps] == ["iteration_000001.jsonl", "iteration_000002.jsonl"]
    from flashrl.metrics.rollouts import read_rollouts

    records = read_rollouts(dumps[1])
    assert [r["batch_index"] for r in records] == [0, 1]
    for record in records:
        assert record["iteration"] == 2 and record["learner_version"] == 2
        assert "What is" in record["prompt"]  # the easy_sums question, decoded
        assert [t["role"] for t in record["turns"]] == ["model"] and "<|im_end|>" in record["closing"]
        assert record["turns"][0]["policy_version"] == record["policy_versions"][0] in (0, 1)
        assert isinstance(record["drift"], float) and record["drift"] <= second["learners/drift_max"] + 1e-12
        assert record["accepted"] == (record["drift"] <= 1.0)  # delta = 1.0
        assert record["update_applied"] is True and isinstance(record["reward"], float)
        assert {"info", "success", "termination", "num_tokens", "policy_lag"} <= set(record)
    assert cli(["show", str(dumps[1]), "--index", "1"]) == 0
    shown = capsys.readouterr().out
    assert f"{dumps[1]}: episode 1 of 0..1" in shown
    assert "=== prompt ===" in shown and "=== turn 1: model, policy v" in shown and "=== info ===" in shown
    assert cli(["show", str(dumps[1]), "--index", "2"]) == 2
    assert "--index: expected 0..1 (the file holds 2 episodes), got 2" in capsys.readouterr().err


def test_a_callback_stops_a_tune_trial_in_the_trial_process(ray_session, tiny_config, tmp_path):
    from ray import tune

    from flashrl.algorithms import FlashReinforce

    Recorder.log_path = str(tmp_path / "events.jsonl")
    config = tiny_config(tensorboard=False, console_every=0, num_cpus_per_env_runner=0.25)
    config.callbacks(Recorder)
    tuner = tune.Tuner(
        FlashReinforce,
        param_space=config,
        run_config=tune.RunConfig(stop={"training_iteration": 5}, storage_path=str(tmp_path), verbose=0),
    )
    grid = tuner.fit()
    assert grid.num_errors == 0, [r.error for r in grid]
    (result,) = list(grid)
    assert result.metrics["training_iteration"] == 2 and result.metrics["should_stop"] is True
    trained = [e for e in _events(tmp_path / "events.jsonl") if e["hook"] == "on_train_result"]
    assert [e["iteration"] for e in trained] == [1, 2]
    assert len({e["pid"] for e in trained}) == 1 and trained[0]["pid"] != os.getpid()  # in the trial actor
