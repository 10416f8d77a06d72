"""PythonToolEnv: reply parsing, observation formatting, and whole episodes through the real sandbox."""

from __future__ import annotations

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import flashrl.envs  # noqa: F401  (registers the ids)
from flashrl.envs.base import EpisodeEndedError
from flashrl.envs.math import MathTask
from flashrl.envs.python_tool import PythonToolEnv, format_observation, parse_reply
from flashrl.envs.sandbox import Sandbox, SandboxConfig, SandboxResult, SandboxUnavailableError

FENCE = "```"
TASK = MathTask(question="What is 12 * 34 - 5?", answer="403", prompt_id="t:403")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(wall_time_s=5.0, max_output_bytes=4096))


def make_env(sandbox: Sandbox, **kwargs) -> PythonToolEnv:
    return PythonToolEnv([TASK], sandbox=sandbox, **kwargs)


def code(body: str, lang: str = "python") -> str:
    return f"{FENCE}{lang}\n{body}\n{FENCE}"


# ------------------------------------------------------------------------------------------ parsing
def test_parse_reply_blocks_and_answer() -> None:
    reply = f"First\n{code('x = 1')}\nthen\n{code('print(x)', 'py')}\nso \\boxed{{7}}"
    assert parse_reply(reply).code_blocks == ("x = 1\n", "print(x)\n")
    assert parse_reply(reply).final_answer == "7"


def test_parse_reply_ignores_boxed_inside_code_and_other_languages() -> None:
    inner = 'print("\\\\boxed{1}")'
    reply = code(inner) + "\n" + FENCE + "bash\nls\n" + FENCE
    parsed = parse_reply(reply)
    assert parsed.final_answer is None
    assert parsed.code_blocks == (inner + "\n",)


def test_parse_reply_runs_an_unterminated_last_block() -> None:
    assert parse_reply(f"{FENCE}python\nprint(2 + 2)\n").code_blocks == ("print(2 + 2)\n",)


def test_parse_reply_plain_text() -> None:
    assert parse_reply("I think it is 5.") == parse_reply("I think it is 5.").__class__((), None)


# ------------------------------------------------------------------------------------------ observation
def _result(**kw) -> SandboxResult:
    base = {"stdout": "", "stderr": "", "exit_code": 0, "timed_out": False, "output_truncated": False, "killed_by": None,
                "duration_s": 0.1, "backend": "landlock"}
    return SandboxResult(**{**base, **kw})


def test_format_observation_exact() -> None:
    text = format_observation(_result(stdout="403\n", stderr="note\n", exit_code=1), max_chars=100, wall_time_s=5)
    assert text == "Exit status: 1\nstdout:\n```\n403\n```\nstderr:\n```\nnote\n```"


def test_format_observation_timeout_signal_and_silence() -> None:
    timed_out = _result(exit_code=None, timed_out=True, killed_by="wall_time")
    assert format_observation(timed_out, max_chars=10, wall_time_s=2.5) == (
        "Timed out after 2.5 s; the program was stopped.\n(no output; use print() to see values)"
    )
    assert format_observation(_result(exit_code=-9), max_chars=10, wall_time_s=1).startswith(
        "Killed by signal 9 (a CPU or memory limit)."
    )


def test_format_observation_truncates_with_marker() -> None:
    text = format_observation(_result(stdout="a" * 30, stderr="b" * 30), max_chars=20, wall_time_s=1)
    assert text == (
        "Exit status: 0\nstdout:\n```\n" + "a" * 20 + "\n[... 10 more characters truncated]\n```\n"
        "stderr:\n```\n[... 30 earlier characters truncated]\n```"
    )


# ------------------------------------------------------------------------------------------ episodes
def test_solve_with_code_then_answer(sandbox: Sandbox) -> None:
    env = make_env(sandbox)
    messages, info = env.reset(seed=0)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"].startswith("What is 12 * 34 - 5?") and info["prompt_id"] == "t:403"
    obs, reward, terminated, truncated, info = env.step("Let me compute.\n" + code("print(12 * 34 - 5)"))
    assert obs == [{"role": "user", "content": "Exit status: 0\nstdout:\n```\n403\n```"}]
    assert (reward, terminated, truncated, info["tool_calls"], info["exit_code"]) == (0.0, False, False, 1, 0)
    obs, reward, terminated, truncated, info = env.step("The answer is \\boxed{403}.")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["correct"] and info["extracted"] == "403" and info["tool_calls"] == 1 and info["turn"] == 2
    with pytest.raises(EpisodeEndedError):
        env.step("again")


def test_wrong_answer_gets_zero(sandbox: Sandbox) -> None:
    env = make_env(sandbox)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("\\boxed{400}")
    assert (reward, terminated, info["correct"], info["tool_calls"]) == (0.0, True, False, 0)


