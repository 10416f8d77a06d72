"""Native tool calls: the Hermes/Qwen parser, and tool schemas through real chat templates, token-exact.

The templates: Qwen2.5-Instruct's (the ``chat_template`` of Qwen/Qwen2.5-7B-Instruct's
``tokenizer_config.json``, stored in ``data/``) on Qwen's tokenizer (the built-in ``qwen3-tokenizer``:
Qwen3's files, the same byte-level BPE as Qwen2.5's, with ``<tool_response>`` and ``<think>`` added as
tokens 151665-151668), Qwen3's own, and SmolLM2's (which ignores ``tools``).
"""

from __future__ import annotations

from typing import Any

import pytest

from flashrl.conversation import TokenizedConversation, render_chat
from flashrl.tool_calls import (
    MAX_TOOL_CALL_DEPTH,
    ToolCall,
    function_schema,
    hermes_tools_prompt,
    json_depth,
    parse_tool_calls,
    template_renders_tools,
)

PYTHON = function_schema("python", "Run Python code.", {"code": {"type": "string"}}, ["code"])
ADD = function_schema("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])
CALL_5 = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 3)"}}\n</tool_call>'


def ids_of(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def template_ids(tok: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def model_segments(ids: list[int], mask: list[bool]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask)):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(t)
    return runs


# ------------------------------------------------------------------------------------------ parsing
def test_parse_one_call_and_the_prose_before_it() -> None:
    parsed = parse_tool_calls("Let me compute.\n" + CALL_5)
    assert parsed.content == "Let me compute.\n"
    assert parsed.calls == (
        ToolCall(name="python", arguments={"code": "print(2 + 3)"},
                 raw='{"name": "python", "arguments": {"code": "print(2 + 3)"}}'),
    )


def test_a_deep_call_is_malformed_not_a_crash() -> None:
    """JSON nested 100 000 levels deep would make Python's parser raise RecursionError."""
    deep = '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>"
    (call,) = parse_tool_calls(deep).calls
    assert (call.name, call.arguments) == (None, {})
    assert call.error == "the tool call nests 100002 levels deep; at most 100 are accepted"
    # The bound: 100 levels parse (the object, its arguments and 98 lists); brackets in strings do not count.
    at_bound = '{"name": "add", "arguments": {"a": ' + "[" * 98 + "]" * 98 + ', "b": "[[[{{{"}}'
    assert json_depth(at_bound) == MAX_TOOL_CALL_DEPTH == 100
    (call,) = parse_tool_calls(f"<tool_call>{at_bound}</tool_call>").calls
    assert call.error is None and call.name == "add" and call.arguments["b"] == "[[[{{{"
    (call,) = parse_tool_calls(f"<tool_call>[{at_bound}]</tool_call>").calls
    assert call.error == "the tool call nests 101 levels deep; at most 100 are accepted"


def test_parse_two_calls_an_unclosed_one_and_string_arguments() -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}'  # cut before </tool_call>
    )
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
        ("add", {"a": 1, "b": 2}, None), ("add", {"a": 3, "b": 4}, None)
    ]
    assert parsed.content == " and "


def test_parse_errors_are_kept_per_call() -> None:
    text = (
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "add", "argu'
    )
    calls = parse_tool_calls(text).calls
    assert [c.name for c in calls] == [None, None, "add", None]
    assert calls[0].error.startswith("the tool call is not valid JSON (Expecting property name")
    assert calls[1].error == 'the tool call must be a JSON object with a "name" string'
    assert calls[2].error == '"arguments" must be a JSON object'
    assert calls[3].error.endswith("it is also missing its closing </tool_call>")
    assert parse_tool_calls("no call here").calls == ()
    assert parse_tool_calls("no call here").content == "no call here"


def test_function_schema_shape_and_errors() -> None:
    assert ADD == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    with pytest.raises(ValueError, match=r"required arguments \['c'\] are not in parameters"):
        function_schema("add", "d", {"a": {"type": "integer"}}, ["c"])


# ------------------------------------------------------------------------------------------ Qwen2.5
def test_qwen25_template_renders_the_tools(qwen25_tokenizer: Any) -> None:
    tok = qwen25_tokenizer
    assert template_renders_tools(tok, [PYTHON])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    conv = TokenizedConversation(tok, messages, prompt_id="p", tools=[PYTHON])
    assert conv.tools_rendered_by == "template"
    assert conv.token_ids == template_ids(tok, messages, tools=[PYTHON], add_generation_prompt=True)
    text = tok.decode(conv.token_ids)
    assert text.startswith(
        '<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the '
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "python", "description": "Run Python code.", '
        '"parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}'
        "\n</tools>\n\n"
    )
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # Qwen's chat template tells the model the call format; the fallback text is the same words.
    assert hermes_tools_prompt([PYTHON]) in text


