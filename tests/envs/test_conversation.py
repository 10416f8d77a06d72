"""Token-exact episodes through SmolLM2's chat template (ChatML: <|im_start|>role\\n...<|im_end|>\\n)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashrl.conversation import (
    ChatTemplateError,
    TokenizedConversation,
    chat_stop_token_ids,
    render_chat,
)
from flashrl.envs import LanguageEnv

IM_START, IM_END, ENDOFTEXT, NEWLINE = 1, 2, 0, 198
USER = [{"role": "user", "content": "What is 2 + 3?"}]


def ids_of(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def model_segments(ids: list[int], mask: list[bool]) -> list[list[int]]:
    """Consecutive runs of loss_mask=True tokens, read straight from the sequence."""
    runs: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask)):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(t)
    return runs


def test_stop_tokens_of_the_template(smollm2_tokenizer: Any) -> None:
    assert smollm2_tokenizer.convert_ids_to_tokens([IM_START, IM_END, ENDOFTEXT, NEWLINE]) == [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "Ċ",
    ]
    assert chat_stop_token_ids(smollm2_tokenizer) == {IM_END}


def test_two_turns_equal_the_rendered_conversation(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    conv = TokenizedConversation(tok, USER, prompt_id="p")
    prompt = ids_of(tok, render_chat(tok, USER, generation_prompt=True))
    assert (
        conv.token_ids == prompt and conv.prompt_token_ids() == prompt and conv.prompt_length == len(prompt)
    )
    turn1 = ids_of(tok, "It is 5.") + [IM_END]
    assert conv.add_model_turn(turn1, [-0.5] * len(turn1), version=3) == "It is 5."
    assert conv.add_env_messages([{"role": "user", "content": "Sure?"}]) is True
    # Only the "\n" after the sampled <|im_end|> was added, then the user turn and the generation prompt.
    assert conv.token_ids[len(prompt) + len(turn1) :] == [NEWLINE] + ids_of(
        tok, "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    )
    turn2 = ids_of(tok, "Yes: 5") + [IM_END]
    conv.add_model_turn(turn2, [-0.25] * len(turn2), version=4)
    episode = conv.to_episode(reward=1.0, info={"correct": True})
    messages = USER + [
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes: 5"},
    ]
    assert conv.messages == messages
    # Canonical sampled ids make the episode identical to tokenising the rendered conversation.
    assert episode.token_ids == ids_of(tok, render_chat(tok, messages, generation_prompt=False))
    assert model_segments(episode.token_ids, episode.loss_mask) == [turn1, turn2]
    assert [lp for lp, m in zip(episode.behavior_logprobs, episode.loss_mask) if m] == [-0.5] * len(turn1) + [
        -0.25
    ] * len(turn2)
    assert all(lp == 0.0 for lp, m in zip(episode.behavior_logprobs, episode.loss_mask) if not m)
    assert episode.policy_versions == [3, 4]
    assert (episode.prompt_id, episode.reward, episode.terminated, episode.truncated) == (
        "p",
        1.0,
        True,
        False,
    )
    assert episode.info["correct"] is True and episode.info["num_model_turns"] == 2


def test_length_stop_gets_the_end_token_unmasked(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    conv = TokenizedConversation(tok, USER)
    turn = ids_of(tok, "Let me think about")
    conv.add_model_turn(turn, [-1.0] * len(turn), 0, "length")
    conv.add_env_messages([{"role": "user", "content": "Go on."}])
    n = conv.prompt_length + len(turn)
    assert conv.token_ids[n : n + 3] == [IM_END, NEWLINE, IM_START]
    assert conv.loss_mask[n : n + 3] == [False, False, False]
    episode = conv.to_episode(reward=0.0, prompt_id="late")
    assert episode.prompt_id == "late" and episode.info["finish_reasons"] == ["length"]


def test_other_stop_token_is_kept_and_the_turn_closed(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    conv = TokenizedConversation(tok, USER, prompt_id="p", stop_token_ids=[IM_END, ENDOFTEXT])
    turn = ids_of(tok, "5") + [ENDOFTEXT]
    assert conv.add_model_turn(turn, [-0.1] * len(turn), 0) == "5"
    episode = conv.to_episode(reward=1.0)
    assert episode.token_ids[-4:] == turn[-2:] + [IM_END, NEWLINE]
    assert episode.loss_mask[-4:] == [True, True, False, False]


def test_non_canonical_sampled_ids_are_kept(smollm2_tokenizer: Any) -> None:
    """A model may sample "5" as two tokens where the tokenizer would use one: never re-encoded."""
    tok = smollm2_tokenizer
    canonical = ids_of(tok, "hello")
    split = ids_of(tok, "hel") + ids_of(tok, "lo")
    assert canonical != split  # the premise: a different token split of the same text
    conv = TokenizedConversation(tok, USER, prompt_id="p")
    conv.add_model_turn(split + [IM_END], [-0.3] * (len(split) + 1), 0)
    conv.add_env_messages([{"role": "user", "content": "again"}])
    conv.add_model_turn(split + [IM_END], [-0.3] * (len(split) + 1), 1)
    episode = conv.to_episode(reward=0.0)
    assert model_segments(episode.token_ids, episode.loss_mask) == [split + [IM_END]] * 2
    assert decode(tok, episode.token_ids) == render_chat(tok, conv.messages, generation_prompt=False)


# Text a tokenizer round-trips: no control characters except newline and tab, no unassigned or
# private-use code points (SmolLM2's tokenizer drops "\x16" and mangles U+40000 on its own).
TEXT = st.text(
    st.characters(exclude_categories=("Cs", "Cn", "Co", "Cc"), include_characters="\n\t"), max_size=30
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(st.tuples(TEXT, TEXT, st.booleans()), min_size=1, max_size=3),
    data=st.data(),
)
def test_property_model_tokens_exact_and_decode_reproduces(
    smollm2_tokenizer: Any, turns: list, data: Any
) -> None:
    tok = smollm2_tokenizer
    conv = TokenizedConversation(tok, [{"role": "system", "content": "sys"}] + USER, prompt_id="p")
    sampled: list[list[int]] = []
    for i, (reply, env_text, stopped) in enumerate(turns):
        ids = ids_of(tok, reply) + ([IM_END] if stopped else [])
        if not ids:
            ids = [IM_END]
        lps = data.draw(st.lists(st.floats(-20, 0), min_size=len(ids), max_size=len(ids)))
        conv.add_model_turn(ids, lps, i, "stop" if stopped else "length")
        sampled.append(ids)
        if i < len(turns) - 1:
            conv.add_env_messages([{"role": "user", "content": env_text}])
    episode = conv.to_episode(reward=1.0)
    assert model_segments(episode.token_ids, episode.loss_mask) == sampled
    assert decode(tok, episode.token_ids) == render_chat(tok, conv.messages, generation_prompt=False)
    assert len(episode.token_ids) == len(episode.loss_mask) == len(episode.behavior_logprobs)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=12), min_size=1, max_size=3))
def test_property_arbitrary_token_ids_survive(smollm2_tokenizer: Any, raw: list[list[int]]) -> None:
    """Whatever ids a (random) model samples, special tokens included, they stay in place."""
    conv = TokenizedConversation(smollm2_tokenizer, USER, prompt_id="p", max_tokens=400)
    for i, ids in enumerate(raw):
        conv.add_model_turn(ids, [-1.0] * len(ids), i)
        if i < len(raw) - 1:
            assert conv.add_env_messages([{"role": "user", "content": f"turn {i}"}])
    episode = conv.to_episode(reward=0.0)
    assert [t for t, m in zip(episode.token_ids, episode.loss_mask) if m] == [t for ids in raw for t in ids]
    assert episode.policy_versions == list(range(len(raw)))


# --------------------------------------------------------------------------------------- budget
def test_budget_cuts_a_long_model_turn(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    conv = TokenizedConversation(
        tok,
        USER,
        prompt_id="p",
        max_tokens=len(ids_of(tok, render_chat(tok, USER, generation_prompt=True))) + 5,
    )
    assert conv.max_new_tokens(256) == 5
    turn = list(range(1000, 1012))
    conv.add_model_turn(turn, [-0.1] * 12, 0)
    assert conv.truncated and conv.max_new_tokens(256) == 0
    assert conv.token_ids[conv.prompt_length :] == turn[:5]
    episode = conv.to_episode(reward=0.0, terminated=True)
    assert (episode.truncated, episode.terminated) == (True, False)
    assert len(episode.token_ids) == conv.max_tokens and episode.info["context_budget_exceeded"]
    with pytest.raises(RuntimeError, match="context budget"):
        conv.add_model_turn([5], [-0.1], 1)


def test_budget_stops_an_env_turn_that_does_not_fit(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    prompt_len = len(ids_of(tok, render_chat(tok, USER, generation_prompt=True)))
    conv = TokenizedConversation(tok, USER, prompt_id="p", max_tokens=prompt_len + 12)
    turn = ids_of(tok, "5") + [IM_END]
    conv.add_model_turn(turn, [-0.1] * len(turn), 0)
    before = conv.token_ids
    assert conv.add_env_messages([{"role": "user", "content": "Now explain why, in detail please."}]) is False
    assert conv.truncated and conv.token_ids == before
    episode = conv.to_episode(reward=1.0, terminated=False)
    assert episode.truncated and episode.token_ids[: len(before)] == before
    assert len(episode.token_ids) <= prompt_len + 12


def test_prompt_longer_than_the_budget(smollm2_tokenizer: Any) -> None:
    conv = TokenizedConversation(smollm2_tokenizer, USER, prompt_id="p", max_tokens=4)
    assert conv.truncated and conv.max_new_tokens(10) == 0
    episode = conv.to_episode(reward=0.0)
    assert episode.truncated and episode.num_generated_tokens == 0


def test_bad_engine_output_is_recorded_not_raised(smollm2_tokenizer: Any) -> None:
    """NaN / positive log-probs and an aborted turn end up in the episode, where the runner drops them."""
    tok = smollm2_tokenizer
    conv = TokenizedConversation(tok, USER, prompt_id="p")
    conv.add_model_turn([5, 6, IM_END], [float("nan"), 0.5, -0.2], 0, finish_reason="abort")
    episode = conv.to_episode(reward=1.0)
    generated = [lp for lp, m in zip(episode.behavior_logprobs, episode.loss_mask) if m]
    assert generated[1:] == [0.5, -0.2] and generated[0] != generated[0]  # NaN kept as sampled
    assert not episode.is_finite
    assert episode.info["finish_reasons"] == ["abort"]


def test_an_aborted_turn_cut_by_the_budget_stays_aborted(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    prompt_len = len(ids_of(tok, render_chat(tok, USER, generation_prompt=True)))
    conv = TokenizedConversation(tok, USER, prompt_id="p", max_tokens=prompt_len + 2)
    conv.add_model_turn([1000, 1001, 1002, 1003], [-0.1] * 4, 0, finish_reason="abort")
    assert conv.truncated
    assert conv.to_episode(reward=0.0).info["finish_reasons"] == ["abort"]
    conv = TokenizedConversation(tok, USER, prompt_id="p", max_tokens=prompt_len + 2)
    conv.add_model_turn([1000, 1001, 1002, 1003], [-0.1] * 4, 0, finish_reason="stop")
    assert conv.to_episode(reward=0.0).info["finish_reasons"] == ["length"]


# --------------------------------------------------------------------------------------- errors
def test_misuse_errors(smollm2_tokenizer: Any) -> None:
    conv = TokenizedConversation(smollm2_tokenizer, USER)
    with pytest.raises(RuntimeError, match="before a model turn"):
        conv.add_env_messages([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="logprobs"):
        conv.add_model_turn([5, 6], [-0.1], 0)
    conv.add_model_turn([5, IM_END], [-0.1, -0.2], 0)
    with pytest.raises(RuntimeError, match="twice in a row"):
        conv.add_model_turn([5], [-0.1], 0)
    with pytest.raises(ValueError, match="no messages"):
        conv.add_env_messages([])
    with pytest.raises(TypeError, match="message 0"):
        conv.add_env_messages([{"role": "user"}])
    with pytest.raises(ValueError, match="prompt_id"):
        conv.to_episode(reward=0.0)
    with pytest.raises(ValueError, match="at least one"):
        TokenizedConversation(smollm2_tokenizer, [])


def test_templates_that_cannot_be_extended(smollm2_tokenizer: Any) -> None:
    tok = copy.deepcopy(smollm2_tokenizer)
    # Renders only the last two messages: earlier turns vanish, so no delta is a suffix.
    tok.chat_template = (
        "{% for m in messages[-2:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    conv = TokenizedConversation(tok, [{"role": "system", "content": "s"}] + USER)
    with pytest.raises(ChatTemplateError, match="prefix"):
        conv.add_model_turn([5, IM_END], [-0.1, -0.1], 0)
    # Upper-cases assistant content: the reply is not rendered verbatim.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
        "{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    conv = TokenizedConversation(tok, USER)
    with pytest.raises(ChatTemplateError, match="rewrites the assistant"):
        conv.add_model_turn(ids_of(tok, "it is five") + [IM_END], [-0.1] * 4, 0)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        TokenizedConversation(tok, USER)


def test_template_that_trims_keeps_tokens_exact(smollm2_tokenizer: Any) -> None:
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    conv = TokenizedConversation(tok, USER, prompt_id="p")
    turn = ids_of(tok, "  5  ") + [IM_END]
    conv.add_model_turn(turn, [-0.1] * len(turn), 0)
    conv.add_env_messages([{"role": "user", "content": "ok"}])
    episode = conv.to_episode(reward=1.0)
    assert model_segments(episode.token_ids, episode.loss_mask)[0] == turn
    assert episode.info["template_verbatim"] is False


# --------------------------------------------------------------------------------------- real sampling
class CountdownEnv(LanguageEnv):
    """Three turns: the env replies with how many turns are left, then ends with reward 1."""

    def _reset_task(self, options: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return [{"role": "user", "content": "Say anything, three times."}], {"prompt_id": "countdown"}

    def _step_action(self, action: str):
        left = 3 - (self.turn + 1)
        if left == 0:
            return [], 1.0, True, False, {"replies": self.turn + 1}
        return [{"role": "user", "content": f"{left} more."}], 0.0, False, False, {}


def test_real_sampled_multi_turn_episode(tiny_llama_path: str) -> None:
    """A real engine's sampled ids and log-probs land in the episode unchanged."""
    from flashrl.engines import SamplingConfig, make_engine

    engine = make_engine("torch", tiny_llama_path, seed=0)
    try:
        tok = engine.tokenizer
        env = CountdownEnv()

        async def play() -> tuple[TokenizedConversation, Any, list[Any]]:
            messages, info = env.reset(seed=0)
            conv = TokenizedConversation(tok, messages, prompt_id=info["prompt_id"], max_tokens=512)
            completions = []
            while True:
                sampling = SamplingConfig(
                    max_tokens=conv.max_new_tokens(12),
                    seed=len(completions),
                    stop_token_ids=tuple(conv.stop_token_ids),
                )
                out = await engine.generate(conv.prompt_token_ids(), sampling)
                completions.append(out)
                text = conv.add_model_turn(out.token_ids, out.logprobs, out.version, out.finish_reason)
                new, reward, terminated, truncated, step_info = env.step(text)
                if terminated or truncated:
                    return (
                        conv,
                        conv.to_episode(reward=reward, terminated=terminated, info=step_info),
                        completions,
                    )
                assert conv.add_env_messages(new)

        conv, episode, completions = asyncio.run(play())
        assert len(completions) == 3 and episode.reward == 1.0 and episode.info["replies"] == 3
        sampled = [t for c in completions for t in c.token_ids]
        assert [t for t, m in zip(episode.token_ids, episode.loss_mask) if m] == sampled
        assert [lp for lp, m in zip(episode.behavior_logprobs, episode.loss_mask) if m] == [
            lp for c in completions for lp in c.logprobs
        ]
        assert episode.policy_versions == [0, 0, 0]
        assert decode(tok, episode.token_ids) == render_chat(tok, conv.messages, generation_prompt=False)
    finally:
        engine.close()