def test_code_errors_and_state_does_not_persist(sandbox: Sandbox) -> None:
    env = make_env(sandbox)
    env.reset(seed=0)
    env.step(code("x = 41"))
    obs, *_ , info = env.step(code("print(x + 1)"))
    content = obs[0]["content"]
    assert content.startswith("Exit status: 1\nstderr:\n```\nTraceback (most recent call last):")
    assert "NameError: name 'x' is not defined" in content and info["exit_code"] == 1


def test_blocks_of_one_reply_run_as_one_program(sandbox: Sandbox) -> None:
    env = make_env(sandbox)
    env.reset(seed=0)
    obs, *_ = env.step(code("x = 20") + "\nand\n" + code("print(x * 2)"))
    assert obs[0]["content"] == "Exit status: 0\nstdout:\n```\n40\n```"


def test_sandbox_limits_reach_the_observation() -> None:
    env = PythonToolEnv([TASK], sandbox=SandboxConfig(wall_time_s=1.0), max_observation_chars=50)
    env.reset(seed=0)
    obs, _, _, _, info = env.step(code("import time\nprint('x' * 80, flush=True)\ntime.sleep(30)"))
    assert obs[0]["content"] == (
        "Timed out after 1 s; the program was stopped.\nstdout:\n```\n" + "x" * 50
        + "\n[... 31 more characters truncated]\n```"
    )
    assert info["timed_out"] and info["exit_code"] is None
    obs, *_ = env.step(code("import socket\nsocket.create_connection(('127.0.0.1', 22))"))
    assert obs[0]["content"].endswith("Error: [Errno 1] Operation not permitted\n```")


def test_observation_suffix_follows_every_tool_output_not_the_reminder(sandbox: Sandbox) -> None:
    hint = "Now reply with only the result in \\boxed{}."
    env = make_env(sandbox, observation_suffix=hint, max_turns=3)
    env.reset(seed=0)
    obs, *_ = env.step(code("print(12 * 34 - 5)"))
    assert obs == [{"role": "user", "content": "Exit status: 0\nstdout:\n```\n403\n```\n\n" + hint}]
    obs, *_ = env.step("Hmm.")  # no code: the protocol reminder, unchanged
    assert obs[0]["content"].startswith("No ```python code block") and hint not in obs[0]["content"]
    hermes = make_env(sandbox, observation_suffix=hint, tool_format="hermes")
    hermes.reset(seed=0)
    obs, *_ = hermes.step(call("print(1)") + call("print(2)"))  # the hint once, after the last result
    assert obs == [
        {"role": "tool", "content": "Exit status: 0\nstdout:\n```\n1\n```"},
        {"role": "tool", "content": "Exit status: 0\nstdout:\n```\n2\n```\n\n" + hint},
    ]
    with pytest.raises(TypeError, match="observation_suffix must be a string; got int"):
        make_env(sandbox, observation_suffix=1)


def test_no_code_no_answer_gets_a_reminder(sandbox: Sandbox) -> None:
    env = make_env(sandbox, observation_role="tool")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("Hmm, let me think about it.")
    assert obs[0]["role"] == "tool" and "No ```python code block and no final answer" in obs[0]["content"]
    assert (reward, terminated, truncated, info["tool_calls"]) == (0.0, False, False, 0)


def test_turn_limit_verifies_the_last_reply_without_running_it(sandbox: Sandbox) -> None:
    env = make_env(sandbox, max_turns=2)
    env.reset(seed=0)
    env.step(code("print(12 * 34 - 5)"))
    obs, reward, terminated, truncated, info = env.step("It is 403\n" + code("open('x','w')"))
    assert (obs, reward, terminated, truncated) == ([], 1.0, False, True)
    assert info["turn_limit_reached"] and info["tool_calls"] == 1 and info["extracted"] == "403"
    single = make_env(sandbox, max_turns=1)
    single.reset(seed=0)
    obs, reward, terminated, truncated, info = single.step("no idea\n" + code("print(x)"))
    assert (obs, reward, terminated, truncated, info["tool_calls"]) == ([], 0.0, False, True, 0)
    assert info["reason"] == "no_answer"


def test_default_tasks_are_seeded_arithmetic(sandbox: Sandbox) -> None:
    env = gym.make("flashrl/PythonTool-v0", sandbox=sandbox)
    first = env.reset(seed=123)
    again = env.reset(seed=123)
    assert first == again and first[1]["prompt_id"].startswith("arith:")
    expression = first[1]["question"].removeprefix("What is ").removesuffix("?")
    env.step(code(f"print({expression})"))
    *_, info = env.step(f"\\boxed{{{eval(expression)}}}")
    assert info["correct"]
    env.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_turns must be an int >= 1; got 0"):
        PythonToolEnv([TASK], max_turns=0)
    with pytest.raises(ValueError, match="observation_role must be one of"):
        PythonToolEnv([TASK], observation_role="robot")
    with pytest.raises(SandboxUnavailableError, match="allow_unconfined=True"):
        PythonToolEnv([TASK], sandbox=SandboxConfig(python="/bin/false"))