def test_qwen25_three_turn_tool_episode_is_the_template_s_tokens(qwen25_tokenizer: Any) -> None:
    tok = qwen25_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "user", "content": "What is (2 + 3) * 4?"}]
    conv = TokenizedConversation(tok, messages, prompt_id="p", tools=[PYTHON, ADD])
    assert conv.stop_token_ids == {end}
    turns = [
        ids_of(tok, "I will compute.\n" + CALL_5) + [end],
        ids_of(tok, '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 0}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "python", "arguments": {"code": "print(5 * 4)"}}\n</tool_call>') + [end],
        ids_of(tok, "The answer is \\boxed{20}.") + [end],
    ]
    env_turns = [[{"role": "tool", "content": "5"}], [{"role": "tool", "content": "5"}, {"role": "tool", "content": "20"}]]
    assert tok.convert_tokens_to_ids("<tool_call>") in turns[0]  # the model's call token is one token
    for i, turn in enumerate(turns):
        start = len(conv)
        conv.add_model_turn(turn, [-0.5] * len(turn), version=i)
        assert conv.token_ids[start:] == turn  # appended as sampled
        if i < len(env_turns):
            before = len(conv)
            assert conv.add_env_messages(env_turns[i])
            delta = tok.decode(conv.token_ids[before:])
            if i == 1:  # two results in one user turn, as Qwen2.5's template groups them
                assert delta == (
                    "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n20\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n"
                )
    episode = conv.to_episode(reward=1.0)
    assert episode.token_ids == template_ids(tok, conv.messages, tools=[PYTHON, ADD])
    assert model_segments(episode.token_ids, episode.loss_mask) == turns
    assert episode.info["template_verbatim"] is True
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant", "tool", "tool", "assistant"]


# ------------------------------------------------------------------------------------------ Qwen3
def test_qwen3_template_without_reasoning_keeps_the_sampled_tokens(qwen3_tokenizer: Any) -> None:
    """Qwen3 renders a reply's empty reasoning block only while it is the last message: the whole
    conversation is no prefix of its extension, so the new turn is what the template puts after the reply."""
    tok = qwen3_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    conv = TokenizedConversation(tok, [{"role": "user", "content": "2 + 3?"}], prompt_id="p", tools=[PYTHON])
    assert conv.tools_rendered_by == "template"
    assert conv.token_ids == template_ids(tok, [{"role": "user", "content": "2 + 3?"}], tools=[PYTHON],
                                          add_generation_prompt=True)
    turn = ids_of(tok, CALL_5) + [end]
    conv.add_model_turn(turn, [-0.1] * len(turn), 0)
    before = len(conv)
    assert conv.add_env_messages([{"role": "tool", "content": "5"}])
    assert tok.decode(conv.token_ids[before:]) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    answer = ids_of(tok, "<think>\nIt printed 5.\n</think>\n\n\\boxed{5}") + [end]
    conv.add_model_turn(answer, [-0.1] * len(answer), 0)
    episode = conv.to_episode(reward=1.0)
    assert model_segments(episode.token_ids, episode.loss_mask) == [turn, answer]
    assert episode.info["template_verbatim"] is False  # the template would render the first reply otherwise


# ------------------------------------------------------------------------------------------ SmolLM2
def test_smollm2_gets_the_tools_in_its_system_message(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    assert not template_renders_tools(tok, [PYTHON])
    conv = TokenizedConversation(
        tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}],
        prompt_id="p", tools=[PYTHON],
    )
    assert conv.tools_rendered_by == "system_prompt"
    assert conv.messages[0] == {"role": "system", "content": "Be brief.\n\n" + hermes_tools_prompt([PYTHON])}
    call = ids_of(tok, CALL_5) + [2]
    conv.add_model_turn(call, [-0.2] * len(call), 0)
    before = len(conv)
    conv.add_env_messages([{"role": "tool", "content": "5"}])
    assert tok.decode(conv.token_ids[before:]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    answer = ids_of(tok, "\\boxed{5}") + [2]
    conv.add_model_turn(answer, [-0.2] * len(answer), 0)
    conv.add_env_messages([{"role": "user", "content": "Sure?"}])
    again = ids_of(tok, "Yes.") + [2]
    conv.add_model_turn(again, [-0.2] * len(again), 0)
    episode = conv.to_episode(reward=1.0)
    assert episode.token_ids == template_ids(tok, conv.messages)
    assert model_segments(episode.token_ids, episode.loss_mask) == [call, answer, again]
    # Without a system message the description becomes one (replacing SmolLM2's default).
    alone = TokenizedConversation(tok, [{"role": "user", "content": "hi"}], prompt_id="p", tools=[PYTHON])
    assert alone.messages[0] == {"role": "system", "content": hermes_tools_prompt([PYTHON])}
    assert render_chat(tok, alone.messages, generation_prompt=True).count("<|im_start|>system") == 1


def test_tools_given_twice_is_an_error(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="Give the tools once"):
        TokenizedConversation(smollm2_tokenizer, [{"role": "user", "content": "hi"}], tools=[PYTHON],
                              chat_template_kwargs={"tools": [PYTHON]})
