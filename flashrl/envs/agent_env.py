r"""``flashrl/Agent-v0``: your agent program, written against the ``openai`` client, trained on your tasks.

The agent is an ``async def agent(client, task)`` function or a command; each episode it gets one task
and a client whose every model call the EnvRunner serves with the policy and records token-exactly
(`flashrl.agents`); its return value (or ``reward_fn`` on its conversation) is the episode's reward.
The EnvRunner plays this env with its ``"agent"`` rollout (:class:`flashrl.env_runners.agent_rollout.AgentRollout`),
not with ``step``; the endpoint and the episode's limits are the runner's settings (``agent_*`` in
``.env_runners()``). ``docs/agents.md`` is the user's guide.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import os
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flashrl.envs.base import LanguageEnv, Messages, StepResult
from flashrl.envs.math.tasks import DATASOURCE_FIELDS, DatasetError, jsonl_rows
from flashrl.envs.sandbox.agent_command import AgentSandbox, EndpointRelay, agent_sandbox, sandboxed_command
from flashrl.user_code import import_path, is_path

__all__ = ["AgentEnv", "AgentError", "AgentResult", "agent_result"]

STDERR_TAIL_CHARS = 4000
"""How much of a failed command's stderr its error quotes (the end: where a traceback names the cause)."""
TASK_ENV_MAX_BYTES = 100_000
"""Largest task JSON also given in ``FLASHRL_TASK`` (Linux refuses to start a process with an environment
variable past 128 KiB); a larger task comes on stdin only."""
MAX_STDOUT_BYTES = 16 * 1024 * 1024
"""The end of a command's stdout that is kept (its last line is the result); the rest is read and dropped."""
MAX_STDERR_BYTES = 64 * 1024
"""The end of a command's stderr that is kept (its error quotes the last ``STDERR_TAIL_CHARS``)."""
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_agent_reaper.py")
"""The script a command runs under: when the command ends, every process it started ends too."""
REAPER_GRACE_S = 5.0
"""How long a cancelled command's reaper gets to end its processes before its session is SIGKILLed."""


class AgentError(RuntimeError):
    """The agent did not end as an agent must: a command that failed or printed no result, a bad return."""


@dataclass(frozen=True)
class AgentResult:
    """What an agent returned, read (see `agent_result`)."""

    reward: Any = None
    """The agent's reward (None: none given; ``reward_fn`` grades the transcript). Checked by the runner
    (`flashrl.env_runners.rollout.reward_value`), so text or a bool is refused there as ``bad_reward``."""
    transcript: list[Any] | None = None
    """The agent's own transcript (None: the endpoint's, its last call and reply)."""
    success: bool | None = None
    """Whether the task is solved (None: not said)."""


RESULT_KEYS = ("reward", "transcript", "success")


def agent_result(value: Any) -> AgentResult:
    """Read an agent's return (a function's value, a command's last stdout line parsed as JSON).

    None: no reward (``reward_fn`` grades the endpoint's transcript); a list: the agent's transcript
    (graded by ``reward_fn``); a dict: some of ``reward``, ``transcript`` (a list) and ``success`` (a
    bool); anything else: the reward.
    """
    if value is None:
        return AgentResult()
    if isinstance(value, list):
        return AgentResult(transcript=value)
    if not isinstance(value, Mapping):
        return AgentResult(reward=value)
    unknown = sorted(str(k) for k in value if k not in RESULT_KEYS)
    if unknown:
        raise AgentError(f"the agent returned an object with the keys {unknown}; expected only {list(RESULT_KEYS)}. "
                         "Fix: return a number (the reward), a list of messages, None, or such an object")
    transcript, success = value.get("transcript"), value.get("success")
    if transcript is not None and not isinstance(transcript, list):
        raise AgentError(f"the agent returned a 'transcript' of type {type(transcript).__name__}; expected a list "
                         "of messages")
    if success is not None and not isinstance(success, bool):
        raise AgentError(f"the agent returned 'success' = {success!r:.80}; expected true or false")
    return AgentResult(reward=value.get("reward"), transcript=transcript, success=success)


