"""``flashrl/Agent-v0``: its settings refused with the fix, its tasks, and its agent run as a function or a command.

The agent runs here without an endpoint (nothing calls the model); the EnvRunner's way of playing the
env against one is in ``tests/runtime/test_agent_runner.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

import flashrl.envs  # noqa: F401  (registers the ids)
from flashrl.envs.agent_env import AgentEnv, AgentError, AgentResult, agent_result, load_agent_tasks
from flashrl.envs.math.tasks import DatasetError

TASKS = [{"id": "t0", "question": "2+3", "answer": "5"}, {"question": "4+4", "answer": "8", "data_source": "sums"}]
PY = sys.executable


async def fixed_agent(client: Any, task: dict[str, Any]) -> float:
    return 1.0


def by_answer(task: dict[str, Any], transcript: list[dict[str, Any]]) -> float:
    return float(transcript[-1]["content"].strip() == task["answer"])


def command(script: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(script)]


def run(env: AgentEnv, base_url: str = "http://127.0.0.1:9/sessions/k/v1", key: str = "secret", *,
        model_name: str = "policy", wall_time_s: float = 600.0) -> AgentResult:
    return asyncio.run(env.run_agent(base_url, key, model_name=model_name, wall_time_s=wall_time_s))


# ------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "expected exactly one of agent .* and command .*, got neither"),
        ({"agent": fixed_agent, "command": [PY]}, ValueError, "got both"),
        ({"agent": 42}, TypeError, r"expected an async function agent\(client, task\).*got 42, which is not callable"),
        ({"agent": by_answer}, TypeError, "got <function by_answer.*Fix: define it with 'async def'"),
        ({"agent": "no_such_module_xyz:agent"}, ValueError, "the module 'no_such_module_xyz'.* does not import"),
        ({"command": "python agent.py"}, TypeError, r"command: expected a non-empty list of str \(argv"),
        ({"command": []}, TypeError, "command: expected a non-empty list of str"),
        ({"command": ["no-such-program-xyz"]}, ValueError, "got 'no-such-program-xyz', which is not on PATH"),
        ({"agent": fixed_agent, "reward_fn": 3}, TypeError, r"reward_fn: expected a function reward_fn\(task, transcript\)"),
        ({"agent": fixed_agent, "success_threshold": "1"}, ValueError, "success_threshold: expected None or a number"),
        # the endpoint's settings are the runner's (tests/runtime/test_agent_settings.py): not the env's arguments
        ({"agent": fixed_agent, "max_calls": 2}, TypeError, "unexpected keyword argument 'max_calls'"),
    ],
)
def test_bad_settings_are_refused_with_what_was_expected(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AgentEnv(TASKS, **kwargs)


def test_a_bad_tasks_file_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"question": "a"}\n\n{"question": \n')
    with pytest.raises(DatasetError, match=rf"^{path}:3: invalid JSON"):
        AgentEnv(str(path), agent=fixed_agent)
    path.write_text('{"question": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=rf"^{path}:2: expected a task object \(a dict\), got list"):
        AgentEnv(str(path), agent=fixed_agent)
    path.write_text('{"id": "x"}\n{"id": "x"}\n')
    with pytest.raises(DatasetError, match=rf"^{path}:2: task id 'x' was already used by {path}:1"):
        AgentEnv(str(path), agent=fixed_agent)
    with pytest.raises(DatasetError, match=r"expected a list of dicts or a \.jsonl file"):
        AgentEnv(str(tmp_path / "tasks.csv"), agent=fixed_agent)


def test_bad_task_lists_name_the_task() -> None:
    with pytest.raises(DatasetError, match=r"tasks\[1\]: expected a JSON-able task .*got \{'x': \{1, 2\}\}"):
        AgentEnv([{"x": 1}, {"x": {1, 2}}], agent=fixed_agent)
    with pytest.raises(DatasetError, match=r"tasks\[0\]: field 'id' \(the task's id\) must be a str or an int; got 1.5"):
        AgentEnv([{"id": 1.5}], agent=fixed_agent)
    with pytest.raises(DatasetError, match="expected at least one task, got none"):
        AgentEnv([], agent=fixed_agent)


def test_task_ids_come_from_the_id_field_else_the_index_or_file_and_line(tmp_path: Path) -> None:
    assert load_agent_tasks(TASKS)[1] == ["t0", "1"]
    assert load_agent_tasks([{"key": 7}, {}], id_field="key")[1] == ["7", "1"]
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"q": 1}\n\n{"id": "named", "q": 2}\n{"q": 3}\n')
    tasks, ids = load_agent_tasks(path)
    assert tasks == [{"q": 1}, {"id": "named", "q": 2}, {"q": 3}]
    assert ids == ["tasks.jsonl:1", "named", "tasks.jsonl:4"]


def test_an_agent_given_by_path_is_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_agent_mod.py").write_text("async def agent(client, task):\n    return 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = AgentEnv(TASKS, agent="my_agent_mod:agent")
    env.reset(seed=0)
    assert run(env) == AgentResult(reward=0.25)
    assert AgentEnv.code_arguments == ("agent", "reward_fn")  # shipped to the runners by value


# ------------------------------------------------------------------------------------------
# reset and step
# ------------------------------------------------------------------------------------------
def test_reset_picks_the_task_by_index_or_seed() -> None:
    env = gym.make("flashrl/Agent-v0", tasks=TASKS, agent=fixed_agent)
    messages, info = env.reset(options={"task_index": 1})
    assert info == {"prompt_id": "1", "task": TASKS[1], "task_index": 1, "data_source": "sums"}
    assert messages == [{"role": "user", "content": json.dumps(TASKS[1])}]
    seeded = [env.reset(seed=s)[1]["prompt_id"] for s in range(8)]
    assert seeded == [env.reset(seed=s)[1]["prompt_id"] for s in range(8)] and set(seeded) == {"t0", "1"}
    with pytest.raises(IndexError, match="task_index 2 is out of range for 2 tasks"):
        env.reset(options={"task_index": 2})
    assert env.unwrapped.finite and len(env.unwrapped.tasks) == 2  # evaluation walks the list in order


def test_step_grades_its_text_as_a_one_reply_transcript() -> None:
    env = gym.make("flashrl/Agent-v0", tasks=TASKS, agent=fixed_agent, reward_fn=by_answer, success_threshold=1.0)
    env.reset(options={"task_index": 0})
    assert env.step("5") == ([], 1.0, True, False, {"prompt_id": "t0", "success": True, "turn": 1})
    env.reset(options={"task_index": 0})
    assert env.step("6")[1:3] == (0.0, True)
    plain = gym.make("flashrl/Agent-v0", tasks=TASKS, agent=fixed_agent)
    plain.reset(seed=0)
    assert plain.step("anything")[1:] == (0.0, True, False, {"prompt_id": plain.unwrapped.task_ids[
        plain.unwrapped.task_index], "turn": 1})


# ------------------------------------------------------------------------------------------
# what an agent returns
# ------------------------------------------------------------------------------------------
def test_agent_results_are_read() -> None:
    assert agent_result(0.5) == AgentResult(reward=0.5)
    assert agent_result(None) == AgentResult()
    assert agent_result([{"role": "user", "content": "x"}]) == AgentResult(transcript=[{"role": "user", "content": "x"}])
    assert agent_result({"reward": 1, "success": True}) == AgentResult(reward=1, success=True)
    assert agent_result("0.5") == AgentResult(reward="0.5")  # refused later, as bad_reward
    with pytest.raises(AgentError, match=r"the keys \['score'\]; expected only \['reward', 'transcript', 'success'\]"):
        agent_result({"score": 1})
    with pytest.raises(AgentError, match="'success' = 1; expected true or false"):
        agent_result({"reward": 1, "success": 1})
    with pytest.raises(AgentError, match="'transcript' of type str; expected a list"):
        agent_result({"transcript": "hi"})


def test_a_function_agent_gets_a_client_bound_to_the_session_and_a_copy_of_the_task() -> None:
    seen: dict[str, Any] = {}

    async def agent(client: Any, task: dict[str, Any]) -> dict[str, Any]:
        seen.update(base_url=str(client.base_url), api_key=client.api_key, retries=client.max_retries,
                    timeout=client.timeout)
        task["answer"] = "mutated"
        return {"reward": 0.5, "success": False}

    env = AgentEnv(TASKS, agent=agent)
    env.reset(options={"task_index": 0})
    assert run(env, wall_time_s=42.0) == AgentResult(reward=0.5, success=False)
    # the wall time is the only time limit: no shorter request timeout of the client's own (openai's connect is 5 s)
    assert seen == {"base_url": "http://127.0.0.1:9/sessions/k/v1/", "api_key": "secret", "retries": 0, "timeout": 42.0}
    assert env.tasks[0]["answer"] == "5"


def test_a_command_agent_gets_the_endpoint_and_the_task() -> None:
    script = """
        import json, os, sys
        task = json.load(sys.stdin)
        print("some log line")
        env = {k: os.environ[k] for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "FLASHRL_MODEL")}
        print(json.dumps({"transcript": [task, json.loads(os.environ["FLASHRL_TASK"]), env]}))
    """
    env = AgentEnv(TASKS, command=command(script))
    env.reset(options={"task_index": 1})
    result = run(env, model_name="m1")
    endpoint = {"OPENAI_BASE_URL": "http://127.0.0.1:9/sessions/k/v1", "OPENAI_API_KEY": "secret", "FLASHRL_MODEL": "m1"}
    assert result == AgentResult(transcript=[TASKS[1], TASKS[1], endpoint])


def test_a_large_task_comes_on_stdin_only() -> None:
    script = """
        import json, os, sys
        print(json.dumps([len(json.load(sys.stdin)["text"]), "FLASHRL_TASK" in os.environ]))
    """
    env = AgentEnv([{"text": "x" * 200_000}], command=command(script))
    env.reset(seed=0)
    assert run(env) == AgentResult(transcript=[200_000, False])


@pytest.mark.parametrize(
    ("script", "match"),
    [
        ("import sys\nprint('1.0')\nsys.exit('KeyError: the agent broke')",
         r"exited with status 1: KeyError: the agent broke\nits stderr ends with:\nKeyError: the agent broke"),
        ("pass", "printed nothing on stdout: expected its last line to be a JSON number"),
        ("print('reward: 1')", r"ended its stdout with 'reward: 1': expected a JSON number"),
    ],
)
def test_a_command_that_fails_is_an_agent_error(script: str, match: str) -> None:
    env = AgentEnv(TASKS, command=command(script))
    env.reset(seed=0)
    with pytest.raises(AgentError, match=match):
        run(env)


def _cancel_once_started(env: AgentEnv, pid_file: Path) -> None:
    """Run ``env``'s command agent and cancel it once it wrote ``pid_file``; within 30 s."""
    env.reset(seed=0)

    async def cancelled_once_started() -> None:
        task = asyncio.create_task(env.run_agent("http://x/v1", "k", model_name="policy", wall_time_s=600.0))
        while not pid_file.exists() or not pid_file.read_text():
            await asyncio.sleep(0.05)
        task.cancel()
        await task

    began = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled_once_started())
    assert time.monotonic() - began < 30


