"""Episode metrics (turns, tokens, endings, info fields, per data source), the console lines and rollout
records, by hand; and real `flashrl/PythonTool-v0` episodes whose `tool_calls` reach TensorBoard."""

from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor

import gymnasium as gym
import numpy as np
import pytest

from flashrl.episode import Episode
from flashrl.metrics import IterationMetrics, IterationTimes, StreamCounts, TensorBoardLogger, episode_metrics
from flashrl.metrics.console import evaluation_line, progress_line
from flashrl.metrics.rollouts import format_rollout, read_rollouts, rollout_record, segments, write_rollouts

FENCE = "```"


def _episode(turns: int, reward: float, info: dict, *, terminated=True, truncated=False, prompt="p") -> Episode:
    """A prompt of 2 tokens, then per turn 3 model tokens and (between turns) 2 environment tokens."""
    ids, mask = [1, 2], [False, False]
    for t in range(turns):
        if t:
            ids += [7, 8]
            mask += [False, False]
        ids += [10 + t, 11 + t, 12 + t]
        mask += [True, True, True]
    return Episode(prompt, ids, mask, [-0.5 if m else 0.0 for m in mask], reward=reward,
                   policy_versions=list(range(turns)), terminated=terminated, truncated=truncated, info=info)


def test_episode_metrics_by_hand():
    episodes = [
        _episode(1, 1.0, {"tool_calls": 0, "success": True, "data_source": "gsm", "episode_index": 7}),
        _episode(3, 0.0, {"tool_calls": 2, "success": False, "data_source": "gsm", "exit_code": np.int64(1)},
                 terminated=False, truncated=True),
        _episode(2, 0.5, {"tool_calls": 4, "success": False, "data_source": "aime", "duration_s": math.nan,
                          "context_budget_exceeded": True, "reason": "wrong"}, terminated=False, truncated=True),
    ]
    m = episode_metrics(episodes, datasource_key="data_source")
    assert (m["env_runners/episode_turns_mean"], m["env_runners/episode_turns_min"],
            m["env_runners/episode_turns_max"]) == (2.0, 1.0, 3.0)
    # tokens: 2 + 3 = 5, 2 + 3 * 3 + 2 * 2 = 15, 2 + 2 * 3 + 2 = 10; generated 3, 9, 6
    assert (m["env_runners/episode_tokens_mean"], m["env_runners/episode_tokens_max"]) == (10.0, 15.0)
    assert (m["env_runners/episode_generated_tokens_mean"], m["env_runners/episode_generated_tokens_max"]) == (6.0, 9.0)
    assert [m[f"env_runners/termination/{r}"] for r in ("terminated", "truncated", "context_budget", "other")] == [
        1.0, 1.0, 1.0, 0.0]
    info = {k.removeprefix("env_runners/episode_info/"): v for k, v in m.items() if "/episode_info/" in k}
    assert info == {
        "tool_calls_mean": 2.0, "tool_calls_min": 0.0, "tool_calls_max": 4.0,
        "success_mean": pytest.approx(1 / 3),  # a bool: its rate only
        "exit_code_mean": 1.0, "exit_code_min": 1.0, "exit_code_max": 1.0,  # numpy scalars count
        "context_budget_exceeded_mean": 1.0,  # only the episode that has the field
        "duration_s_num_non_finite": 1.0,  # NaN: left out and counted
    }  # episode_index (bookkeeping) and the strings are not there
    assert m["env_runners/by_data_source/gsm/episode_return_mean"] == 0.5
    assert m["env_runners/by_data_source/gsm/success_mean"] == 0.5
    assert m["env_runners/by_data_source/gsm/num_episodes"] == 2.0
    assert (m["env_runners/by_data_source/aime/episode_return_mean"],
            m["env_runners/by_data_source/aime/success_mean"]) == (0.5, 0.0)
    assert not any("by_data_source" in k for k in episode_metrics(episodes, datasource_key=None))
    assert episode_metrics([]) == {}


def test_console_lines_show_turns_and_tool_calls_of_multi_turn_runs_and_evaluations():
    metrics = {"env_runners/episode_return_mean": 0.5, "env_runners/episode_turns_mean": 2.5,
               "env_runners/episode_info/tool_calls_mean": 1.25, "timers/iteration_s": 2.0}
    assert "turns" not in progress_line(3, metrics)
    line = progress_line(3, metrics, multi_turn=True)
    assert "| turns 2.50 | tool calls 1.25 |" in line and line.startswith("iter    3 | return 0.500")
    evaluation = {"evaluation/learner_version": 20.0, "evaluation/episode_return_mean": 0.25,
                  "evaluation/avg@4": 0.25, "evaluation/pass@4": 0.5, "evaluation/num_prompts": 8.0,
                  "evaluation/num_episodes": 32.0, "evaluation/seen/episode_return_mean": 0.75,
                  "evaluation/seen/num_episodes": 16.0, "evaluation/gsm/avg@4": 0.1, "timers/evaluation_s": 3.5}
    assert evaluation_line(evaluation) == (
        "eval v20 | return 0.250 | avg@4 0.250 | pass@4 0.500 | seen 0.750 | 8 prompts, 32 episodes | 3.5 s"
    )