class AgentEnv(LanguageEnv):
    r"""Your agent program on your tasks; the EnvRunner serves its model calls with the policy.

    ## Description
    Each episode plays one of ``tasks`` (JSON-able dicts) with the user's agent: an ``async def
    agent(client, task)`` (``client`` an ``openai.AsyncOpenAI`` bound to this episode) or a
    ``command`` run as a subprocess (``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set to this episode's
    endpoint; the task as JSON on its stdin and, up to `TASK_ENV_MAX_BYTES`, in ``FLASHRL_TASK``;
    ``FLASHRL_MODEL`` the model name, the runner's ``agent_model_name``).
    Every call the agent makes is recorded token-exactly by the EnvRunner's endpoint
    (`flashrl.agents`); the episode is trained on those calls.

    **Played by the EnvRunner, not by ``step``.** ``reset`` picks the task (seeded, or
    ``options={"task_index": i}``; the runners pick it themselves for training passes and evaluation,
    since the task list is ``finite``); the runner then calls :meth:`run_agent` with an endpoint
    session (:class:`flashrl.env_runners.agent_rollout.AgentRollout`). ``step`` exists for
    Gymnasium's checks and the run's pre-flight check: it grades its text as a one-reply transcript
    with ``reward_fn`` (0.0 without one) and ends the episode.

    ## Observation space
    :class:`~flashrl.envs.spaces.ChatMessages`: ``reset`` gives one user message, the task as JSON
    (for ``render`` and ``step``; the agent builds its own messages). ``step`` gives ``[]``.

    ## Reward
    What the agent returns (:func:`agent_result`): a number is the reward; a list (its own transcript
    of messages) or None is graded by ``reward_fn(task, transcript) -> float`` (None: the endpoint's
    transcript, the messages of the agent's last call and the reply); a dict gives some of
    ``reward``, ``transcript`` and ``success``. The runner refuses a reward that is not a real number
    (``bad_reward``). An agent that returns no reward to an env without ``reward_fn`` is an env error.
    ``info["success"]`` is the agent's ``success``, else ``reward >= success_threshold`` when that is
    set, else absent.

    ## Episode end
    When the agent returns (terminated). Past the runner's ``agent_wall_time_s`` the agent is cancelled
    (a command is killed) and the episode dropped (``env_timeout``); an agent that raises (a command that
    exits non-zero) is an env error (``env_error``), an agent that made no model call gives no episode
    (``empty``). A call past ``agent_max_calls`` or past ``agent_max_completion_tokens`` is refused by the
    endpoint with an OpenAI-style error the agent sees.

    ## Arguments
    ``tasks`` (a list of dicts or a ``.jsonl`` path), ``agent`` (a function or its ``"module:name"``
    path) or ``command`` (a list of strings), ``reward_fn`` (a function or its path), ``id_field``
    (default ``"id"``: a task's prompt id; without it the list index or ``file.jsonl:line``),
    ``success_threshold`` (default None), ``sandbox`` (default None: a command runs as the user; ``True`` or a
    dict of `flashrl.envs.sandbox.agent_command.AgentSandbox` fields: the command runs in the sandbox,
    its network the endpoint only; docs/agents.md, "A command agent in the sandbox"), ``render_mode``. The endpoint's address and model name and the
    episode's limits are the EnvRunner's settings (``agent_host``, ``agent_port``, ``agent_model_name``,
    ``agent_max_calls``, ``agent_max_completion_tokens``, ``agent_wall_time_s``); the runner's spec still
    reads them from ``env_config`` under their old names (``host``, ``port``, ``model_name``,
    ``max_calls``, ``max_completion_tokens``, ``wall_time_s``; docs/agents.md, "The limits").

    ## Version history
    * v0: initial version. The endpoint and limit arguments moved to the EnvRunner's settings (still
      accepted in ``env_config``, read by the runner's spec).
    """

    rollout_kind = "agent"
    """The EnvRunner plays this env with its ``"agent"`` rollout (`flashrl.env_runners.rollouts`)."""
    finite = True
    """The task list is finite: evaluation walks it in order (``task_index``)."""
    code_arguments = ("agent", "reward_fn")
    command_arguments = ("command",)

    def __init__(
        self,
        tasks: Sequence[Mapping[str, Any]] | str | os.PathLike[str],
        *,
        agent: Callable[..., Any] | str | None = None,
        command: Sequence[str] | None = None,
        reward_fn: Callable[[Mapping[str, Any], list[Any]], float] | str | None = None,
        id_field: str = "id",
        success_threshold: float | None = None,
        sandbox: bool | Mapping[str, Any] | None = None,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(max_turns=1, render_mode=render_mode)
        self.agent, self.command = _check_agent(agent, command)
        self.sandbox = agent_sandbox(sandbox, self.command)
        self.reward_fn = _check_reward_fn(reward_fn)
        self.tasks, self.task_ids = load_agent_tasks(tasks, id_field=id_field)
        if success_threshold is not None and (isinstance(success_threshold, bool) or not isinstance(
            success_threshold, int | float) or math.isnan(success_threshold)):
            raise ValueError(f"success_threshold: expected None or a number, got {success_threshold!r}.")
        self.success_threshold = success_threshold
        self.task: dict[str, Any] | None = None
        self.task_index = 0

    # ----------------------------------------------------------------------------- LanguageEnv
    def _reset_task(self, options: dict[str, Any]) -> tuple[Messages, dict[str, Any]]:
        unknown = set(options) - {"task_index"}
        if unknown:
            raise ValueError(f"Unknown reset options {sorted(unknown)}; AgentEnv accepts 'task_index'.")
        index = int(options["task_index"]) if "task_index" in options else int(self.np_random.integers(len(self.tasks)))
        if not 0 <= index < len(self.tasks):
            raise IndexError(f"task_index {index} is out of range for {len(self.tasks)} tasks.")
        self.task, self.task_index = self.tasks[index], index
        info = {"prompt_id": self.task_ids[index], "task": copy.deepcopy(self.task), "task_index": index}
        info.update({key: self.task[key] for key in DATASOURCE_FIELDS if key in self.task})
        return [{"role": "user", "content": json.dumps(self.task, ensure_ascii=False)}], info

    def _step_action(self, action: str) -> StepResult:
        """Not how the runner plays this env (see the class docstring): ``action`` as a one-reply transcript."""
        assert self.task is not None
        transcript = [*self.conversation[:-1], {"role": "assistant", "content": action}]
        reward = 0.0 if self.reward_fn is None else self.reward_fn(copy.deepcopy(self.task), transcript)
        info = {"prompt_id": self.task_ids[self.task_index], **self.success_info(reward, None)}
        return [], reward, True, False, info

    # ----------------------------------------------------------------------------- the runner's API
    async def run_agent(self, base_url: str, api_key: str, *, model_name: str, wall_time_s: float) -> AgentResult:
        """Run the agent on the current task against the endpoint at ``base_url``; its result, read.

        ``model_name``: the model the endpoint serves (a command's ``FLASHRL_MODEL``). ``wall_time_s``: the
        episode's wall time, which the caller enforces (cancelling this coroutine kills a command); a
        function agent's client gets it as its request timeout. Raises what a function agent raises, or
        `AgentError` for a command that fails or prints no result.
        """
        if self.task is None:
            raise RuntimeError("AgentEnv.run_agent() called before reset(); call reset() first.")
        task = copy.deepcopy(self.task)
        if self.agent is not None:
            try:
                import openai
            except ImportError as err:
                raise ImportError(f"a function agent gets an openai.AsyncOpenAI client, but openai does not import "
                                  f"({err}). Fix: pip install openai (vLLM installs it), or give a command") from err
            # The client's request timeout is the episode's wall time (enforced by the caller), the one time limit:
            # with openai's defaults a 2-core run lost 12 episodes to APITimeoutError, likely its 5 s connect
            # limit (docs/agents.md, "The agent: a function or a command").
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=wall_time_s)
            try:
                return agent_result(await self.agent(client, task))
            finally:
                await client.close()
        assert self.command is not None
        return agent_result(await _run_command(self.command, task, {
            "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "FLASHRL_MODEL": model_name,
        }, self.sandbox))

    def grade(self, transcript: list[Any]) -> Any:
        """``reward_fn(task, transcript)`` of the current task (blocking: the runner calls it in a thread)."""
        if self.reward_fn is None:
            raise AgentError(
                "the agent returned no reward and this env has no reward_fn: expected a number from the agent "
                "or a reward_fn(task, transcript) in env_config. Fix: return the reward, or give reward_fn"
            )
        assert self.task is not None
        return self.reward_fn(copy.deepcopy(self.task), copy.deepcopy(transcript))

    def success_info(self, reward: Any, success: bool | None) -> dict[str, bool]:
        """``{"success": ...}``: the agent's own verdict, else ``reward >= success_threshold`` if set, else ``{}``."""
        if success is not None:
            return {"success": success}
        real = isinstance(reward, int | float) and not isinstance(reward, bool)
        if self.success_threshold is None or not real:
            return {}
        return {"success": bool(reward >= self.success_threshold)}