def test_gymnasium_env_checker(sandbox: Sandbox) -> None:
    check_env(PythonToolEnv([TASK], sandbox=sandbox), skip_render_check=True)


# ------------------------------------------------------------------------------------ native tool calls
def call(code_text: str, name: str = "python") -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code_text}}) + "\n</tool_call>"


def test_hermes_tool_calls_run_and_answer(sandbox: Sandbox) -> None:
    env = make_env(sandbox, tool_format="hermes", max_calls_per_turn=2)
    messages, info = env.reset(seed=0)
    assert info["tools"] == [{
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program in a fresh sandboxed interpreter (no network, no state kept "
                           "between calls) and return its exit status, stdout and stderr.",
            "parameters": {"type": "object", "properties": {"code": {
                "type": "string", "description": "The program; print what you need to see."}}, "required": ["code"]},
        },
    }]
    assert "python tool" in messages[0]["content"] and "```" not in messages[0]["content"]
    # Two calls: two programs, two tool messages; a third is refused (max_calls_per_turn=2).
    obs, reward, terminated, truncated, info = env.step(
        "Compute.\n" + call("print(12 * 34)") + "\n" + call("print(-5)") + call("print(0)")
    )
    assert obs == [
        {"role": "tool", "content": "Exit status: 0\nstdout:\n```\n408\n```"},
        {"role": "tool", "content": "Exit status: 0\nstdout:\n```\n-5\n```"},
        {"role": "tool", "content": "Error: at most 2 tool calls are run per turn; this one was not run."},
    ]
    assert (reward, terminated, truncated, info["tool_calls"], info["tool_calls_refused"]) == (0.0, False, False, 2, 1)
    obs, _, _, _, info = env.step(call("print(1)", name="bash") + '<tool_call>{"name": "python"}</tool_call>')
    assert obs == [
        {"role": "tool", "content": "Error: there is no tool 'bash'; the tools are ['python']."},
        {"role": "tool", "content": "Error: python needs the arguments ['code']."},
    ]
    assert info["tool_calls"] == 2 and info["tool_calls_refused"] == 2
    obs, reward, terminated, truncated, info = env.step("So \\boxed{403}.")
    assert (obs, reward, terminated, truncated, info["correct"]) == ([], 1.0, True, False, True)


def test_hermes_reminder_and_turn_limit(sandbox: Sandbox) -> None:
    env = make_env(sandbox, tool_format="hermes", max_turns=2)
    env.reset(seed=0)
    obs, _, terminated, truncated, _ = env.step("I think it is 400.")
    assert obs == [{"role": "user", "content": (
        "No tool call and no final answer found. Call the python tool to run code, or give the final "
        "answer in \\boxed{}.")}]
    assert (terminated, truncated) == (False, False)
    obs, _, terminated, truncated, info = env.step(call("print(403)"))  # the last turn: not run
    assert (obs, terminated, truncated, info["tool_calls"]) == ([], False, True, 0)
    assert info["turn_limit_reached"]
    with pytest.raises(ValueError, match="tool_format must be one of"):
        make_env(sandbox, tool_format="json")


def test_hermes_episode_through_the_qwen25_template_is_token_exact(sandbox: Sandbox) -> None:
    """The env's own schema, replies and tool messages, through Qwen2.5's template: the template's ids."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from flashrl.conversation import TokenizedConversation
    from flashrl.models import resolve_tokenizer

    tok = AutoTokenizer.from_pretrained(resolve_tokenizer("qwen3-tokenizer"))
    tok.chat_template = (Path(__file__).parent / "data" / "qwen2_5_instruct_chat_template.jinja").read_text()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    env = make_env(sandbox, tool_format="hermes")
    messages, info = env.reset(seed=0)
    conv = TokenizedConversation(tok, messages, prompt_id=info["prompt_id"], tools=info["tools"])
    assert conv.tools_rendered_by == "template"
    for reply in (call("print(12 * 34)"), "Then " + call("print(408 - 5)"), "\\boxed{403}"):
        ids = tok(reply, add_special_tokens=False)["input_ids"] + [end]
        text = conv.add_model_turn(ids, [-0.3] * len(ids), 0)
        obs, reward, terminated, _, _ = env.step(text)
        if terminated:
            break
        assert obs[0]["role"] == "tool"
        conv.add_env_messages(obs)
    episode = conv.to_episode(reward=reward)
    assert reward == 1.0 and episode.info["num_model_turns"] == 3
    expected = tok.apply_chat_template(conv.messages, tools=info["tools"], tokenize=True, return_dict=False)
    assert episode.token_ids == list(expected)
    assert "<tool_response>\nExit status: 0\nstdout:\n```\n403\n```\n</tool_response>" in tok.decode(episode.token_ids)