def test_cancelling_a_command_agent_kills_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """
    _cancel_once_started(AgentEnv(TASKS, command=command(script)), pid_file)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped


# ------------------------------------------------------------------------------------------
# a command's processes and output
# ------------------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _leaves_a_daemon(pid_file: Path, then: str) -> str:
    """A command that starts a daemon (a new session, then a second fork: it is nobody's child) and ``then``."""
    return f"""
        import os, subprocess, sys, time
        daemon = "import os, time\\nif os.fork(): os._exit(0)\\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\\ntime.sleep(60)"
        subprocess.Popen([sys.executable, "-c", daemon], start_new_session=True).wait()
        while not os.path.exists({str(pid_file)!r}) or not open({str(pid_file)!r}).read():
            time.sleep(0.02)
        {then}
    """


def test_every_process_a_command_started_ends_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    env = AgentEnv(TASKS, command=command(_leaves_a_daemon(pid_file, "print('1.0')")))
    env.reset(seed=0)
    assert run(env) == AgentResult(reward=1.0)
    assert _gone(int(pid_file.read_text()))  # today: the daemon (setsid, double fork) outlives the episode


def test_cancelling_a_command_ends_the_processes_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    _cancel_once_started(AgentEnv(TASKS, command=command(_leaves_a_daemon(pid_file, "time.sleep(60)"))), pid_file)
    assert _gone(int(pid_file.read_text()))


def test_a_commands_output_is_kept_up_to_a_bound() -> None:
    import tracemalloc

    script = """
        import sys
        block = "x" * (1 << 20) + "\\n"
        for _ in range(96):
            sys.stdout.write(block)
            sys.stderr.write(block)
        print('{"reward": 0.5}')
    """
    env = AgentEnv(TASKS, command=command(script))
    env.reset(seed=0)
    tracemalloc.start()
    try:
        result = run(env)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result == AgentResult(reward=0.5)
    assert peak < 64 * 1024 * 1024, peak  # today: all 192 MiB of output held, and again decoded