def load_agent_tasks(
    tasks: Sequence[Mapping[str, Any]] | str | os.PathLike[str], *, id_field: str = "id"
) -> tuple[list[dict[str, Any]], list[str]]:
    """The tasks (JSON-able dicts) and their prompt ids, from a list or a ``.jsonl`` file.

    A task's id is its ``id_field`` (a str or an int), else its list index or ``file.jsonl:line``;
    ids must be distinct. Errors name the task (``tasks[3]`` or ``file.jsonl:4``).
    """
    if isinstance(tasks, str | os.PathLike):
        path = os.fspath(tasks)
        if not path.endswith((".jsonl", ".ndjson")):
            raise DatasetError(f"tasks {path!r}: expected a list of dicts or a .jsonl file (one task object a line).")
        name = os.path.basename(path)
        rows = [(where, row, f"{name}:{lineno}") for where, lineno, row in jsonl_rows(path)]
    elif isinstance(tasks, Sequence) and not isinstance(tasks, bytes | bytearray):
        rows = [(f"tasks[{i}]", row, str(i)) for i, row in enumerate(tasks)]
        for where, row, _ in rows:
            try:
                json.dumps(row, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as err:
                raise DatasetError(f"{where}: expected a JSON-able task (the agent gets it as JSON), got {row!r:.200}: "
                                   f"{err}.") from None
    else:
        raise TypeError(f"tasks: expected a list of dicts or a .jsonl path, got {type(tasks).__name__}.")
    if not rows:
        raise DatasetError("tasks: expected at least one task, got none.")
    out, ids, seen = [], [], {}
    for where, row, default_id in rows:
        if not isinstance(row, Mapping):
            raise DatasetError(f"{where}: expected a task object (a dict), got {type(row).__name__} {row!r:.100}.")
        given = row.get(id_field)
        if given is not None and (isinstance(given, bool) or not isinstance(given, str | int)):
            raise DatasetError(f"{where}: field {id_field!r} (the task's id) must be a str or an int; got {given!r:.100}.")
        prompt_id = default_id if given is None else str(given)
        if prompt_id in seen:
            raise DatasetError(f"{where}: task id {prompt_id!r} was already used by {seen[prompt_id]}; expected "
                               f"distinct ids (evaluation reports by them). Fix: make {id_field!r} unique.")
        seen[prompt_id] = where
        out.append(dict(row))
        ids.append(prompt_id)
    return out, ids


def _check_agent(agent: Any, command: Any) -> tuple[Callable[..., Any] | None, tuple[str, ...] | None]:
    if (agent is None) == (command is None):
        raise ValueError(
            "AgentEnv: expected exactly one of agent (an async def agent(client, task) or its 'module:name' path) "
            f"and command (a list of str), got {'both' if agent is not None else 'neither'}."
        )
    if command is not None:
        if isinstance(command, str) or not isinstance(command, Sequence) or not command or not all(
            isinstance(part, str) for part in command
        ):
            raise TypeError(f"command: expected a non-empty list of str (argv, e.g. ['python', 'agent.py']), got "
                            f"{command!r:.200}.")
        if shutil.which(command[0]) is None:
            raise ValueError(f"command: expected an executable as command[0], got {command[0]!r}, which is not on "
                             "PATH nor an executable file. Fix: give its full path.")
        return None, tuple(command)
    target = import_path(agent) if is_path(agent) else agent
    call = getattr(target, "__call__", None)  # noqa: B004 - an object whose __call__ is an async def
    if not (inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)):
        raise TypeError(
            f"agent: expected an async function agent(client, task) (or its 'module:name' path), got {agent!r:.200}"
            f"{'' if callable(target) else ', which is not callable'}. Fix: define it with 'async def' (it runs "
            "on the EnvRunner's event loop; blocking work goes through asyncio.to_thread)."
        )
    return target, None