def test_rollout_record_by_hand_and_its_text(tmp_path):
    episode = _episode(2, 1.0, {"tool_calls": 1, "note": {1, 2}})
    assert [(role, ids) for role, ids in segments(episode)] == [
        ("prompt", [1, 2]), ("model", [10, 11, 12]), ("environment", [7, 8]), ("model", [11, 12, 13])]
    closed = _episode(1, 0.0, {})
    closed.token_ids.append(99)
    closed.loss_mask.append(False)
    closed.behavior_logprobs.append(0.0)
    assert segments(closed)[-1] == ("closing", [99])  # the template's end of the last turn
    record = rollout_record(
        episode, decode=lambda ids: " ".join(map(str, ids)), iteration=5, learner_version=5, batch_index=1,
        policy_lag=3, learner_metrics={"applied": 1.0, "drift_values": [0.1, 0.02], "accepted_values": [1.0, 0.0]},
    )
    assert record["prompt"] == "1 2" and record["closing"] == ""
    assert record["turns"] == [
        {"role": "model", "text": "10 11 12", "num_tokens": 3, "policy_version": 0},
        {"role": "environment", "text": "7 8", "num_tokens": 2},
        {"role": "model", "text": "11 12 13", "num_tokens": 3, "policy_version": 1},
    ]
    assert (record["drift"], record["accepted"], record["policy_lag"], record["update_applied"]) == (0.02, False, 3, True)
    assert record["info"]["note"] == "{1, 2}"  # not JSON: its str
    skipped = rollout_record(episode, decode=str, iteration=5, learner_version=4, batch_index=0, policy_lag=0,
                             learner_metrics={"applied": 0.0})
    assert (skipped["drift"], skipped["accepted"], skipped["update_applied"]) == (None, None, False)
    path = write_rollouts(tmp_path / "r" / "x.jsonl", [record, skipped])
    assert read_rollouts(path) == json.loads(json.dumps([record, skipped]))
    text = format_rollout(record)
    assert "=== turn 1: model, policy v0 (3 tokens) ===\n10 11 12" in text
    assert "=== turn 2: environment (2 tokens) ===\n7 8" in text and "accepted False" in text
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: expected one JSON object per line"):
        read_rollouts(tmp_path / "bad.jsonl")


class ScriptedPolicy:
    """Plays fixed replies (the model's part only; the env, sandbox and conversation are real)."""

    version = 0

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)

    async def generate(self, prompt_token_ids, sampling):
        from flashrl.engines.types import Completion

        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", version=0)


def _python_tool_episode(tokenizer, replies: list[str], seed: int) -> Episode:
    import flashrl.envs  # noqa: F401  (registers the ids)
    from flashrl.env_runners.rollout import play_episode
    from flashrl.envs.math import MathTask

    env = gym.make("flashrl/PythonTool-v0", tasks=[MathTask("What is 12 * 34 - 5?", "403", "t:403")])
    with ThreadPoolExecutor(2) as pool:
        return asyncio.run(play_episode(
            env, ScriptedPolicy(tokenizer, replies), reset_seed=seed, sampling_seed=lambda turn: turn,
            sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 64}, max_episode_tokens=1024,
            executor=pool,
        ))


def test_python_tool_tool_calls_reach_the_tensorboard_event_file(smollm2_path, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    run = f"{FENCE}python\nprint(12 * 34 - 5)\n{FENCE}"
    episodes = [
        _python_tool_episode(tokenizer, [run, "So \\boxed{403}."], 0),  # one tool call, solved
        _python_tool_episode(tokenizer, ["\\boxed{400}"], 1),  # no tool call, wrong
        _python_tool_episode(tokenizer, [run, run, "\\boxed{403}"], 2),  # two tool calls, solved
    ]
    assert [ep.info["tool_calls"] for ep in episodes] == [1, 0, 2]  # the real env counted them
    metrics = IterationMetrics(smoothing_window=10).update(
        episodes, lags=[0, 0, 0], generated_tokens=10, learner_version=1, learner_metrics={},
        counts=StreamCounts(episodes=3, generated_tokens=10, env_steps=6, skipped={}, lost=0, restarts=0,
                            started=3, in_flight=0, pending=0),
        times=IterationTimes(sample_wait=0.1, learner_update=0.1, weight_sync=0.0, iteration=1.0),
    )
    assert metrics["env_runners/episode_info/tool_calls_mean"] == 1.0
    assert (metrics["env_runners/episode_info/tool_calls_min"], metrics["env_runners/episode_info/tool_calls_max"]) == (
        0.0, 2.0)
    assert metrics["env_runners/episode_turns_mean"] == 2.0  # 2, 1 and 3 model turns
    assert metrics["env_runners/episode_info/success_mean"] == pytest.approx(2 / 3)
    assert metrics["env_runners/termination/terminated"] == 3.0
    logger = TensorBoardLogger(tmp_path)
    logger.log(1, metrics)
    logger.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("env_runners/episode_info/tool_calls_mean")] == [1.0]
    assert [e.value for e in events.Scalars("env_runners/episode_info/tool_calls_max")] == [2.0]
    assert [e.value for e in events.Scalars("env_runners/episode_turns_mean")] == [2.0]
