"""The LanguageEnv contract and the chat-message spaces."""

from __future__ import annotations

from typing import Any

import pytest

from flashrl.envs import ChatMessages, EpisodeEndedError, LanguageEnv, UnicodeText


class GuessEnv(LanguageEnv):
    """Guess a secret digit; the env answers "higher"/"lower" until the guess is right."""

    def __init__(
        self, *, max_turns: int | None = None, render_mode: str | None = None, bad: str = ""
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.bad = bad
        self.secret = -1

    def _reset_task(self, options: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        self.secret = int(options.get("secret", self.np_random.integers(10)))
        if self.bad == "no_prompt_id":
            return [{"role": "user", "content": "Guess a digit."}], {}
        return [{"role": "user", "content": "Guess a digit."}], {"prompt_id": f"guess:{self.secret}"}

    def _step_action(self, action: str):
        guess = int(action.strip()) if action.strip().isdigit() else -1
        if self.bad == "bad_role":
            return [{"role": "robot", "content": "?"}], 0.0, False, False, {}
        if guess == self.secret:
            return [], 1.0, True, False, {"guess": guess}
        hint = "higher" if guess < self.secret else "lower"
        return [{"role": "user", "content": hint}], 0.0, False, False, {"guess": guess}


def test_play_to_win_and_step_after_end_raises() -> None:
    env = GuessEnv()
    messages, info = env.reset(options={"secret": 7})
    assert messages == [{"role": "user", "content": "Guess a digit."}]
    assert info == {"prompt_id": "guess:7"}
    assert env.step("3") == (
        [{"role": "user", "content": "higher"}],
        0.0,
        False,
        False,
        {"guess": 3, "turn": 1},
    )
    assert env.step("9")[0] == [{"role": "user", "content": "lower"}]
    new, reward, terminated, truncated, info = env.step("7")
    assert (new, reward, terminated, truncated, info["turn"]) == ([], 1.0, True, False, 3)
    assert env.conversation == [
        {"role": "user", "content": "Guess a digit."},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "9"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "7"},
    ]
    with pytest.raises(EpisodeEndedError, match="after the episode ended"):
        env.step("7")
    env.reset(options={"secret": 1})
    assert env.step("1")[1] == 1.0


def test_step_before_reset_and_bad_actions() -> None:
    env = GuessEnv()
    with pytest.raises(EpisodeEndedError, match="before reset"):
        env.step("1")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="reply text"):
        env.step(3)  # type: ignore[arg-type]


def test_turn_limit_truncates_and_drops_the_reply() -> None:
    env = GuessEnv(max_turns=2)
    env.reset(options={"secret": 5})
    assert env.step("1")[2:4] == (False, False)
    new, reward, terminated, truncated, info = env.step("2")
    assert (new, reward, terminated, truncated) == ([], 0.0, False, True)
    assert info["turn_limit_reached"] is True
    with pytest.raises(EpisodeEndedError):
        env.step("5")


def test_seeded_reset_is_reproducible() -> None:
    env = GuessEnv()
    secrets = []
    for _ in range(2):
        env.reset(seed=123)
        secrets.append([env.secret] + [env.reset()[1]["prompt_id"] for _ in range(5)])
    assert secrets[0] == secrets[1]
    assert len({p for p in secrets[0][1:]}) > 1


def test_returned_data_is_a_copy() -> None:
    env = GuessEnv()
    messages, _ = env.reset(options={"secret": 4})
    messages[0]["content"] = "tampered"
    new, *_ = env.step("1")
    new.append({"role": "user", "content": "tampered"})
    assert env.conversation[0]["content"] == "Guess a digit."
    assert len(env.conversation) == 3


def test_subclass_mistakes_get_clear_errors() -> None:
    with pytest.raises(TypeError, match="prompt_id"):
        GuessEnv(bad="no_prompt_id").reset()
    env = GuessEnv(bad="bad_role")
    env.reset()
    with pytest.raises(TypeError, match="role 'robot'"):
        env.step("1")
    with pytest.raises(ValueError, match="render_mode"):
        GuessEnv(render_mode="human")
    with pytest.raises(ValueError, match="max_turns"):
        GuessEnv(max_turns=0)


def test_render_ansi() -> None:
    env = GuessEnv(render_mode="ansi")
    env.reset(options={"secret": 2})
    env.step("0")
    assert env.render() == "[user] Guess a digit.\n[assistant] 0\n[user] higher"
    assert GuessEnv().render() is None


def test_unicode_text_space() -> None:
    space = UnicodeText(10, seed=0)
    assert "héllo wörld"[:10] in space
    assert "多语言 text!" in space
    assert "x" * 11 not in space
    assert 5 not in space
    samples = [space.sample() for _ in range(50)]
    assert all(s in space for s in samples)
    assert any(" " in s or not s.isalnum() for s in samples if s)
    with pytest.raises(ValueError, match="min_length"):
        UnicodeText(3, min_length=4)


def test_chat_messages_space() -> None:
    space = ChatMessages(roles=("user", "assistant"), max_messages=2, seed=1)
    assert [] in space
    assert [{"role": "user", "content": "a\nb ∑"}] in space
    assert [{"role": "system", "content": "x"}] not in space
    assert [{"role": "user", "content": "x", "name": "n"}] not in space
    assert [{"role": "user", "content": 3}] not in space
    assert [{"role": "user", "content": ""}] * 3 not in space
    assert ({"role": "user", "content": ""},) not in space
    assert (
        space.explain([{"role": "user"}])
        == "message 0 has keys ['role'], expected exactly ['content', 'role']"
    )
    assert all(space.sample() in space for _ in range(30))
    space.seed(5)
    first = [space.sample() for _ in range(5)]
    space.seed(5)
    assert [space.sample() for _ in range(5)] == first