def _check_reward_fn(reward_fn: Any) -> Callable[..., Any] | None:
    target = import_path(reward_fn) if is_path(reward_fn) else reward_fn
    if target is not None and not callable(target):
        raise TypeError(f"reward_fn: expected a function reward_fn(task, transcript) -> float or its 'module:name' "
                        f"path, got {reward_fn!r:.200}.")
    return target


async def _run_command(command: Sequence[str], task: Mapping[str, Any], env: Mapping[str, str],
                       sandbox: AgentSandbox | None = None) -> Any:
    """Run the agent command under the reaper (`flashrl.envs._agent_reaper`: when it ends, so does every
    process it started); its last stdout line, parsed as JSON. Cancelling this ends the command and its
    processes. Only the ends of stdout and stderr are kept (``MAX_STDOUT_BYTES``, ``MAX_STDERR_BYTES``).
    ``sandbox``: the command runs in the sandbox (`flashrl.envs.sandbox.agent_command`), its endpoint
    relayed over a unix socket for as long as it runs."""
    task_json = json.dumps(task, ensure_ascii=False)
    data = task_json.encode("utf-8")
    task_env = {"FLASHRL_TASK": task_json} if len(data) <= TASK_ENV_MAX_BYTES else {}
    if sandbox is None:
        return await _run_process(command, command, {**os.environ, **env, **task_env}, data)
    async with EndpointRelay(env["OPENAI_BASE_URL"]) as relay:
        launch = sandboxed_command(sandbox, command, {**env, **task_env}, relay)
        # the agent's environment travels on the launcher's stdin: bwrap's command line is readable by any user
        return await _run_process(command, launch.argv, {"PATH": os.environ.get("PATH", os.defpath)},
                                  launch.stdin_header + data)


async def _run_process(command: Sequence[str], argv: Sequence[str], env: Mapping[str, str], data: bytes) -> Any:
    """`_run_command`'s process: ``argv`` under the reaper with ``data`` on stdin; ``command`` names it in errors."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", REAPER, str(os.getpid()), "--", *argv,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=dict(env), start_new_session=True,
    )
    try:
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        _, (stdout, stdout_size), (stderr, _) = await asyncio.gather(
            _feed(process.stdin, data), _tail(process.stdout, MAX_STDOUT_BYTES), _tail(process.stderr, MAX_STDERR_BYTES)
        )
        await process.wait()
    finally:
        if process.returncode is None:  # cancelled (wall time, the runner stopping): the reaper ends them all
            await _stop(process)
    tail = stderr.decode("utf-8", "replace").rstrip()[-STDERR_TAIL_CHARS:]
    if process.returncode != 0:
        last = tail.splitlines()[-1] if tail else "(no stderr)"
        raise AgentError(f"the agent command {list(command)!r} exited with status {process.returncode}: {last}\n"
                         f"its stderr ends with:\n{tail}")
    text = stdout.decode("utf-8", "replace")
    if stdout_size > len(stdout):  # only the end was kept: its first line is cut
        text = text.partition("\n")[2]
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        too_long = f" (its last line is over the {MAX_STDOUT_BYTES} bytes kept)" if stdout_size > len(stdout) else ""
        raise AgentError(f"the agent command {list(command)!r} printed nothing on stdout{too_long}: expected its last "
                         "line to be a JSON number (the reward) or object. Fix: print(json.dumps(reward)) at the end")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise AgentError(f"the agent command {list(command)!r} ended its stdout with {lines[-1]!r:.200}: expected a "
                         "JSON number (the reward), null or an object. Fix: print(json.dumps(reward)) last") from None


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    """Write the task to the command's stdin and close it (a command that does not read it is fine)."""
    try:
        stream.write(data)
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


async def _tail(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, int]:
    """Read ``stream`` to its end; its last ``limit`` bytes and how many it gave in all."""
    kept = bytearray()
    size = 0
    while chunk := await stream.read(1 << 16):
        size += len(chunk)
        kept += chunk
        if len(kept) > limit:
            del kept[: len(kept) - limit]
    return bytes(kept), size


async def _stop(process: asyncio.subprocess.Process) -> None:
    """End a command that is still running: SIGTERM to the reaper (it kills the command and every process it
    started), then SIGKILL to the session it started in, should the reaper not exit within ``REAPER_GRACE_S``."""
    try:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.shield(process.wait()), REAPER_GRACE_S)
    except (ProcessLookupError, TimeoutError):
        pass
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await process.wait()
